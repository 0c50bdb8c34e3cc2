"""verl's Search-R1 exact-match scorer (``searchR1_nq``, ``searchR1_triviaqa``, ``searchR1_popqa``,
``searchR1_hotpotqa``, ``searchR1_2wikimultihopqa``, ``searchR1_musique``, ``searchR1_bamboogle``):
the last ``<answer>...</answer>`` matches one of ``ground_truth["target"]`` after SQuAD normalisation
(lower case, no punctuation or articles): 1.0, divided by 4 when the response has more than 10
opening or closing answer tags; 0.0 otherwise.

Ported from verl 1dda039, verl/utils/reward_score/search_r1_like_qa_em.py:22-113 (Apache-2.0;
adapted there from Search-R1's qa_em.py), without its random debug prints; the ground truth is the
row's ``reward_model.ground_truth`` dict as verl's preprocessing writes it: ``{"target": [...]}``.
"""

from __future__ import annotations

import re
import string


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def em_check(prediction: str, golden_answers) -> int:
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    normalized_prediction = normalize_answer(prediction)
    return int(any(normalize_answer(golden) == normalized_prediction for golden in golden_answers))


def extract_solution(solution_str: str) -> str | None:
    matches = list(re.finditer(r"<answer>(.*?)</answer>", solution_str, re.DOTALL))
    return matches[-1].group(1).strip() if matches else None


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, ground_truth["target"]):
        return float(format_score)
    if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:  # a flood of answer tags
        return score / 4
    return float(score)
