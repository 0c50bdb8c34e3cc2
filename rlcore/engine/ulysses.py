"""Ulysses sequence parallelism in the train phase (``parallel.ulysses_size`` = U > 1).

The U consecutive ranks of a Ulysses group (VeOmni's ``ulysses`` mesh dimension,
veomni/distributed/parallel_state.py:567-616; FSDP2 still shards over every rank, ``dp_shard_sp``
:231-247) hold the same packed row. Each runs the model on 1/U of its positions: the row is padded
to a multiple of U (the padding is a sequence of its own, label -100) and sliced. Inside every
attention layer q/k/v go from sequence-sharded to head-sharded with VeOmni's all-to-all
(``prepare_ulysses_qkv`` / ``restore_ulysses_output``, veomni/ops/kernels/attention/ulysses.py:27-90,
which also repeats KV heads when U exceeds them), so each rank attends over the whole row for H/U
heads. Rotary embeddings are per token and applied before the all-to-all, so the slice's own
``position_ids`` are the right ones.

Which attention (``attention_for``): where the resolved kernel is a flash one (CUDA's flash-attn,
Ascend's npu_fusion_attention), VeOmni's own Ulysses flash path: its ``veomni_flash_attention_*_with_sp``
forward (ops/kernels/attention/flash.py:153-301) all-to-alls q/k/v over VeOmni's Ulysses group
(:235-256, the group ``ensure_parallel_state`` made) and calls transformers' varlen flash with the
row's ``cu_seq_lens`` (``Context.flash_kwargs``: the whole padded row's sequences, the padding one of
its own, as VeOmni's collator computes them before slicing, data/data_collator.py:50-105; a sliced
``position_ids`` could not show them). Elsewhere (sdpa: CPU, GPUs without a flash kernel) ``ATTN_NAME``,
the project's sdpa path below (VeOmni registers Ulysses wrappers only for its flash and flex kernels,
ops/kernels/attention/__init__.py:83-92, and flex has no CPU backward).
A block-causal row (the packed sequences found from the full ``position_ids`` as transformers finds
them) is attended sequence by sequence, each a causal sdpa with no mask (``Context.segments``): no
O(S^2) tensor, the kernel's own memory per sequence. A shared-prompt row (the caller's mask: the
group's responses attend to one prompt copy) is one sdpa over the whole row with its (S, S) mask.
Transformers builds no mask for a name its mask interface does not know (masking_utils.py:822-823),
so none is built twice. The vision tower (``VIT_NAME``) attends image by image, as VeOmni's varlen
ViT does.

Gradients: every rank of a group computes the same loss from the same row. The log-probs are
gathered with VeOmni's ``gather_outputs`` (sequence_parallel/data.py:129), whose backward sums the
gradient over the group (ulysses.py:198-290), so the group's ranks together hold U times the
gradient of one copy of the loss; and the loss's normaliser, all-reduced over every rank, counts
each sample U times (``rlcore.algo.grpo``). The two factors cancel: the update equals the one
without sequence parallelism (tests/test_grad_invariance.py, 1e-6 in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "rlcore_ulysses_sdpa"
# The vision tower's (Qwen3-VL): "flash" in the name makes VeOmni's ViT attention pass the images'
# ``cu_seqlens`` instead of splitting its (sliced) patches per image itself (VL:527-567).
VIT_NAME = "rlcore_ulysses_flash_vit"
# Vision-language families whose VeOmni forward slices the patches and the text under Ulysses
# (patched_modeling_qwen3_vl{,_moe}_gpu.py, the sp_enabled branches) and whose ViT attention takes
# VIT_NAME; Qwen2.5-VL's window attention reorders the patches first (not wired).
VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")  # VeOmni's *_with_sp for each


def attention_for(impl: str, reason: str, size: int) -> tuple[str, str]:
    """The text attention of a Ulysses policy and why, for the resolved kernel ``impl``: a flash one
    keeps its name (VeOmni renames it to its Ulysses flash path, arguments_types.py:1239-1251), sdpa
    becomes ``ATTN_NAME`` (registered here). Eager is refused (the config check names it first)."""
    register()
    if impl in FLASH:
        return impl, f"Ulysses sequence parallel {size}: VeOmni's {impl} path over the row's cu_seq_lens ({reason})"
    if impl != "sdpa":
        raise ValueError(f"ulysses_size {size}: attention {impl} has no Ulysses path; use auto or sdpa")
    return ATTN_NAME, f"Ulysses sequence parallel {size}: sdpa per packed sequence over the whole row for 1/{size} of the heads"


@dataclass
class Context:
    """One model's Ulysses group and the attention layout of the row it is running: ``segments``
    ((start, length) of each packed sequence over the padded row) or, for a shared-prompt row, the
    bool ``mask`` (1, 1, S, S). The layout stays set until the optimizer step (gradient
    checkpointing re-runs the attention in the backward); a no-grad forward releases it at once
    (``VeOmniPolicy``)."""

    group: object
    size: int
    rank: int
    mask: torch.Tensor | None = None
    pad_tokens: int = 0
    row_tokens: int = 0
    masks: dict = field(default_factory=dict)  # the mask as ``additive`` made it, per (dtype, device)
    segments: list | None = None
    flash: bool = False  # VeOmni's flash path attends (attention_for): the row goes as cu_seq_lens

    def set_mask(self, mask: torch.Tensor | None, segments: list | None = None) -> None:
        """The row's mask or its segments; both None releases them (a mask is O(S^2) bytes that
        generation should not hold)."""
        self.mask, self.masks, self.segments = mask, {}, segments

    def flash_kwargs(self, device) -> dict:
        """The row's sequences as transformers' FlashAttentionKwargs (modeling_flash_attention_utils.py:
        745-748: with all four the varlen kernel runs on them, :784-786): ``cu_seq_lens_q/k`` (n + 1,)
        int32 boundaries over the padded row and the longest sequence; {} on the sdpa path."""
        if not self.flash:
            return {}
        if self.segments is None:
            raise ValueError("a shared-prompt row (its dense mask) cannot go through the flash kernels; "
                             "algorithm.share_prompt is off with them")
        lengths = [n for _, n in self.segments]
        cu = torch.tensor([0, *lengths], dtype=torch.int32, device=cu_seq_lens_device(device)).cumsum(
            0, dtype=torch.int32)  # (n + 1,)
        longest = max(lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def additive(self, dtype: torch.dtype, device) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype``, made once per row and shared by every layer: sdpa
        turns a bool mask into a float one itself and saves that copy for its backward, one
        (S, S) tensor per layer (torch's CPU flash kernel, measured by scripts/bench_sp.py)."""
        key = (dtype, str(device))
        if key not in self.masks:
            m = self.mask.to(device)
            self.masks[key] = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, float("-inf"))
        return self.masks[key]

    def pop_metrics(self) -> dict[str, float]:
        """``perf/sp_pad_frac``: the share of the packed rows' positions that are padding to a
        multiple of U, since the last call (this rank's rows; the group's ranks see the same)."""
        out = {"perf/sp_pad_frac": self.pad_tokens / max(self.row_tokens, 1)} if self.row_tokens else {}
        self.pad_tokens = self.row_tokens = 0
        return out


def cu_seq_lens_device(device: torch.device | str) -> torch.device:
    """Where the row's ``cu_seq_lens`` live: the host on Ascend, the compute device elsewhere.
    transformers 5.5.4's NPU varlen kernel reads them as host lists, ``cu_seqlens_q[1:].cpu()`` and
    ``cu_seqlens_k[1:].cpu()`` (integrations/npu_flash_attention.py:116-117 and :133-134), in every
    attention layer: a device tensor costs two device-to-host syncs a layer, a host one none. VeOmni
    hands its Qwen3-VL ViT host cu_seqlens on NPU for the same reason (qwen3_vl_gpu_patch_gen_config.py:
    641, 756-757). CUDA's flash-attn kernels take device tensors."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]  # "npu" needs torch_npu
    return torch.device("cpu") if kind == "npu" else torch.device(device)


def register() -> None:
    """Make ``ATTN_NAME`` a transformers attention implementation (before the model is built,
    transformers/modeling_utils.py:1851 checks the name). Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionInterface.register(VIT_NAME, vision_attention)


def install(model, ctx: Context, tower=None) -> int:
    """Point every attention layer of ``model`` at ``ctx``, and ``tower``'s (a vision tower's ViT
    blocks: ``qkv``, ``proj``) at ``VIT_NAME``; returns how many text attention layers there are."""
    layers = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]
    vit = [m for m in tower.modules() if hasattr(m, "qkv") and hasattr(m, "proj")] if tower is not None else []
    for m in layers + vit:
        m.rlcore_sp = ctx
    if tower is not None:  # read per call (VL:523): the text model keeps ATTN_NAME
        tower.config._attn_implementation = VIT_NAME
    return len(layers)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **_kwargs):
    """transformers' attention interface: ``query`` (B, H, S/U, D), ``key``/``value`` (B, Hkv, S/U, D)
    in, (B, S/U, H, D) out, like ``sdpa_attention_forward``."""
    from veomni.ops.kernels.attention.ulysses import prepare_ulysses_qkv, restore_ulysses_output

    ctx: Context | None = getattr(module, "rlcore_sp", None)
    if ctx is None or (ctx.mask is None and ctx.segments is None):
        raise RuntimeError(f"{ATTN_NAME} runs only inside VeOmniPolicy.forward_logprobs with ulysses_size > 1")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S/U, H, D)
    q, k, v, _ = prepare_ulysses_qkv(q, k, v, group=ctx.group, ulysses_size=ctx.size)  # (B, S, H/U, D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H/U, S, D)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: transformers' repeat_kv order
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    drop = dropout if module.training else 0.0
    if ctx.segments is not None:  # block-causal: each packed sequence causal by itself, no mask
        out = torch.cat([F.scaled_dot_product_attention(*(t.narrow(2, a, n) for t in (q, k, v)), is_causal=True,
                                                        scale=scaling, dropout_p=drop)
                         for a, n in ctx.segments], 2)  # (B, H/U, S, D)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.additive(q.dtype, q.device), scale=scaling,
                                             dropout_p=drop)  # (B, H/U, S, D)
    return restore_ulysses_output(out.transpose(1, 2).contiguous(), group=ctx.group), None  # (B, S/U, H, D)


def vision_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, scaling=None,
                     dropout: float = 0.0, **_kwargs):
    """The ViT's attention under Ulysses: ``query``/``key``/``value`` (1, H, P/U, D) of this rank's
    patches (VeOmni slices ``pixel_values`` and the position embeddings, VL:1187-1236), all-to-all'd
    to every patch for H/U heads, attended within each image of ``cu_seq_lens_q`` (the whole row's,
    padding included), back to (1, P/U, H, D)."""
    from veomni.ops.kernels.attention.ulysses import prepare_ulysses_qkv, restore_ulysses_output

    ctx: Context | None = getattr(module, "rlcore_sp", None)
    if ctx is None or cu_seq_lens_q is None:
        raise RuntimeError(f"{VIT_NAME} runs only in a vision tower under VeOmniPolicy with ulysses_size > 1")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (1, P/U, H, D)
    q, k, v, _ = prepare_ulysses_qkv(q, k, v, group=ctx.group, ulysses_size=ctx.size)  # (1, P, H/U, D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, H/U, P, D)
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()  # each image, then the patches' padding
    drop = dropout if module.training else 0.0
    out = torch.cat([F.scaled_dot_product_attention(*parts, scale=scaling, dropout_p=drop)
                     for parts in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))], 2)  # (1, H/U, P, D)
    return restore_ulysses_output(out.transpose(1, 2).contiguous(), group=ctx.group), None  # (1, P/U, H, D)


def row_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, padded: int) -> torch.Tensor:
    """The (1, 1, S, S) bool mask of a packed row padded to ``padded`` positions: the caller's
    ``attention_mask`` (1, 1, L, L), or block-causal over the sequences of ``position_ids`` (1, L),
    a new one wherever the position does not step by 1 (transformers' find_packed_sequence_indices,
    masking_utils.py:731-760). The padding attends causally to itself only."""
    length = position_ids.shape[-1]
    causal = torch.ones(padded, padded, dtype=torch.bool, device=position_ids.device).tril()
    if attention_mask is None:
        pos = torch.cat([position_ids[0], torch.arange(padded - length, device=position_ids.device)])  # (S,)
        seq = (torch.diff(pos, prepend=pos[:1] - 1) != 1).cumsum(0)  # (S,) sequence index
        return (causal & (seq[:, None] == seq[None, :]))[None, None]
    out = torch.zeros(padded, padded, dtype=torch.bool, device=attention_mask.device)
    out[:length, :length] = attention_mask[0, 0].bool()
    out[length:, length:] = causal[length:, length:]
    return out[None, None]


def row_segments(position_ids: torch.Tensor, padded: int) -> list[tuple[int, int]]:
    """(start, length) of each sequence of a packed row (1, L) padded to ``padded`` positions: a new
    one wherever the position does not step by 1 (``row_mask``'s rule), the padding one of its own."""
    pos = position_ids[0].tolist()
    starts = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
    ends = starts[1:] + [len(pos)]
    out = [(a, b - a) for a, b in zip(starts, ends)]
    return out + ([(len(pos), padded - len(pos))] if padded > len(pos) else [])


def shares(select: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``select`` (K,) positions of the whole row split by the ranks' slices ``bounds``: each
    rank's indices into ``select``, padded with -1 (a dummy row) to the longest share (gloo's
    all-gather takes equal sizes only), and the permutation that puts the gathered rows (in rank
    order) back in ``select``'s order. Every rank computes all shares from the same ``select``:
    no collective."""
    parts = [torch.nonzero((select >= lo) & (select < hi)).flatten() for lo, hi in bounds]
    width = max(1, max(p.numel() for p in parts))
    parts = [torch.cat([p, p.new_full((width - p.numel(),), -1)]) for p in parts]
    order = torch.cat(parts)  # (U * width,) index into select, -1 = dummy
    keep = torch.nonzero(order >= 0).flatten()
    return parts, keep[torch.argsort(order[keep])]


def run_sliced(ctx: Context, forward, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
               select: torch.Tensor | None, attention_mask: torch.Tensor | None, keys: torch.Tensor | None = None):
    """Run ``forward(input_ids, position_ids, labels, select, keys)`` on this rank's slice of the
    packed row and return its ``(logp, entropy)`` for the whole row: (1, L), or (1, K) with
    ``select``, gathered over the group with a summed backward (see the module docstring).
    ``keys`` (1, L): the routing-replay token keys (``packing.token_keys``), sliced alike; the
    padding's keys are negative (``rlcore.engine.replay`` counts them nowhere)."""
    from veomni.distributed.sequence_parallel.data import gather_outputs

    length, u = input_ids.shape[1], ctx.size
    padded = -(-length // u) * u
    pad = padded - length
    text_pos = position_ids[0] if position_ids.dim() == 3 else position_ids  # (1, L): M-RoPE rows follow it
    if attention_mask is None:
        ctx.set_mask(None, row_segments(text_pos, padded))
    else:
        ctx.set_mask(row_mask(text_pos, attention_mask, padded))
    ctx.pad_tokens, ctx.row_tokens = ctx.pad_tokens + pad, ctx.row_tokens + padded
    ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], 1)  # (1, S)
    tail = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
    pos = torch.cat([position_ids, tail.expand(*position_ids.shape[:-1], pad)], -1)  # (1, S) or (4, 1, S)
    chunk = padded // u
    bounds = [(r * chunk, (r + 1) * chunk) for r in range(u)]
    lo, hi = bounds[ctx.rank]
    if select is None:
        lab = torch.cat([labels, labels.new_full((1, pad), -100)], 1)[:, lo:hi]
        local_select, order = None, None
    else:
        parts, order = shares(select, bounds)
        mine = parts[ctx.rank]
        local_select = torch.where(mine >= 0, select[mine.clamp(min=0)] - lo, 0)  # dummy: position 0
        lab = torch.where(mine[None] >= 0, labels[:, mine.clamp(min=0)], -100)
    if keys is not None:
        keys = torch.cat([keys, -1 - torch.arange(pad, device=keys.device, dtype=keys.dtype)[None]], 1)[:, lo:hi]
    logp, ent = forward(ids[:, lo:hi], pos[..., lo:hi], lab, local_select, keys)

    def whole(x):
        if x is None:
            return None
        x = gather_outputs(x, gather_dim=1, group=ctx.group)  # (1, S) or (1, sum of shares)
        return x[:, :length] if order is None else x[:, order.to(x.device)]

    return whole(logp), whole(ent)
