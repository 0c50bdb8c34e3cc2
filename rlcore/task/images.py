"""Images in prompts (Qwen2.5-VL / Qwen3-VL): decoding, the HF processor, placeholder expansion and
the 3-D (M-RoPE) positions. No vLLM, VeOmni or distributed code: the rollout gets PIL images, the
policy gets ``VisionInputs``.

A prompt's token ids exist in two forms. vLLM takes ONE image token (``<|image_pad|>``) per image
and expands it itself; the policy takes the expanded form, one image token per merged patch
(``image_grid_thw.prod() // merge_size**2``), with the processor's ``pixel_values``. Both come
from the same HF processor in the model folder, so the two engines see the same pixels.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch

IMAGE_PLACEHOLDER = "<image>"  # where each image goes in a data row's prompt text


@dataclass
class VisionInputs:
    """One prompt's images as the policy consumes them (shared by the n samples of its group)."""

    pixel_values: torch.Tensor  # (P, C) flattened patches of every image, in order
    image_grid_thw: torch.Tensor  # (I, 3) long: temporal, height, width patches per image
    positions: torch.Tensor  # (3, S) long: M-RoPE (t, h, w) positions of the expanded prompt
    next_position: int  # position of the first response token (the same on all three rows)


# ----------------------------------------------------------------------------- decoding


def open_image(entry, base_dir: str):
    """A data row's image entry -> RGB PIL image. Entries: a path (relative to the data file's
    folder), raw bytes, or a dict with ``bytes`` and/or ``path`` (the Parquet layout of public
    image datasets such as geo3k). Raises ValueError saying what is wrong."""
    from PIL import Image

    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, (bytes, bytearray)):
        source, name = io.BytesIO(entry), "image bytes"
    elif isinstance(entry, str) and entry:
        source = name = entry if os.path.isabs(entry) else os.path.join(base_dir, entry)
        if not os.path.isfile(source):
            raise ValueError(f"image file {name} does not exist")
    else:
        raise ValueError(f"an image entry of type {type(entry).__name__} (expected a path, bytes, or "
                         "{'bytes': ..., 'path': ...})")
    try:
        image = Image.open(source)
        image.load()  # decode now: a truncated file fails here, not in the middle of a step
    except Exception as e:
        raise ValueError(f"{name} cannot be decoded ({type(e).__name__}: {e})") from e
    return image.convert("RGB")


def encode_image(image) -> bytes:
    """PNG bytes of a PIL image (how prompts keep their images in memory: small, lossless)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def prompt_images(prompts: list) -> list[list | None] | None:
    """Decoded images of each prompt (``rlcore.task.prompts.Prompt``), None for a prompt without; None
    when no prompt has images (the text-only path stays as it was)."""
    encoded = [getattr(p, "images", None) for p in prompts]
    if not any(encoded):
        return None
    return [[decode_image(b) for b in e] if e else None for e in encoded]


def chat_content(text: str, num_images: int) -> list[dict] | str:
    """Prompt text with ``<image>`` placeholders -> the content list of a chat message, images
    where the placeholders were (what Qwen-VL chat templates render as vision tokens)."""
    if num_images == 0:
        return text
    parts, content = text.split(IMAGE_PLACEHOLDER), []
    for i, part in enumerate(parts):
        if i > 0:
            content.append({"type": "image"})
        if part.strip():
            content.append({"type": "text", "text": part})
    return content


# ----------------------------------------------------------------------------- the processor


class VisionProcessor:
    """The model folder's HF image processor plus what expansion and positions need from its
    config (image token id, spatial merge size)."""

    def __init__(self, model_path: str):
        from transformers import AutoConfig, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.image_processor = self.processor.image_processor
        config = AutoConfig.from_pretrained(model_path)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.patch = int(self.image_processor.patch_size)

    def num_tokens(self, image) -> int:
        """Image tokens one image becomes (smart_resize to multiples of patch * merge within the
        processor's pixel bounds), without processing the pixels."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        size = self.image_processor.size
        h, w = smart_resize(image.height, image.width, factor=self.patch * self.merge,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return (h // self.patch) * (w // self.patch) // self.merge ** 2

    def prepare(self, ids: list[int], images: list) -> tuple[list[int], VisionInputs]:
        """(expanded ids, VisionInputs) of a prompt whose ``ids`` hold one image token per image."""
        if sum(t == self.image_token_id for t in ids) != len(images):
            raise ValueError(f"the prompt has {sum(t == self.image_token_id for t in ids)} image tokens "
                             f"for {len(images)} images")
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()  # (I, 3)
        counts = (grid.prod(-1) // self.merge ** 2).tolist()
        expanded, k = [], 0
        for t in ids:
            if t == self.image_token_id:
                expanded += [t] * counts[k]
                k += 1
            else:
                expanded.append(t)
        positions, nxt = mrope_positions(expanded, grid, self.image_token_id, self.merge)
        return expanded, VisionInputs(out["pixel_values"], grid, positions, nxt)


def mrope_positions(ids: list[int], grid_thw: torch.Tensor, image_token_id: int, merge: int
                    ) -> tuple[torch.Tensor, int]:
    """(3, S) M-RoPE positions of expanded ``ids`` and the next free position.

    Text advances all three rows by one per token; an image's tokens take (t, h, w) grid
    coordinates offset by the position where the image starts, and the text after it continues
    at start + max(h, w) / merge (images have t = 1). This is the image case of transformers'
    ``Qwen3VLModel.get_rope_index`` (models/qwen3_vl/modeling_qwen3_vl.py:929-1034) and of
    ``Qwen2_5_VLModel.get_rope_index`` (models/qwen2_5_vl/modeling_qwen2_5_vl.py:945-1059: an
    image's t/h/w rows are ``get_vision_position_ids`` :930-943 with time_interval 1 for images
    :1043-1046, so t = start, h/w = start + grid; the text after it continues at
    start + max(h, w) / merge, :1051; Qwen2.5-VL's tokens_per_second spacing applies to videos
    only); tests/test_vl_data.py checks both families against those functions."""
    pos = torch.zeros(3, len(ids), dtype=torch.long)
    cur, i, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        t, h, w = (int(x) for x in grid_thw[k])
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, i: i + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur, i, k = cur + max(gh, gw), i + n, k + 1
    return pos, cur
