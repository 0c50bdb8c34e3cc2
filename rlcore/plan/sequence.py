"""The longest sequence whose train phase fits one rank, with and without Ulysses sequence
parallelism (``parallel.ulysses_size``): the memory plan's train phase for one sequence per
micro-batch, searched over its length (``scripts/plan_memory.py --longest``)."""

from __future__ import annotations

from dataclasses import replace

from rlcore.plan.inputs import PlanInputs
from rlcore.plan.memory import build_plan

STEP = 256  # tokens: the search's resolution


def train_fits(p: PlanInputs, tokens: int, ulysses: int) -> bool:
    """One ``tokens``-long sequence (the config's prompt length, the rest response) per micro-batch:
    does the train phase fit the device?"""
    prompt = min(p.prompt_len, tokens // 2)
    q = replace(p, ulysses=ulysses, micro_batch_size=1, prompt_len=prompt, response_len=tokens - prompt)
    plan = build_plan(q, suggest=False)
    return plan.total("train") <= plan.limit


def longest_train_sequence(p: PlanInputs, ulysses: int, most: int = 1 << 21) -> int:
    """The longest multiple of STEP tokens for which ``train_fits``; 0 when not even STEP does."""
    lo, hi = 0, most // STEP  # in units of STEP: lo fits (or is 0), hi + 1 does not
    if train_fits(p, most, ulysses):
        return most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if train_fits(p, mid * STEP, ulysses) else (lo, mid - 1)
    return lo * STEP


def ulysses_sizes(p: PlanInputs) -> list[int]:
    """1 and the powers of two up to 16 that divide the world size and the attention heads, and that
    the key/value heads divide or are divided by (``rlcore.run.preflight``'s rule)."""
    s = p.shape
    return [u for u in (1, 2, 4, 8, 16) if p.world % u == 0 and s.heads % u == 0
            and (s.kv_heads % u == 0 or u % s.kv_heads == 0)]
