"""Offline assets for the bundled demo and the tests: a word-level tokenizer, a tiny random Qwen3
model saved as an HF safetensors folder, and a toy task whose answers a rule can check.

The task ("copy the marked digit"): the prompt lists a few digits and then asks for one of them by
position, e.g. ``d 3 7 pick 2nd =``; the right response starts with ``7``. A random model answers
right about 1 time in 26 (it first has to learn to emit a digit at all, then which one), and GRPO
makes it reliable within a few minutes on a CPU, which is what the demo shows.
"""

from __future__ import annotations

import json
import os
import random

DIGITS = [str(i) for i in range(10)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = ["d", "pick", "=", "1st", "2nd", "3rd", "4th", "ans", "is", "the", "a", "?", "!"]
VOCAB = SPECIAL + DIGITS + WORDS
POSITION_WORDS = ["1st", "2nd", "3rd", "4th"]
DEMO_RM_PREFERRED = ["5", "6", "7", "8", "9"]  # what the judge demo's reward model prefers


def make_tokenizer(out_dir: str) -> None:
    """Write a word-level fast tokenizer (tokenizer.json + config) that transformers and vLLM load."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(out_dir)


def make_tiny_model(
    out_dir: str,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,  # vLLM's CPU attention rejects head_dim 16
    intermediate_size: int = 256,
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    family: str = "qwen3",
) -> str:
    """Create a randomly initialised Qwen3 (or ``family="llama"``) model + tokenizer as an HF
    safetensors folder. ``tie_word_embeddings``: the LM head shares the embedding matrix, as in
    SmolLM2 and the small Qwen3 / Qwen2.5 releases (one tensor, ``model.embed_tokens.weight``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if family not in classes:
        raise ValueError(f"family={family!r}: choose one of {sorted(classes)}")
    config_cls, model_cls = classes[family]
    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir)
    config = config_cls(
        vocab_size=vocab_size or len(VOCAB),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=VOCAB.index("<pad>"),
        eos_token_id=VOCAB.index("<eos>"),
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_moe_model(out_dir: str, *, hidden_size: int = 64, num_layers: int = 2, num_experts: int = 4,
                        top_k: int = 2, moe_intermediate_size: int = 64, head_dim: int = 32, seed: int = 0,
                        max_position_embeddings: int = 512, num_heads: int = 2, num_kv_heads: int = 1,
                        vocab_size: int | None = None) -> str:
    """A randomly initialised Qwen3-MoE + tokenizer as an HF safetensors folder (per-expert weight
    names, as transformers saves them). Hidden size a multiple of 32: vLLM's CPU MoE needs it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size or len(VOCAB), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, pad_token_id=VOCAB.index("<pad>"), eos_token_id=VOCAB.index("<eos>"),
        bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_example(rng: random.Random, num_digits: int = 4) -> dict:
    digits = [rng.choice(DIGITS) for _ in range(num_digits)]
    pos = rng.randrange(num_digits)
    prompt = "d " + " ".join(digits) + f" pick {POSITION_WORDS[pos]} ="
    return {"prompt": prompt, "answer": digits[pos]}


def make_toy_data(out_dir: str, *, n_train: int = 2000, n_val: int = 200, seed: int = 0,
                  num_digits: int = 2) -> tuple[str, str]:
    """Write toy_train.jsonl and toy_val.jsonl (``prompt``/``answer`` rows) from separate seeds."""
    return write_splits(out_dir, "toy", n_train, n_val, seed, lambda rng: make_example(rng, num_digits))


def write_splits(out_dir: str, stem: str, n_train: int, n_val: int, seed: int, make_row) -> tuple[str, str]:
    """{stem}_train.jsonl and {stem}_val.jsonl of ``make_row(rng)`` rows, each split from its own seed."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, n, s in ((f"{stem}_train.jsonl", n_train, seed), (f"{stem}_val.jsonl", n_val, seed + 1_000_003)):
        rng = random.Random(s)
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            for _ in range(n):
                f.write(json.dumps(make_row(rng)) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def make_tiny_reward_model(out_dir: str, *, preferred: list[str] | None = None, hidden_size: int = 64,
                           num_layers: int = 1, seed: int = 0) -> str:
    """A tiny Qwen3ForSequenceClassification (one label) on the toy vocabulary, for the judge demo
    and tests. ``preferred`` None: random weights. A list of words: weights built by hand so the
    head's value is about +7.7 when the last token is one of them and -7.7 otherwise (the layers
    add nothing to the residual stream, one embedding dimension carries the property, the head
    reads it after the final norm): a reward model that prefers a property a policy can learn."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir)
    config = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_labels=1,
        max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=VOCAB.index("<pad>"),
        eos_token_id=VOCAB.index("<eos>"), bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(config).to(torch.float32)
    if preferred is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            emb = model.model.embed_tokens.weight
            emb.normal_(0.0, 0.1)
            emb[:, 0] = torch.tensor([3.0 if tok in preferred else -3.0 for tok in VOCAB])
            model.score.weight.zero_()
            model.score.weight[0, 0] = 1.0
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_qwen2_reward_model(out_dir: str, *, hidden_size: int = 64, num_layers: int = 1, seed: int = 0) -> str:
    """A tiny random ``Qwen2ForRewardModel`` (the Qwen2.5-Math-RM layout vLLM serves: Qwen2Model, then
    score = Linear(h, h) -> ReLU -> Linear(h, 1) on every token) on the toy vocabulary. transformers has
    no such class: the weights are written by hand under vLLM's checkpoint names."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=VOCAB.index("<pad>"),
                         eos_token_id=VOCAB.index("<eos>"), bos_token_id=None, torch_dtype="float32", num_labels=1)
    torch.manual_seed(seed)
    body = Qwen2Model(config).to(torch.float32)
    head = torch.nn.Sequential(torch.nn.Linear(hidden_size, hidden_size), torch.nn.ReLU(), torch.nn.Linear(hidden_size, 1))
    tensors = {f"model.{k}": v.contiguous() for k, v in body.state_dict().items()}
    tensors.update({f"score.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config.to_dict(), "architectures": ["Qwen2ForRewardModel"]}, f, indent=1)
    return out_dir
