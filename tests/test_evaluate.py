"""scripts/evaluate.py end to end on one CPU process (real vLLM): text rows, image rows, and a
vision flag on a text model refused before any engine starts. The score must be the one its own
per-sample file implies (accuracy = mean of the greedy ``correct`` flags, one row per prompt)."""

import json
import os
import subprocess
import sys

from conftest import QUIET_ENV, REPO

EVALUATE = os.path.join(REPO, "scripts", "evaluate.py")


def evaluate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV}
    return subprocess.run([sys.executable, EVALUATE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def check_scores(proc: subprocess.CompletedProcess, samples: str, n_rows: int) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(samples) as f:
        rows = [json.loads(line) for line in f]
    assert result["n"] == len(rows) == n_rows
    assert abs(result["accuracy"] - sum(r["correct"] for r in rows) / n_rows) < 1e-9
    assert all(isinstance(r["response"], str) and r["answer"] for r in rows)
    return rows


def test_text_rows(tiny_model, toy_data, tmp_path):
    samples = str(tmp_path / "samples.jsonl")
    proc = evaluate("--model", tiny_model, "--data", toy_data[1], "--max-samples", "12", "--max-prompt-length", "16",
                    "--max-tokens", "4", "--reward", "first_word_match", "--samples-out", samples)
    check_scores(proc, samples, 12)


def test_image_rows(tiny_vl_model, shapes_data, tmp_path):
    samples = str(tmp_path / "samples.jsonl")
    proc = evaluate("--model", tiny_vl_model, "--data", shapes_data[1], "--image-key", "images",
                    "--max-prompt-length", "40", "--max-tokens", "4", "--reward", "first_word_match",
                    "--samples-out", samples)
    rows = check_scores(proc, samples, 16)
    assert all("<|vision_start|><|image_pad|><|vision_end|>" in r["prompt"] for r in rows)  # the chat template placed it


def test_image_key_on_a_text_model_is_refused(tiny_model, shapes_data):
    proc = evaluate("--model", tiny_model, "--data", shapes_data[1], "--image-key", "images")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "text-only model" in proc.stderr and "image_key" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_judge_scores_a_saved_model(tiny_model, toy_data, tmp_path):
    """--judge: a reward model's verdict is the score; its raw output sits next to each answer. The
    second run samples after the greedy pass: the policy's engine is woken after the judge's turn."""
    import yaml

    from rlcore import quiet
    from rlcore.demo.toy import DEMO_RM_PREFERRED, make_tiny_reward_model

    with quiet.filtered_output():
        rm = make_tiny_reward_model(str(tmp_path / "rm"), preferred=DEMO_RM_PREFERRED)
    entry = {"name": "high", "path": rm, "kind": "discriminative", "activation": "sigmoid", "pass_threshold": 0.5,
             "template": "{{ response.split()[0] if response.split() else '?' }}", "max_model_len": 32}
    judge = tmp_path / "judge.yaml"
    judge.write_text(yaml.safe_dump([entry]))
    samples = str(tmp_path / "samples.jsonl")
    proc = evaluate("--model", tiny_model, "--data", toy_data[1], "--max-samples", "12", "--max-prompt-length", "16",
                    "--max-tokens", "4", "--reward", "high", "--judge", str(judge), "--samples-out", samples,
                    "--n", "2")
    rows = check_scores(proc, samples, 12)
    for r in rows:
        first = r["response"].split()[0] if r["response"].split() else "?"
        assert r["judge_high_output"] == r["judge_high_score"] == r["reward"]
        assert r["correct"] == (first in DEMO_RM_PREFERRED) == (r["reward"] > 0.5)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump([{**entry, "path": str(tmp_path / "nowhere")}]))
    proc = evaluate("--model", tiny_model, "--data", toy_data[1], "--reward", "high", "--judge", str(bad))
    assert proc.returncode == 2 and "reward.models[0].path=" in proc.stderr and "is not a model folder" in proc.stderr
