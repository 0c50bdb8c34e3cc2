"""Validation with the colocated engine on real torchrun CPU ranks: the all-reduced val/* metrics
equal a direct count over every rank's generations (tp=1 and tp=2); the trainer validates before
training and every trainer.val_every steps, writes sample files, survives a reward function that
always raises, and plot_metrics.py draws its curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "validation_worker.py")


def test_validation_metrics_equal_a_recount_over_all_ranks(tiny_model, toy_data, tmp_path):
    out = tmp_path / "val.json"
    run_torchrun(WORKER, 2, tiny_model, toy_data[1], str(out), timeout=600)
    results = json.loads(out.read_text())
    for tp in ("tp1", "tp2"):
        got, want = results[tp]["metrics"], results[tp]["expected"]
        assert got["val/num_prompts"] == 11, (tp, got)  # every prompt once: none lost, none double-counted
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-9), (tp, key, got, want)
        examples = results[tp]["examples"]
        assert len(examples) == 2 and set(examples[0]) >= {"prompt", "response", "answer", "reward", "correct"}
    # The sampled pass differs from the greedy one (else mean@n would not test sampling).
    assert any(r["expected"]["val/mean@3"] not in (0.0, 1.0) for r in results.values()), results


def test_trainer_validates_and_survives_a_failing_reward(tiny_model, toy_data, tmp_path):
    out = tmp_path / "run"
    proc = run_torchrun(
        os.path.join(REPO, "train_grpo.py"), 2,
        "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
        "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", json.dumps([toy_data[1]]),
        "--trainer.total_steps", "3", "--trainer.prompts_per_step", "4", "--rollout.n", "8",
        "--algorithm.dynamic_sampling", "false", "--trainer.output_dir", str(out),
        "--trainer.val_every", "2", "--trainer.val_before_train", "true", "--val.n", "2",
        "--val.max_samples", "10", "--val.num_examples", "3", "--checkpoint.save_hf_final", "false",
        "--reward.fn", f"{os.path.join(REPO, 'tests', 'workers', 'validation_worker.py')}:always_raises",
        "--reward.components", "{custom: 1.0}", "--reward.error_value", "-0.5", "--algorithm.kl_loss_coef", "0",
        timeout=600)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    val = {r["step"]: r for r in rows if "val/accuracy" in r}
    train = {r["step"]: r for r in rows if "reward/mean" in r}
    assert sorted(val) == [0, 2, 3] and sorted(train) == [1, 2, 3]  # before training, every 2, last
    for r in val.values():
        assert r["val/num_prompts"] == 10 and r["val/accuracy"] == 0.0
        assert r["val/errors"] == 10 + 10 * 2  # greedy + sampled samples, all failed
        assert r["val/reward_mean"] == -0.5 and "val/mean@2" in r and "val/pass@2" in r
    for r in train.values():  # 4 prompts x 8 samples per step, each failed, the run went on
        assert r["reward/errors"] == 32 and r["reward/mean"] == -0.5 and r["reward/accuracy"] == 0.0
    for step in (0, 2, 3):
        lines = [json.loads(x) for x in open(out / "val" / f"step_{step}.jsonl")]
        assert len(lines) == 3 and all(x["step"] == step and x["reward"] == -0.5 for x in lines)
    output = proc.stdout + proc.stderr
    assert output.count("RuntimeError: this reward always fails") == 2, output[-4000:]  # once per rank

    png = tmp_path / "curves.png"
    plot = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(out), "--out", str(png)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "reward" in plot.stdout and "accuracy" in plot.stdout and "step time" in plot.stdout
