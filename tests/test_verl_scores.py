"""verl's scorers as ported (rlcore/task/verl_scores) against verl's own code: every case of
tests/fixtures/verl_scores/cases.json, recorded by running verl 1dda039's
``default_compute_score`` (tests/fixtures/verl_scores/record.py), scores the same here: the same
float, or the same dict (math_dapo's score, acc and pred), or an exception where verl raised."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

CASES = os.path.join(REPO, "tests", "fixtures", "verl_scores", "cases.json")


def _ours(case: dict):
    from rlcore.task.verl_scores import default_compute_score

    try:
        return default_compute_score(case["data_source"], case["response"], case["ground_truth"])
    except Exception as e:
        return {"raises": type(e).__name__}


def test_every_recorded_case_scores_as_verl_scored_it():
    cases = json.load(open(CASES))["cases"]
    assert len(cases) >= 500
    differences = [(c["data_source"], c["response"][:80], c["ground_truth"], c["verl"], ours)
                   for c in cases if (ours := _ours(c)) != c["verl"]]
    assert not differences, f"{len(differences)} of {len(cases)} differ from verl: {differences[:10]}"


def test_the_cases_cover_every_source_and_outcome():
    """Each family has right and wrong answers recorded (no family is all zeros), and the values
    verl's families give: 1/0, +-1 with acc, geo3k's 0.1 and 0.9, Search-R1's quarter."""
    cases = json.load(open(CASES))["cases"]
    seen = Counter()
    for c in cases:
        v = c["verl"]
        seen[(_family(c["data_source"]), v.get("score", "raises") if isinstance(v, dict) else v)] += 1
    for family, values in {"gsm8k": (0.0, 1.0), "math": (0.0, 1.0), "dapo": (-1.0, 1.0), "prime": (0.0, 1.0),
                           "geo3k": (0.0, 0.1, 0.9, 1.0), "search": (0.0, 0.25, 1.0)}.items():
        for value in values:
            assert seen[(family, value)] >= 1, (family, value, seen)


def _family(source: str) -> str:
    from rlcore.task.verl_scores import scorer_module

    return {"gsm8k": "gsm8k", "math_reward": "math", "math_dapo": "dapo", "prime_math": "prime", "geo3k": "geo3k",
            "search_r1": "search"}.get(scorer_module(source), source)
