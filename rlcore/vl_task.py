"""Offline assets for the vision-language demo and tests: a word-level tokenizer with Qwen-VL's
special tokens and chat template, a tiny random Qwen3-VL saved with its processor, and the
"shapes" task (small images of coloured shapes with questions whose answers are exact).

The model is Qwen3-VL with every size shrunk (vision depth 2, hidden 64, head_dim 32, M-RoPE
sections [6, 5, 5] summing to head_dim / 2); the folder holds what vLLM and VeOmni load: config,
safetensors, tokenizer, chat template, preprocessor and video-processor configs.
"""

from __future__ import annotations

import json
import os
import random

from rlcore.toy_task import DIGITS

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


def make_vl_tokenizer(out_dir: str):
    """A word-level fast tokenizer whose special tokens are Qwen-VL's, with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
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


def make_tiny_vl_model(out_dir: str, *, hidden_size: int = 64, num_layers: int = 2, head_dim: int = 32,
                       vision_depth: int = 2, vision_hidden: int = 64, image_pixels: tuple[int, int] = (32 * 32, 128 * 128),
                       seed: int = 0) -> str:
    """A randomly initialised Qwen3-VL with its processor as an HF folder (fp32 safetensors).
    ``image_pixels``: the processor's (min, max) pixels, so that a 96x96 image is 9 image tokens."""
    import torch
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_vl_tokenizer(out_dir)
    ids = {t: VOCAB.index(t) for t in SPECIAL}
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [6, 5, 5], "mrope_interleaved": True},  # sums to head_dim / 2
                pad_token_id=ids["<pad>"], eos_token_id=ids["<|im_end|>"], bos_token_id=None, dtype="float32")
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=64, deepstack_visual_indexes=[vision_depth - 1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    lo, hi = image_pixels
    image_proc = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                       min_pixels=lo, max_pixels=hi, size={"shortest_edge": lo, "longest_edge": hi})
    video_proc = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    Qwen3VLProcessor(image_processor=image_proc, tokenizer=tokenizer, video_processor=video_proc,
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
    from rlcore.vision import IMAGE_PLACEHOLDER, encode_image

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
