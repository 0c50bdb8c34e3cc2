"""Offline assets of the verl-layout runs (tests/test_verl_e2e.py): data in verl's layout as verl's
examples/data_preprocess/gsm8k.py and geo3k.py write it, and tiny random models whose vocabularies
hold the answer formats verl's scorers read, so that even an untrained model's answers earn some of
verl's rewards (a strict ``#### N`` for GSM8K; ``<think>``, ``</think>`` and ``\\boxed{N}`` for geo3k's
0.9 x accuracy + 0.1 x format).

    sum task     "tom has 3 apples and gets 4 more . how many apples ?" + verl's GSM8K instruction;
                 data_source openai/gsm8k, ground truth "7"; or, in MATH's layout, verl's MATH
                 instruction and data_source DigitalLearningGmbH/MATH-lighteval (math_dataset.py)
    shapes task  the shapes images of rlcore.demo.vl, "<image> how many shapes are there ?" + verl's
                 geo3k instruction; data_source hiyouga/geometry3k, ground truth the count
"""

from __future__ import annotations

import random

from rlcore.demo.toy import DIGITS, SPECIAL, make_tiny_model
from rlcore.task.verl_rows import to_verl_row

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # gsm8k.py:43
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"  # examples/data_preprocess/math_dataset.py:46
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # math_dataset.py:60
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     r"MUST BE put in \boxed{}.")  # geo3k.py:44-48
SUMS = range(2, 10)  # the sum task's answers
COUNTS = range(1, 5)  # the shapes task's answers (1-4 shapes)
SUM_WORDS = (["user", "assistant", "system", "tom", "has", "apples", "and", "gets", "more", ".", "how", "many", "?",
              "the", "answer", "is", "####"] + [f"#### {n}" for n in SUMS] + [f"\\boxed{{{n}}}" for n in SUMS])
GEO3K_WORDS = ("<think>", "</think>", *(f"\\boxed{{{n}}}" for n in COUNTS))
VOCAB = SPECIAL + DIGITS + SUM_WORDS
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


CONTEXT = 2048  # max_position_embeddings: room for verl's max_prompt_length 1024 plus a response


def make_verl_chat_model(out_dir: str, seed: int = 0) -> str:
    """A tiny random Qwen3 with a chat template and a word-level vocabulary holding the sum task
    and its answer formats ("#### 7" is one token: an untrained model writes it now and then)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_tiny_model(out_dir, seed=seed, vocab_size=len(VOCAB), max_position_embeddings=CONTEXT)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="\x00", cleanup=False)  # words joined by spaces, "####" kept whole
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)  # replaces the toy tokenizer make_tiny_model wrote
    return favour_words(out_dir, [VOCAB.index(f"#### {n}") for n in SUMS])


def make_verl_vl_model(out_dir: str, seed: int = 0) -> str:
    """The tiny Qwen3-VL of rlcore.demo.vl with geo3k's answer formats in its vocabulary."""
    from rlcore.demo.vl import make_tiny_vl_model

    from rlcore.demo.vl import VOCAB as VL_VOCAB

    make_tiny_vl_model(out_dir, seed=seed, extra_words=GEO3K_WORDS, max_position_embeddings=CONTEXT)
    return favour_words(out_dir, [len(VL_VOCAB) + i for i in range(len(GEO3K_WORDS))])


FAVOUR = 3.0  # LM-head row scale of the answer words: an untrained model picks them often


def favour_words(model_dir: str, ids: list[int], scale: float = FAVOUR) -> str:
    """Scale the LM head's rows of ``ids`` in the folder's model.safetensors: their logits spread
    wider, so a random model's argmax lands on one of them often, which one depending on the
    context. Without it an untrained model never writes an answer verl's scorers accept, and every
    reward would be 0."""
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"][ids] *= scale
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def sum_rows(n: int, seed: int, split: str, data_source: str = "openai/gsm8k") -> list[dict]:
    """``n`` rows of the sum task in verl's GSM8K layout (gsm8k.py), or its MATH layout
    (math_dataset.py) with ``data_source=MATH_SOURCE``."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        total = rng.choice(SUMS)
        a = rng.randint(1, total - 1)
        question = f"tom has {a} apples and gets {total - a} more . how many apples ?"
        extra = {"split": split, "index": i}
        if data_source == MATH_SOURCE:
            rows.append(to_verl_row(f"{question} {MATH_INSTRUCTION}", str(total), data_source, extra_info=extra))
            continue
        rows.append(to_verl_row(f"{question} {GSM8K_INSTRUCTION}", str(total), data_source, extra_info={
            **extra, "answer": f"{a} + {total - a} = {total} #### {total}", "question": question}))
    return rows


def shapes_rows(n: int, seed: int, split: str) -> list[dict]:
    """``n`` rows of the shapes count task in verl's geo3k layout (images as {bytes, path})."""
    from rlcore.demo.vl import draw_shapes
    from rlcore.task.images import IMAGE_PLACEHOLDER, encode_image

    rng, rows = random.Random(seed), []
    for i in range(n):
        image, shapes = draw_shapes(rng)
        question = f"{IMAGE_PLACEHOLDER} how many shapes are there ?"
        rows.append(to_verl_row(f"{question} {GEO3K_INSTRUCTION}", str(len(shapes)), "hiyouga/geometry3k",
                                images=[{"bytes": encode_image(image), "path": f"{split}_{i:05d}.png"}],
                                extra_info={"split": split, "index": i, "answer": str(len(shapes)), "question": question}))
    return rows
