"""verl's rule-based scorers, picked by a row's ``data_source`` as verl's ``default_compute_score``
picks them (verl 1dda039, verl/utils/reward_score/__init__.py:19-123), with the values verl returns:

    openai/gsm8k                                     gsm8k.py        1.0 / 0.0 (strict ``#### N``)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500                           math_reward.py  1.0 / 0.0 (last \\boxed{})
    math_dapo, math, math_dapo_reasoning, aime*      math_dapo.py    {"score": +-1.0, "acc", "pred"}
    numina_aops_forum, numina_synthetic_math, numina_amc_aime,
    numina_synthetic_amc, numina_cn_k12, numina_olympiads
                                                     prime_math.py   1.0 / 0.0 (PRIME's grader)
    hiyouga/geometry3k                               geo3k.py        0.9 x accuracy + 0.1 x format
    searchR1_nq, _triviaqa, _popqa, _hotpotqa, _2wikimultihopqa, _musique, _bamboogle
                                                     search_r1.py    exact match of <answer>

verl's code sources (codecontests, apps, codeforces, taco) run the model's code in a sandbox and are
not ported: such a row is refused at start-up, as is any source verl refuses (its
NotImplementedError message). The parity test (tests/test_verl_scores.py) scores several hundred
recorded cases against verl's own code (tests/fixtures/verl_scores/).

May import: the standard library, sympy, pylatexenc and mathruler (lazily, where verl does), and
``rlcore.task.timeouts``. Not the rest of the task wing: ``rlcore.task.rewards`` imports this.
"""

from __future__ import annotations

import importlib
from typing import Callable

# (the sources, verl's module here) in verl's order of tests (__init__.py:44-114); "aime" matches by prefix.
_TABLE: list[tuple[tuple[str, ...], str]] = [
    (("openai/gsm8k",), "gsm8k"),
    (("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"), "math_reward"),
    (("math_dapo", "math", "math_dapo_reasoning"), "math_dapo"),
    (("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
      "numina_olympiads"), "prime_math"),
    (("hiyouga/geometry3k",), "geo3k"),
    (("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
      "searchR1_musique", "searchR1_bamboogle"), "search_r1"),
]
AIME_PREFIX = "aime"  # any data_source starting with it: math_dapo (__init__.py:59)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # __init__.py:70-86: sandboxed code, not ported


def scorer_module(data_source) -> str | None:
    """The module of this package that scores ``data_source`` (None: verl has none, or it is code)."""
    if not isinstance(data_source, str):
        return None
    for sources, module in _TABLE:
        if data_source in sources:
            return module
    return "math_dapo" if data_source.startswith(AIME_PREFIX) else None


def refusal(data_source) -> str | None:
    """Why ``data_source`` cannot be scored here (verl's own message for a source it does not know),
    or None when it can."""
    if scorer_module(data_source) is not None:
        return None
    if data_source in CODE_SOURCES:
        return (f"data_source={data_source!r} is a code source: verl scores it by running the response's code "
                f"(prime_code or a sandbox_fusion server), which is not ported here")
    return f"Reward function is not implemented for data_source={data_source!r}"  # verl's __init__.py:116


def supported_sources() -> list[str]:
    return [s for sources, _ in _TABLE for s in sources] + [f"{AIME_PREFIX}*"]


def _compute(module: str) -> Callable:
    return importlib.import_module(f"{__name__}.{module}").compute_score


def default_compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs):
    """verl's ``default_compute_score`` (__init__.py:19-123): a float, or the scorer's dict
    (math_dapo's ``{"score", "acc", "pred"}``). NotImplementedError for a source verl refuses."""
    module = scorer_module(data_source)
    if module is None:
        raise NotImplementedError(refusal(data_source))
    res = _compute(module)(solution_str, ground_truth)
    if isinstance(res, dict):
        return res
    if isinstance(res, (int, float, bool)):
        return float(res)
    return float(res[0])  # prime_math: (is_correct, format_correctness, extracted)
