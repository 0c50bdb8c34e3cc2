"""Offline assets for the vision-language demo and tests: a word-level tokenizer with Qwen-VL's
special tokens and chat template, a tiny random Qwen3-VL or Qwen2.5-VL saved with its processor,
and the "shapes" task (small images of coloured shapes with questions whose answers are exact).

The model is Qwen3-VL (or Qwen2.5-VL) with every size shrunk (vision depth 2, hidden 64, head_dim
32, M-RoPE sections summing to head_dim / 2); the folder holds what vLLM and VeOmni load: config,
safetensors, tokenizer, chat template, preprocessor and video-processor configs.
"""

from __future__ import annotations

import json
import os
import random

from rlcore.demo.toy import DIGITS

SPECIAL = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ["circle", "square", "triangle"]
WORDS = (["system", "user", "assistant", "how", "many", "shapes", "?", "what", "colour", "is", "the", "which",
          "larger", "a", "shape", "answer", "with", "one", "word", ".", "are", "there", "of"]
         + list(COLOURS) + SHAPES)
VOCAB = SPECIAL + DIGITS + WORDS

# Qwen's chat format; an image is <|vision_start|><|image_pad|><|vision_end|> (vLLM and the HF
# processor expand the one <|image_pad|> to the image's token count).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def make_vl_tokenizer(out_dir: str, extra_words: tuple[str, ...] = ()):
    """A word-level fast tokenizer whose special tokens are Qwen-VL's, with the chat template;
    ``extra_words`` follow the vocabulary (e.g. answer formats a reward reads)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB + list(extra_words))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL[3:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", extra_special_tokens={
                                       "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                       "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


VL_FAMILIES = ("qwen3_vl", "qwen2_5_vl")
# The processor's (min, max) pixels per family: a 96x96 shapes image is 9 image tokens in both
# (Qwen3-VL: patch 16, 96 -> 96 = 6 patches; Qwen2.5-VL: patch 14, 96 -> 84 = 6 patches).
DEFAULT_IMAGE_PIXELS = {"qwen3_vl": (32 * 32, 128 * 128), "qwen2_5_vl": (56 * 56, 112 * 112)}


def make_tiny_vl_model(out_dir: str, *, family: str = "qwen3_vl", hidden_size: int = 64, num_layers: int = 2,
                       head_dim: int = 32, vision_depth: int = 2, vision_hidden: int = 64,
                       image_pixels: tuple[int, int] | None = None, seed: int = 0,
                       original_layout: bool = False, extra_words: tuple[str, ...] = (),
                       max_position_embeddings: int = 1024) -> str:
    """A randomly initialised Qwen-VL with its processor as an HF folder (fp32 safetensors).

    ``family``: "qwen3_vl" (Qwen3-VL: patch 16, interleaved M-RoPE [6, 5, 5], deepstack merger on
    the last ViT block) or "qwen2_5_vl" (Qwen2.5-VL: patch 14, M-RoPE sections [4, 6, 6] in
    blocks, window attention in ViT block 0 with 56-pixel windows = 2 x 2 merged tokens, full
    attention in the last block). ``image_pixels``: the processor's (min, max) pixels
    (``DEFAULT_IMAGE_PIXELS``: a 96x96 image is 9 image tokens in both families).

    Weight names: Qwen3-VL's are its module names (``model.visual.*``, ``model.language_model.*``,
    ``lm_head.*``). transformers 5.19 saves Qwen2.5-VL in the layout of the released checkpoints
    (``visual.*``, ``model.layers.*``, ``lm_head.*``: transformers/conversion_mapping.py:826-831,
    reversed on save) unless told otherwise; VeOmni 0.1.12 does not rename those on load (see
    ``rlcore.engine.vl.checkpoint_key_mapping``). ``original_layout=False`` (the default) saves the
    module names for both families; True gives the released Qwen2.5-VL layout. ``extra_words``:
    words added after the vocabulary (rlcore.demo.verl_tasks: the answer formats of verl's geo3k)."""
    if family not in VL_FAMILIES:
        raise ValueError(f"family must be one of {VL_FAMILIES}, got {family!r}")
    if family == "qwen2_5_vl" and hidden_size // 2 != head_dim:
        raise ValueError(f"Qwen2.5-VL's text head_dim is hidden_size / heads (2 heads): {hidden_size // 2} != {head_dim}")
    import torch
    from transformers import Qwen2VLImageProcessor

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_vl_tokenizer(out_dir, extra_words)
    ids = {t: VOCAB.index(t) for t in SPECIAL}
    text = dict(vocab_size=len(VOCAB) + len(extra_words), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                pad_token_id=ids["<pad>"], eos_token_id=ids["<|im_end|>"], bos_token_id=None, dtype="float32")
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=False, dtype="float32")
    lo, hi = image_pixels or DEFAULT_IMAGE_PIXELS[family]
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

        text.update(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [6, 5, 5], "mrope_interleaved": True})
        patch = 16
        vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                      out_hidden_size=hidden_size, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[vision_depth - 1])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls, processor_cls, video_proc = (Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                                                Qwen3VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2))
    else:
        from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                                  Qwen2VLVideoProcessor)

        # head_dim = hidden_size / heads (Qwen2.5-VL has no head_dim field); sections sum to head_dim / 2
        text.update(use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "mrope_section": [4, 6, 6]})
        patch = 14
        vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                      out_hidden_size=hidden_size, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=56, fullatt_block_indexes=[vision_depth - 1], tokens_per_second=2)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls, processor_cls, video_proc = (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                                                Qwen2VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2))
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    if family == "qwen3_vl":  # no renaming either way (the folder stays byte-identical to before)
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        model.save_pretrained(out_dir, safe_serialization=True, save_original_format=original_layout)
    image_proc = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                       min_pixels=lo, max_pixels=hi, size={"shortest_edge": lo, "longest_edge": hi})
    processor_cls(image_processor=image_proc, tokenizer=tokenizer, video_processor=video_proc,
                  chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- the shapes task


def draw_shapes(rng: random.Random, size: int = 96):
    """A plain background with 1-4 shapes in distinct quadrants; returns (PIL image, shapes) with
    shapes as dicts (kind, colour, extent in pixels)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    half = size // 2
    shapes = []
    for quadrant in rng.sample(range(4), rng.randint(1, 4)):
        kind, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        extent = rng.randrange(half // 3, half - 6)  # 10..41 pixels on a 96-pixel image
        x0 = (quadrant % 2) * half + rng.randrange(2, half - extent - 1)
        y0 = (quadrant // 2) * half + rng.randrange(2, half - extent - 1)
        box = [x0, y0, x0 + extent, y0 + extent]
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + extent / 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=fill)
        shapes.append({"kind": kind, "colour": colour, "extent": extent})
    return image, shapes


def shapes_question(rng: random.Random, shapes: list[dict]) -> tuple[str, str]:
    """(question, one-word answer) about the drawn shapes, always answerable exactly: the count;
    the colour of a shape kind that appears once; the colour of the larger of two shapes whose
    sizes differ clearly."""
    kinds = [s["kind"] for s in shapes]
    unique = [s for s in shapes if kinds.count(s["kind"]) == 1]
    sizes = sorted(s["extent"] for s in shapes)
    choices = ["count"]
    if unique:
        choices.append("colour")
    if len(shapes) == 2 and sizes[1] - sizes[0] >= 8:
        choices.append("larger")
    kind = rng.choice(choices)
    if kind == "colour":
        s = rng.choice(unique)
        return f"what colour is the {s['kind']} ?", s["colour"]
    if kind == "larger":
        return "which colour is the larger shape ?", max(shapes, key=lambda s: s["extent"])["colour"]
    return "how many shapes are there ?", str(len(shapes))


def make_shapes_rows(out_dir: str, name: str, n: int, seed: int, *, size: int = 96, embed: bool = False) -> list[dict]:
    """``n`` rows of the shapes task; images as PNG files under ``out_dir/images`` (rows name them
    relative to ``out_dir``) or, with ``embed``, as {bytes, path} dicts (the Parquet layout)."""
    from rlcore.task.images import IMAGE_PLACEHOLDER, encode_image

    rng = random.Random(seed)
    if not embed:
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows = []
    for i in range(n):
        image, shapes = draw_shapes(rng, size)
        question, answer = shapes_question(rng, shapes)
        rel = os.path.join("images", f"{name}_{i:05d}.png")
        if embed:
            entry = {"bytes": encode_image(image), "path": rel}
        else:
            image.save(os.path.join(out_dir, rel))
            entry = rel
        rows.append({"prompt": f"{IMAGE_PLACEHOLDER} {question} answer with one word .", "images": [entry],
                     "answer": answer})
    return rows


def make_shapes_data(out_dir: str, *, n_train: int = 2000, n_val: int = 200, seed: int = 0, size: int = 96,
                     parquet: bool = False) -> tuple[str, str]:
    """shapes_train / shapes_val as JSONL with PNG files beside them, or Parquet with the image
    bytes inside (``parquet``); separate seeds for the two splits."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, n, s in (("shapes_train", n_train, seed), ("shapes_val", n_val, seed + 1_000_003)):
        rows = make_shapes_rows(out_dir, name, n, s, size=size, embed=parquet)
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = os.path.join(out_dir, f"{name}.parquet")
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path = os.path.join(out_dir, f"{name}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        paths.append(path)
    return paths[0], paths[1]
