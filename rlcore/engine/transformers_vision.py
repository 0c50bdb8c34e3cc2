"""transformers 5.19's ``transformers.vision_utils`` helpers that VeOmni 0.1.12's Qwen2-VL, Qwen2.5-VL,
Qwen2.5-Omni and Qwen3-Omni-MoE modeling imports, for a transformers without the module.

VeOmni 0.1.12's generated modeling files import them at module level:
veomni/models/transformers/qwen2_5vl/generated/patched_modeling_qwen2_5_vl_gpu.py:76 and
qwen2_5_omni/generated/patched_modeling_qwen2_5_omni_gpu.py:103 (``get_vision_position_ids``,
``get_vision_window_index``), qwen2_vl/generated/patched_modeling_qwen2_vl_gpu.py:68
(``get_vision_position_ids``), qwen3_omni_moe/generated/patched_modeling_qwen3_omni_moe_gpu.py:105-108 and
_npu.py:110-113 (``get_vision_position_ids``, ``get_vision_bilinear_indices_and_weights``). VeOmni builds
a Qwen2.5-VL with that GPU file on every device (qwen2_5vl/__init__.py:27-30: there is no NPU file).
transformers 5.19 (the CUDA/CPU pin) has the module (vision_utils.py); 5.5.4 (vllm-ascend 0.23.0's pin,
requirements-npu-base.txt) has none, so on the Ascend pins the build of such a policy raised
``ModuleNotFoundError: No module named 'transformers.vision_utils'`` (round four's F8, found by the NPU
twin). ``rlcore.engine.transformers_compat.install`` registers these as ``transformers.vision_utils``
where it is missing, before a build; with a transformers that has it, it is left alone.

Each function below is transformers 5.19.0's, line for line (vision_utils.py, lines cited on each);
``get_vision_bilinear_indices_and_weights`` calls the two after it, copied with it. The module's other
helpers (cu_seqlens, nearest position ids, merged shapes) are not imported by VeOmni 0.1.12 and are not
copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.utils import logging

logger = logging.get_logger("transformers.vision_utils")

__all__ = ["get_vision_position_ids", "get_vision_window_index", "get_vision_interpolation_indices_and_weights",
           "get_vision_bilinear_indices_and_weights"]


# transformers 5.19.0 vision_utils.py:81-127
def get_vision_position_ids(
    grid_thw: torch.Tensor,
    spatial_merge_size: int | torch.Tensor,
    include_temporal: bool = False,
    kwargs: dict | None = None,
) -> torch.Tensor:
    """Get position IDs for vision rotary embeddings, or pop from `kwargs` if precomputed.

    Args:
        grid_thw: `(num_images_or_videos, 3)`
        spatial_merge_size: merge block size — either a single `int` (same for all images)
            or a `(num_images_or_videos,)` tensor (per-image).
        kwargs: optional caller kwargs — if it contains `"position_ids"` it is popped and returned.
        include_temporal: when ``True``, prepend a temporal-index column and return
            `(total_tokens, 3)` — for encoders whose rotary embedding rotates T/H/W axes
            (minimax_m3_vl). When ``False`` (default), return `(total_tokens, 2)` for the
            2-axis (h, w) case (qwen2_5_vl / qwen3_vl / glm4v / paddleocr_vl); the h/w
            indices are still repeated ``t`` times for video inputs.

    Returns:
        `position_ids`: `(total_tokens, 3)` long if ``include_temporal`` else `(total_tokens, 2)`,
        with the spatial indices laid out block-major over ``m×m`` spatial-merge blocks.
    """
    if kwargs is not None and (position_ids := kwargs.pop("position_ids", None)) is not None:
        return position_ids

    device = grid_thw.device
    if isinstance(spatial_merge_size, int):
        spatial_merge_size = torch.tensor([spatial_merge_size], device=device).expand(len(grid_thw))

    position_ids = []
    for (t, h, w), merge_size in zip(grid_thw.tolist(), spatial_merge_size.tolist()):
        hpos_ids, wpos_ids = torch.meshgrid(
            torch.arange(h, device=device),
            torch.arange(w, device=device),
            indexing="ij",
        )
        block_shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        hpos_ids = hpos_ids.reshape(block_shape).transpose(1, 2).flatten()
        wpos_ids = wpos_ids.reshape(block_shape).transpose(1, 2).flatten()
        if include_temporal:
            tpos_ids = torch.arange(t, device=device).repeat_interleave(h * w)
            position_ids.append(torch.stack([tpos_ids, hpos_ids.repeat(t), wpos_ids.repeat(t)], dim=-1))
        else:
            position_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))

    return torch.cat(position_ids, dim=0)


# transformers 5.19.0 vision_utils.py:130-188
def get_vision_window_index(
    grid_thw: torch.Tensor,
    spatial_merge_size: int,
    window_size: int,
    patch_size: int,
    kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Get window attention indices, or pop `"window_index"`/`"cu_window_seqlens"` from `kwargs` if both precomputed.

    Args:
        grid_thw: `(num_images_or_videos, 3)`
        spatial_merge_size: merge block size from vision config.
        window_size: window size from vision config.
        patch_size: patch size from vision config.
        kwargs: optional caller kwargs — if it contains both `"window_index"` and `"cu_window_seqlens"` they are popped and returned.

    Returns:
        `window_index`: `(total_tokens,)` long — reorder indices for windowed attention.
        `cu_window_seqlens`: `(num_windows + 1,)` int32 — cumulative window boundaries.
    """
    if kwargs is not None:
        window_index = kwargs.pop("window_index", None)
        cu_window_seqlens = kwargs.pop("cu_window_seqlens", None)
        if window_index is not None and cu_window_seqlens is not None:
            return window_index, cu_window_seqlens
    window_index: list = []
    cu_window_seqlens: list = [0]
    window_index_id = 0
    vit_merger_window_size = window_size // spatial_merge_size // patch_size
    spatial_merge_unit = spatial_merge_size**2

    for grid_t, grid_h, grid_w in grid_thw.tolist():
        grid_t, grid_h, grid_w = int(grid_t), int(grid_h), int(grid_w)
        llm_grid_h = grid_h // spatial_merge_size
        llm_grid_w = grid_w // spatial_merge_size
        index = torch.arange(grid_t * llm_grid_h * llm_grid_w).reshape(grid_t, llm_grid_h, llm_grid_w)
        pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
        pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
        num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
        num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
        index_padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        index_padded = index_padded.reshape(
            grid_t, num_windows_h, vit_merger_window_size, num_windows_w, vit_merger_window_size
        )
        index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
            grid_t, num_windows_h * num_windows_w, vit_merger_window_size, vit_merger_window_size
        )
        seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
        index_padded = index_padded.reshape(-1)
        index_new = index_padded[index_padded != -100]
        window_index.append(index_new + window_index_id)
        cu_seqlens_tmp = seqlens.cumsum(0) * spatial_merge_unit + cu_window_seqlens[-1]
        cu_window_seqlens.extend(cu_seqlens_tmp.tolist())
        window_index_id += grid_t * llm_grid_h * llm_grid_w

    window_index = torch.cat(window_index, dim=0)
    cu_window_seqlens = torch.tensor(cu_window_seqlens, device=grid_thw.device, dtype=torch.int32)
    cu_window_seqlens = torch.unique_consecutive(cu_window_seqlens)
    return window_index, cu_window_seqlens


# transformers 5.19.0 vision_utils.py:191-228
def _interpolation_axis_taps_weights(
    index: torch.Tensor, size: torch.Tensor, side: int, mode: str, align_corners: bool, padding: str = "border"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-axis interpolation taps into a `side`-length source table and their weights, for `index`
    target positions on an axis of length `size`. `mode` selects the kernel width — 2 taps
    (`"bilinear"`) or 4 taps (`"bicubic"`, Keys convolution kernel with `a=-0.75`). `size` may be a
    scalar or a per-element tensor (ragged batches). `padding` controls out-of-range taps: `"border"`
    clamps to the edge value (like `F.interpolate`), `"zeros"` gives them zero weight (like
    `F.grid_sample(padding_mode="zeros")`)."""
    index = index.to(torch.float32)
    if align_corners:
        # Closed form of `torch.linspace(0, side-1, size)[index]` — endpoints map to 0 and side-1.
        # `clamp(min=1)` avoids a divide-by-zero when size == 1 (index is 0, so src is 0 too).
        src = index * (side - 1) / torch.clamp(size - 1, min=1)
    else:
        src = (index + 0.5) * side / size - 0.5  # half-pixel centres (align_corners=False)
    floor = torch.floor(src)
    if mode == "bilinear":
        offsets = torch.arange(0, 2, device=index.device)  # floor, floor+1
    elif mode == "bicubic":
        offsets = torch.arange(-1, 3, device=index.device)  # floor-1 .. floor+2
    else:
        raise ValueError(f"Unsupported interpolation mode {mode!r} (expected 'bilinear' or 'bicubic').")
    raw_taps = floor.long()[:, None] + offsets
    taps = raw_taps.clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    if mode == "bilinear":
        weights = (1 - distance).clamp(min=0)  # linear hat kernel
    else:
        a = -0.75
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
        weights = torch.where(distance <= 1, near, far)
    if padding == "zeros":
        # Out-of-range taps were clamped to the border above; zero their weight so they contribute
        # nothing (the clamped index is then irrelevant) — `F.grid_sample(padding_mode="zeros")`.
        weights = weights * ((raw_taps >= 0) & (raw_taps <= side - 1))
    return taps, weights


# transformers 5.19.0 vision_utils.py:231-297
def get_vision_interpolation_indices_and_weights(
    grid_thw: torch.Tensor,
    num_grid_per_side: int,
    mode: str = "bilinear",
    align_corners: bool = False,
    spatial_merge_size: int = 1,
    padding: str = "border",
    kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-patch gather indices/weights that resample a square learned `(num_grid_per_side,
    num_grid_per_side)` position-embedding table to each image's `(h, w)` grid, or pop
    `"interp_indices"`/`"interp_weights"` from `kwargs` if both precomputed.

    Reproduces `F.interpolate(mode=mode, align_corners=align_corners)` as `(total_patches, n_taps)`
    indices + weights (`n_taps` = 4 for `"bilinear"`, 16 for `"bicubic"` — the Keys kernel with
    `a=-0.75`), consumed by a fused `F.embedding_bag` or a weighted `embedding` sum. Fully vectorised
    over packed patches (ragged `(h, w)` handled with `repeat_interleave`, no per-image loop), so it
    supports dynamic shapes like the other grid_thw precompute helpers. `spatial_merge_size > 1`
    emits patches in spatial-merge-block order (for encoders that consume merged tokens); `1` keeps
    raster order.

    Args:
        grid_thw: `(num_images_or_videos, 3)` — temporal, height, width per entry.
        num_grid_per_side: `int(num_position_embeddings ** 0.5)` from the vision config.
        mode: `"bilinear"` or `"bicubic"`.
        align_corners: matches the corresponding `F.interpolate` flag.
        spatial_merge_size: merge block size; `1` keeps raster patch order.
        kwargs: optional caller kwargs — if it contains both `"interp_indices"` and `"interp_weights"`
            they are popped and returned.

    Returns:
        `indices`: `(total_thw, n_taps)` long — gather indices into the flattened pos_embed table.
        `weights`: `(total_thw, n_taps)` float — interpolation weights.
    """
    if kwargs is not None:
        interp_indices = kwargs.pop("interp_indices", None)
        interp_weights = kwargs.pop("interp_weights", None)
        if interp_indices is not None and interp_weights is not None:
            return interp_indices, interp_weights

    side = num_grid_per_side
    merge = spatial_merge_size
    device = grid_thw.device

    counts = grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]
    heights = torch.repeat_interleave(grid_thw[:, 1], counts)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    starts = torch.repeat_interleave(F.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
    # Position within a single frame's flat patch sequence (0 .. h*w-1), repeating across the t frames.
    within = (torch.arange(counts.sum(), device=device) - starts) % (heights * widths)
    # Decode `within` into (row, col): raster order when merge == 1, else spatial-merge-block order
    # (block_row, block_col, in_row, in_col) — the inverse of qwen/glm-style merge reordering.
    blocks_w = widths // merge
    in_col = within % merge
    in_row = (within // merge) % merge
    block_col = (within // (merge * merge)) % blocks_w
    block_row = within // (merge * merge * blocks_w)
    row = block_row * merge + in_row
    col = block_col * merge + in_col

    h_taps, h_weights = _interpolation_axis_taps_weights(row, heights, side, mode, align_corners, padding)
    w_taps, w_weights = _interpolation_axis_taps_weights(col, widths, side, mode, align_corners, padding)
    n = h_taps.shape[1]  # taps per axis
    # 2D separable: outer product of the per-axis taps/weights → n*n taps per patch.
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, n * n)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, n * n)
    return indices, weights


# transformers 5.19.0 vision_utils.py:300-323
def get_vision_bilinear_indices_and_weights(
    grid_thw: torch.Tensor,
    num_grid_per_side: int,
    spatial_merge_size: int,
    align_corners: bool = True,
    kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deprecated — use [`get_vision_interpolation_indices_and_weights`] with `mode="bilinear"`,
    `align_corners=True`. Returns the legacy `(4, total_thw)` layout (transpose of the unified helper's
    `(total_thw, 4)`)."""
    logger.warning_once(
        "`get_vision_bilinear_indices_and_weights` is deprecated and will be removed in v5.17. Use "
        "`get_vision_interpolation_indices_and_weights(..., mode='bilinear', align_corners=True)` "
        "instead (it returns `(total_thw, n_taps)`, the transpose of this function's output)."
    )
    if kwargs is not None:
        bilinear_indices = kwargs.pop("bilinear_indices", None)
        bilinear_weights = kwargs.pop("bilinear_weights", None)
        if bilinear_indices is not None and bilinear_weights is not None:
            return bilinear_indices, bilinear_weights
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side, mode="bilinear", align_corners=True, spatial_merge_size=spatial_merge_size
    )
    return indices.transpose(0, 1), weights.transpose(0, 1)
