"""Vision-language pieces of the policy engine (Qwen3-VL through VeOmni's patched modeling):
the vision tower (what ``freeze_vision_tower`` freezes) and the extra forward inputs of a packed
image+text row. Used by ``rlcore.engine_veomni`` only.

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
  rotary_pos_emb_vision (VL:108-111); ``rlcore.engine_veomni._ops_config`` sets all to eager.
"""

from __future__ import annotations

import torch

VISION_PREFIX = "model.visual."  # HF checkpoint names of the vision tower (patch embed, blocks, mergers)


def vision_tower(model) -> torch.nn.Module | None:
    """The whole ``visual`` module (patch embedding, position embedding, ViT blocks, the merger and
    the deepstack mergers), or None for a text-only model. The mergers count as the vision tower,
    as in verl's ``get_vl_model_vision_tower`` (``model.model.visual``): freezing it trains the
    language model only."""
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
                   device: torch.device) -> dict:
    """The image inputs of one packed row, checked against ``input_ids``, as keyword arguments of
    VeOmni's Qwen3-VL forward ({} for a text-only row).

    ``mm``: ``pixel_values`` (P, C) float and ``image_grid_thw`` (I, 3) int of every image of the
    row, in order of appearance. The ViT metadata (per-image ``cu_seqlens``, ``max_seqlen``) is
    computed here on the host with VeOmni's own collator hook (VL:263-315, exposed by
    ``get_metadata_collate_func`` VL:2545-2549), as VeOmni's data pipeline does, so the ViT
    forward skips its own host-side build (VL:1201-1206, VL:1258-1259)."""
    tower = vision_tower(model)
    L = input_ids.shape[1]
    if position_ids.dim() == 3 and (tower is None or tuple(position_ids.shape) != (4, 1, L)):
        raise ValueError(f"position_ids must be (1, L){' or (4, 1, L)' if tower is not None else ''} for this "
                         f"model, got {tuple(position_ids.shape)} with L = {L}")
    if mm is not None and tower is None:
        raise ValueError("mm (image inputs) given to a text-only model")
    if mm is not None and set(mm) != {"pixel_values", "image_grid_thw"}:
        raise ValueError(f"mm takes pixel_values and image_grid_thw, got {sorted(mm)}")
    if mm is None or mm["image_grid_thw"].shape[0] == 0:  # a row without images
        if tower is not None and bool((input_ids == model.config.image_token_id).any()):
            raise ValueError("input_ids hold image tokens but mm (the images) is None")
        return {}
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
    batch = {"image_grid_thw": grid_cpu}
    model.get_metadata_collate_func()(batch, {})  # no sequence-parallel padding
    return {"pixel_values": pixel_values.to(device), "image_grid_thw": grid_cpu.to(device),
            "multimodal_metadata": batch["multimodal_metadata"]}
