"""verl's Geometry3K scorer (``hiyouga/geometry3k``): 0.9 x accuracy + 0.1 x format.

Accuracy: mathruler's ``grade_answer`` of the last ``\\boxed{}`` content against the ground truth
(mathruler 0.1.0, the library verl grades with). Format: the whole response matches
``<think>...</think>...\\boxed{...}...``. So a right answer without the think block scores 0.9, a
wrong one in the right format 0.1. Ported from verl 1dda039, verl/utils/reward_score/geo3k.py:15-36
(Apache-2.0), called there with use_boxed=True, format_score=0.1 (__init__.py:89-92).
"""

from __future__ import annotations

import re

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # geo3k.py:21


def format_reward(predict_str: str) -> float:
    return 1.0 if re.fullmatch(_FORMAT, predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    from mathruler.grader import extract_boxed_content, grade_answer

    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if grade_answer(answer, ground_truth) else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    return (1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed) + format_score * format_reward(
        predict_str)
