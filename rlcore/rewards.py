"""Rule-based rewards. Each built-in is ``fn(response: str, answer: str) -> float`` in a registry;
``score`` evaluates a weighted sum of them and reports per-component means.
"""

from __future__ import annotations

import re
from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(REWARDS)}")
    return REWARDS[name]


@register("exact_match")
def exact_match(response: str, answer: str) -> float:
    return float(response.strip() == str(answer).strip())


@register("first_word_match")
def first_word_match(response: str, answer: str) -> float:
    """1 when the response's first whitespace-separated word is the answer (toy tasks)."""
    words = response.split()
    return float(bool(words) and words[0] == str(answer).strip())


@register("math")
def math_answer(response: str, answer: str) -> float:
    """Math answer checking with math-verify: boxed or final-number extraction, symbolic equality."""
    from math_verify import parse, verify

    gold = parse(str(answer) if "$" in str(answer) or "\\" in str(answer) else f"${answer}$")
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


@register("format_boxed")
def format_boxed(response: str, answer: str) -> float:
    return float("\\boxed{" in response)


@register("format_answer_tag")
def format_answer_tag(response: str, answer: str) -> float:
    return float(re.search(r"<answer>.*?</answer>", response, re.DOTALL) is not None)


def score(responses: list[str], answers: list[str], components: dict[str, float]) -> tuple[list[float], dict]:
    """Weighted sum of the named rewards for each response, and ``reward/{name}`` component means."""
    totals = [0.0] * len(responses)
    metrics = {}
    for name, weight in components.items():
        fn = get_reward(name)
        values = [fn(r, a) for r, a in zip(responses, answers)]
        totals = [t + weight * v for t, v in zip(totals, values)]
        metrics[f"reward/{name}"] = sum(values) / max(len(values), 1)
    return totals, metrics
