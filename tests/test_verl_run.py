"""A run configured as a verl user would configure it, through the real entry point: the keys of
issue 58 working together in one trainer run (their unit tests are in test_verl_keys.py and
test_trackers.py)."""

from __future__ import annotations

import glob
import json
import math
import os

from conftest import REPO, run_torchrun
from test_trackers import read_wandb_run


def read_rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_epochs_never_save_wandb_and_mlflow_in_one_run(tiny_model, toy_data, tmp_path):
    """trainer.total_epochs 1 over 10 prompts at 4 a step: 3 steps, and the cosine schedule and the
    final validation follow those 3 (hand-computed lr: 1, 0.75, 0.25 of the peak); save_every -1:
    said at start-up, no checkpoints folder; wandb offline (no WANDB_MODE set) and MLflow's local
    store beside TensorBoard: each read back holds every finite metrics.jsonl value at its step."""
    rows = open(toy_data[0]).read().splitlines()[:10]
    data = tmp_path / "ten.jsonl"
    data.write_text("\n".join(rows) + "\n")
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    proc = run_torchrun(
        os.path.join(REPO, "train_grpo.py"), 1, "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"),
        "--model.path", tiny_model, "--data.train_files", json.dumps([str(data)]),
        "--data.val_files", json.dumps([toy_data[1]]), "--trainer.val_every", "5",
        "--trainer.output_dir", out, "--trainer.total_steps", "null", "--trainer.total_epochs", "1",
        "--trainer.prompts_per_step", "4", "--rollout.n", "4", "--optim.lr_schedule", "cosine",
        "--checkpoint.save_every", "-1", "--checkpoint.save_hf_final", "false",
        "--logging.trackers", '["tensorboard", "wandb", "mlflow"]', env=env)
    assert "trainer.total_epochs 1 -> total_steps 3 (10 prompts, 4 per step)" in proc.stdout
    assert "checkpoint.save_every=-1: this run writes no checkpoint" in proc.stdout
    assert "wandb: mode offline (from logging.wandb.mode)" in proc.stdout
    metrics = read_rows(out)
    train = [r for r in metrics if "actor/lr" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and "step 3/3" in proc.stdout
    peak = 1e-3  # demo_cpu.yaml's optim.lr
    cosine = [0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]  # 1, 0.75, 0.25
    assert [r["actor/lr"] for r in train] == [peak * c for c in cosine] or \
        [r["actor/lr"] for r in train] == [peak * c for c in cosine[1:] + [0.0]], [r["actor/lr"] for r in train]
    assert any(k.startswith("val/") and r["step"] == 3 for r in metrics for k in r)  # the last step validates
    assert not os.path.exists(os.path.join(out, "checkpoints")) and not os.path.exists(os.path.join(out, "hf_final"))

    expected = {(r["step"], k): v for r in metrics for k, v in r.items() if k != "step" and isinstance(v, float)}
    history, config, _ = read_wandb_run(out)
    assert set(history) == set(expected)
    assert all(math.isclose(history[key], expected[key], rel_tol=1e-6, abs_tol=1e-9) for key in expected)
    assert config["trainer"]["total_steps"] == 3 and config["trainer"]["total_epochs"] == 1

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(out, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("rlcore").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.total_steps"] == "3"
    for key in {k for _, k in expected}:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key.replace("@", "_"))}
        want = {s: v for (s, k), v in expected.items() if k == key}
        assert logged.keys() == want.keys() and all(math.isclose(logged[s], want[s], rel_tol=1e-6) for s in want), key
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
