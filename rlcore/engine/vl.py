"""Vision-language pieces of the policy engine (Qwen3-VL and Qwen2.5-VL through VeOmni's patched
modeling): the vision tower (what ``freeze_vision_tower`` freezes), the extra forward inputs of a
packed image+text row, and the checkpoint-name mapping a released Qwen2.5-VL folder needs. Used
by ``rlcore.engine_veomni`` only.

Facts this relies on (veomni 0.1.12, veomni/models/transformers/qwen3_vl/generated/
patched_modeling_qwen3_vl_gpu.py, "VL" below; transformers 5.19):

* Image features replace the ``<|image_pad|>`` tokens of ``input_ids`` in order of appearance:
  the mask is ``input_ids == image_token_id`` (VL:1757, called at VL:1872) and the images' merged
  features, in ``pixel_values`` order, are ``masked_scatter``-ed into it (VL:1929-1939). Each
  image is encoded on its own: the ViT's attention splits at ``cu_seqlens`` built from
  ``image_grid_thw`` (VL:1201-1216; per-image sdpa/eager calls VL:549-567), so packing several
  samples' images into one ``pixel_values`` changes nothing per image. The deepstack features are
  added to the same positions inside the text model's layer loop (VL:1479-1485, VL:1501-1516),
  before its final norm (VL:1487): the ``hidden_rows`` hook on ``get_decoder()`` (the text model,
  found through ``model.model``: transformers/modeling_utils.py:2267-2273) sees the finished
  hidden states.
* ``position_ids`` ``(4, 1, L)`` = text row, then M-RoPE t/h/w (transformers/models/qwen3_vl/
  modeling_qwen3_vl.py:797-809, the same in VL:1440-1452; VeOmni passes it on unchanged, it
  transposes only a ``(B, 3, L)`` tensor, VL:2090-2093). The text row goes to
  ``create_causal_mask`` (VL:1454-1460): with ``attention_mask=None`` transformers finds the
  packed sequences from its resets (transformers/masking_utils.py:731-760, 854-862) and builds the
  block-causal mask; a 4D mask is used as is (masking_utils.py:813-815). A ``(3, 1, L)`` tensor
  has no text row: the mask is then plain causal over the whole row and the packed samples
  attend to each other, so it is refused here. ``mm_token_type_ids`` is only read to compute
  positions when ``position_ids`` is None (VL:1864, VL:2048-2089): not needed.
* A row without images on a multi-rank run: VeOmni runs the ViT on a dummy image and adds
  0 x its output (VL:1957-1963, VL:1312-1369; ``fsdp_enabled`` = world size > 1,
  veomni/distributed/parallel_state.py:250-255), so every rank gathers and reduces the same
  FSDP units whatever its row holds.
* Kernels: the file's OpSlots are rms_norm, cross_entropy_loss, rotary_pos_emb and
  rotary_pos_emb_vision (VL:108-111); ``rlcore.engine.kernels`` picks them per device (eager on CPU).

Qwen2.5-VL (veomni/models/transformers/qwen2_5vl/generated/patched_modeling_qwen2_5_vl_gpu.py,
"V25" below) takes the same inputs the same way, so ``forward_kwargs`` serves both:

* ``(4, 1, L)`` positions: the text model splits off row 0 as the text positions (V25:1298-1303)
  and builds the mask from it (V25:1306-1321); ``Qwen2_5_VLModel.forward`` transposes only a
  ``(B, 3, L)`` tensor (V25:1860-1862). The image mask is ``input_ids == image_token_id``
  (V25:1599-1610, called at V25:1733) and the features are ``masked_scatter``-ed in order
  (V25:1779-1797). No deepstack.
* The ViT is window attention: tokens are reordered by ``window_index`` (V25:785), every block
  but ``fullatt_block_indexes`` attends within ``cu_window_seqlens`` windows, the others within
  each image's ``cu_seqlens`` (V25:826-840), and the merged output is put back in order (V25:845,
  860). Windows are cut per image (V25:191-212), so packed images stay independent here too.
  ``get_metadata_collate_func`` (V25:2330-2341 -> ``collate_multimodal_metadata`` V25:245-285)
  computes all of it on the host; the ViT uses it instead of its own build (V25:705-760, 818-820).
* Rows without images on several ranks: the same dummy ViT forward (V25:1798-1803, 1822-1827); its
  dummy image is hard-coded for patch 14, 3 channels, temporal patch 2 (V25:898, 909).
* The only OpSlot is cross_entropy_loss (V25:97).
* Two gaps of that forward ``_family_kwargs`` closes: the image masks are passed in (its
  sequence-parallel all-gather otherwise runs without SP and fails on 2 ranks), and a text-only
  row's ``(1, L)`` positions keep their text row (else its packed sequences attend to each other).
* Weight names: the released Qwen2.5-VL checkpoints (and transformers 5.19's default save) use
  ``visual.*`` / ``model.layers.*`` (transformers/conversion_mapping.py:826-831 renames them on
  load, :131-132 for Qwen2.5-VL), VeOmni's modules are ``model.visual.*`` /
  ``model.language_model.*``, and VeOmni renames checkpoint keys only through a model's
  ``_checkpoint_conversion_mapping`` (veomni/models/module_utils.py:316-335, applied at :401,
  :654, :684), which its Qwen2.5-VL class lacks: such a folder loads NOTHING but ``lm_head`` and
  VeOmni randomly initialises the rest with an info-level log (module_utils.py:393-395,
  1322-1325). ``apply_checkpoint_key_mapping`` sets that mapping (measured: a legacy folder then
  loads bit-exactly); it has to run between ``build_foundation_model`` and VeOmni's weight load
  (``rlcore.engine.build.build_sharded_model``). ``rlcore.demo.vl`` writes the module names,
  which need no mapping; the policy exports module names too (vLLM maps both layouts, vllm 0.32.0
  model_executor/models/qwen2_5_vl.py:1313-1322).
"""

from __future__ import annotations

import torch

VISION_PREFIX = "model.visual."  # module names of the vision tower (patch embed, blocks, mergers)

# Checkpoint names of released Qwen2-VL / Qwen2.5-VL folders -> the module names, as VeOmni's
# ``_convert_weight_key`` takes them (pattern -> replacement, first match wins): transformers 5.19
# conversion_mapping.py:826-831 (Qwen2VLForConditionalGeneration; Qwen2.5-VL aliased at :131-132).
_LEGACY_KEY_MAPPING = {
    "qwen2_vl": {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"},
    "qwen2_5_vl": {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"},
}


def checkpoint_key_mapping(model) -> dict[str, str] | None:
    """The checkpoint-key renaming a VeOmni model of this type needs for released checkpoints
    (None: its checkpoint names are its module names). Qwen3-VL needs none."""
    return _LEGACY_KEY_MAPPING.get(getattr(getattr(model, "config", None), "model_type", None))


def apply_checkpoint_key_mapping(model) -> bool:
    """Before VeOmni loads the weights: let it rename released Qwen2.5-VL checkpoint keys
    (``visual.*``, ``model.layers.*``) onto its module names (``model.visual.*``,
    ``model.language_model.layers.*``) through ``_checkpoint_conversion_mapping``
    (veomni/models/module_utils.py:316-335). Keys already in module form match no pattern. Returns
    whether a mapping was set; a model that brings its own mapping keeps it."""
    mapping = checkpoint_key_mapping(model)
    if mapping is None or getattr(model, "_checkpoint_conversion_mapping", None):
        return False
    model._checkpoint_conversion_mapping = dict(mapping)
    return True


def vision_tower(model) -> torch.nn.Module | None:
    """The whole ``visual`` module (patch embedding, position embedding, ViT blocks, the merger and
    the deepstack mergers), or None for a text-only model. The mergers count as the vision tower,
    as in verl's ``get_vl_model_vision_tower`` (``model.model.visual``): freezing it trains the
    language model only. Under VeOmni's LoRA wrapper (rlcore.engine.lora), that of its base model."""
    from veomni.lora import VeOmniLoraModel

    if isinstance(model, VeOmniLoraModel):
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    return getattr(inner, "visual", None)


def freeze_vision_tower(model) -> int:
    """``requires_grad=False`` on every vision-tower parameter (before the optimizer is built:
    VeOmni's ``build_optimizer`` drops frozen parameters, veomni/optim/optimizer.py:139, so they
    get no AdamW state). FSDP2 takes frozen and trainable parameters in one unit (the root unit
    holds the patch embedding and mergers next to the text embeddings): it reduce-scatters only
    the parameters that got a gradient (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:
    276-278, 620-636). Returns the number of frozen elements."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError("freeze_vision_tower=True, but the model has no vision tower (model.model.visual)")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def describe(model, frozen: bool) -> str:
    """The describe() element for a VL model ('' for a text-only one)."""
    if vision_tower(model) is None:
        return ""
    return f", vision tower {'frozen' if frozen else 'trained'}"


def forward_kwargs(model, input_ids: torch.Tensor, position_ids: torch.Tensor, mm: dict | None,
                   device: torch.device, sp=None) -> dict:
    """The image inputs of one packed row, checked against ``input_ids``, as keyword arguments of
    VeOmni's Qwen3-VL / Qwen2.5-VL forward ({} for a text-only row, but for ``_family_kwargs``).

    ``mm``: ``pixel_values`` (P, C) float and ``image_grid_thw`` (I, 3) int of every image of the
    row, in order of appearance. The ViT metadata (per-image ``cu_seqlens``, ``max_seqlen``; for
    Qwen2.5-VL also the windows) is computed here on the host with VeOmni's own collator hook
    (VL:263-315, exposed by ``get_metadata_collate_func`` VL:2545-2549; V25:245-285, V25:2330-2341),
    as VeOmni's data pipeline does, so the ViT forward skips its own host-side build
    (VL:1201-1206, VL:1258-1259; V25:705-760).

    ``sp`` (a ``rlcore.engine.ulysses.Context``; Qwen3-VL only): ``input_ids`` is still the whole
    row, but each rank of the group gets its slice of the patches, as VeOmni's collator slices them
    (``sp_pad_and_slice``, pad_scale 4 = merge^2: a merged token's patches stay on one rank), and
    the metadata's ``cu_seqlens`` ends with the padding as an image of its own (VL:275-305). The
    Qwen3-VL forward then all-gathers the row's ids for the image mask, gathers the image features
    and slices the embeddings and deepstack features to the rank's positions itself (VL:1866-2017)."""
    tower = vision_tower(model)
    L = input_ids.shape[1]
    if position_ids.dim() == 3 and (tower is None or tuple(position_ids.shape) != (4, 1, L)):
        raise ValueError(f"position_ids must be (1, L){' or (4, 1, L)' if tower is not None else ''} for this "
                         f"model, got {tuple(position_ids.shape)} with L = {L}")
    if mm is not None and tower is None:
        raise ValueError("mm (image inputs) given to a text-only model")
    if mm is not None and set(mm) != {"pixel_values", "image_grid_thw"}:
        raise ValueError(f"mm takes pixel_values and image_grid_thw, got {sorted(mm)}")
    extra = _family_kwargs(model, input_ids, device)
    if mm is None or mm["image_grid_thw"].shape[0] == 0:  # a row without images
        if tower is not None and bool((input_ids == model.config.image_token_id).any()):
            raise ValueError("input_ids hold image tokens but mm (the images) is None")
        return extra
    pixel_values, grid = mm["pixel_values"], mm["image_grid_thw"]
    if position_ids.dim() != 3:
        raise ValueError(f"with images, position_ids must be (4, 1, L) = (text, t, h, w) x 1 x {L} "
                         f"(see VeOmniPolicy.forward_logprobs), got {tuple(position_ids.shape)}")
    if grid.dim() != 2 or grid.shape[1] != 3 or pixel_values.dim() != 2:
        raise ValueError(f"image_grid_thw must be (I, 3) and pixel_values (P, C), got {tuple(grid.shape)} and "
                         f"{tuple(pixel_values.shape)}")
    grid_cpu = grid.detach().to("cpu", torch.long)
    patches = int(grid_cpu.prod(-1).sum())
    merge = model.config.vision_config.spatial_merge_size
    n_tokens = int((input_ids == model.config.image_token_id).sum())
    if pixel_values.shape[0] != patches or n_tokens != patches // merge**2:
        # masked_scatter would silently take the leading features (VL:1929-1939)
        raise ValueError(f"image_grid_thw describes {patches} patches = {patches // merge**2} image tokens, but "
                         f"pixel_values has {pixel_values.shape[0]} rows and input_ids {n_tokens} image tokens")
    batch, sp_pad = {"image_grid_thw": grid_cpu}, {}
    if sp is not None:  # the function the ViT slices its position embeddings with (VL:1187-1189, 1233-1236)
        from veomni.distributed.sequence_parallel.data import sp_pad_and_slice

        whole = pixel_values.shape[0]
        pixel_values = sp_pad_and_slice(pixel_values, dim=0, pad_value=0, pad_scale=4)
        sp_pad["pixel_values"] = pixel_values.shape[0] * sp.size - whole
    model.get_metadata_collate_func()(batch, sp_pad)
    return {"pixel_values": pixel_values.to(device), "image_grid_thw": grid_cpu.to(device),
            "multimodal_metadata": batch["multimodal_metadata"], **extra}


# Families whose VeOmni forward needs the two adaptations of ``_family_kwargs``.
_QWEN2_5_FAMILY = {"qwen2_5_vl"}


def _family_kwargs(model, input_ids: torch.Tensor, device: torch.device) -> dict:
    """Per-family fixes around VeOmni's Qwen2.5-VL forward ({} for the others):

    * The placeholder masks, passed in. Without them ``Qwen2_5_VLModel.forward`` all-gathers
      ``input_ids`` over ``sp_group`` into a list of ``sp_size`` tensors even when sequence
      parallelism is off (V25:1730-1733; Qwen3-VL guards it with ``sp_enabled``, VL:1865-1871):
      ``sp_group`` is then None = the whole world (veomni/distributed/parallel_state.py:376-380),
      and on 2 ranks gloo fails ("invalid output tensor list at index 0 (expected length 2, got
      1)"). Given masks skip it (V25:1725-1726, 1730); they are what it would compute
      (V25:1599-1610).
    * A text-only row's ``(1, L)`` positions keep their text row: the Qwen2.5-VL text model
      expands ``(B, L)`` to 3 M-RoPE rows only (V25:1285-1286) and then builds no packed mask
      (text positions None, V25:1298-1303), so the packed sequences of the row would attend to
      each other (measured: 0.15 off transformers per sequence). Qwen3-VL expands to 4 rows, text
      row first (VL:1445-1446). A pre-hook on the text model does the same for Qwen2.5-VL."""
    if getattr(model.config, "model_type", None) not in _QWEN2_5_FAMILY:
        return {}
    text_model = model.get_decoder()  # model.model.language_model
    if not getattr(text_model, "_rlcore_keeps_text_row", False):
        text_model.register_forward_pre_hook(_text_row_first, with_kwargs=True)
        text_model._rlcore_keeps_text_row = True
    ids = input_ids.to(device)
    return {"image_mask": ids == model.config.image_token_id, "video_mask": ids == model.config.video_token_id}


def _text_row_first(_module, args, kwargs):
    """``(B, L)`` text positions -> ``(4, B, L)``: the text row, then t = h = w = the same positions
    (what Qwen3-VL's text model does with them, VL:1445-1446)."""
    pos = kwargs.get("position_ids")
    if pos is not None and pos.dim() == 2:
        kwargs["position_ids"] = pos[None].expand(4, *pos.shape)
    return args, kwargs
