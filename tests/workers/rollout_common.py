"""Helpers for the rollout workers: a transformers reference and deterministic weight noise.

Imported by tests/workers/rollout_worker.py (same folder, so a plain import works when torchrun
runs the script by path).
"""

from __future__ import annotations

import random

import torch

from rlcore.demo.toy import VOCAB, make_example


def toy_prompts(num: int, long_len: int = 160) -> list[list[int]]:
    """``num`` toy-task prompts as ids, plus one prompt longer than vLLM's CPU KV block (128
    tokens) so its first block lands in the prefix cache: stale cached KV then shows up in the
    weight-update and release/resume checks."""
    rng = random.Random(0)
    ids = {w: i for i, w in enumerate(VOCAB)}
    prompts = [[ids[w] for w in make_example(rng)["prompt"].split()] for _ in range(num)]
    prompts.append([rng.randrange(3, len(VOCAB)) for _ in range(long_len)])
    return prompts


def run_kinds(run_kind, argv: list[str]) -> None:
    """``argv``: OUT_JSON KIND=MODEL_DIR ...: ``run_kind(info, kind, model_dir)`` for each in turn on this
    rank (one launch, one engine at a time), the results as one JSON object in OUT_JSON."""
    import json

    from rlcore.dist import init_distributed

    out_path, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
    info = init_distributed("cpu", 600)
    results = {kind: run_kind(info, kind, model_dir) for kind, model_dir in runs}
    with open(out_path, "w") as f:
        json.dump(results, f)


def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """[len(response)] log_softmax(logits / T) at the response tokens, fp32 full forward."""
    ids = torch.tensor([prompt + response])  # [1, P+R]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_diff(model, prompts, samples, temperature: float) -> float:
    """Max |vLLM logprob - transformers logprob| over every sampled token of every sample."""
    worst = 0.0
    for prompt, per_prompt in zip(prompts, samples):
        for s in per_prompt:
            ref = hf_logprobs(model, prompt, s.response_ids, temperature)
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


@torch.no_grad()
def perturb_(model, seed: int, scale: float = 0.05) -> None:
    """Add fixed-seed gaussian noise to every parameter (same result on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def as_plain(samples) -> list[list[tuple[list[int], list[float], str]]]:
    return [[(s.response_ids, s.logprobs, s.finish_reason) for s in per] for per in samples]
