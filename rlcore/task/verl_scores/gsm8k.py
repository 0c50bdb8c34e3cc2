"""verl's GSM8K scorer (``openai/gsm8k``): strict ``#### <number>`` format. The last ``#### N`` in the
response's last 300 characters, commas and ``$`` removed, must equal the ground truth as a string:
1.0, else 0.0 (no format score). ``The answer is 60.``, ``\\boxed{60}``, ``#### 60.0`` against ``60``
all score 0.

Ported from verl 1dda039, verl/utils/reward_score/gsm8k.py:17-72 (Apache-2.0); the dispatch
(``verl/utils/reward_score/__init__.py:44-47``) calls it with its defaults: method="strict",
format_score=0.0, score=1.0.
"""

from __future__ import annotations

import re

_SOLUTION_CLIP_CHARS = 300  # gsm8k.py:17: only the end of a long response is searched


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """gsm8k.py:20-48."""
    if method not in ("strict", "flexible"):
        raise AssertionError(f"method {method!r}")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    final_answer = None
    for final_answer in reversed(re.findall("(\\-?[0-9\\.\\,]+)", solution_str)):
        if final_answer not in ("", "."):
            break
    return final_answer


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """gsm8k.py:51-72: ``score`` when the extracted answer equals ``ground_truth`` (compared as given:
    a ground truth that is not a string never matches), ``format_score`` when another number follows
    ``####``, 0 when none does."""
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score if answer == ground_truth else format_score)
