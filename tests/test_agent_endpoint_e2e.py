"""Agent episodes through the real entry point (2 CPU ranks, conftest.run_torchrun): configs/demo_agent_cpu.yaml,
whose agent (rlcore/demo/agent.py) talks to each rank's endpoint with the official openai client and
compacts its history every other request (episodes train as several segments).

  A   4 steps straight: one engine sharded over both ranks (TP 2: the leader serves the episodes, the
      other rank replays its engine calls), dynamic sampling, turns batching, a checkpoint every 2
      steps, validation through the same agent at the end.
  B   the same run killed with kill -9 once step_2 is saved and step 3 is logged, then resumed: the
      same metrics rows as A (the resumed step's episodes draw what the first run's drew).
  C   partial rollouts (TP 2): groups still running at the stop rule are cancelled and run again later.
  D   an agent that always raises: every rank stops with exit code 5 and says why, after step 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import QUIET_ENV, REPO, run_torchrun
from workers.launch import TRAIN, comparable, kill9_when, rank_exit_codes, read_rows

STEPS = 4


def args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_agent_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", json.dumps([data]),
            "--trainer.output_dir", out, "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4",
            "--rollout.n", "8", "--trainer.val_every", "4", "--trainer.val_before_train", "false",
            "--val.max_samples", "8", *extra]


EXACT = ("--algorithm.dynamic_sampling", "true", "--rollout.tensor_parallel_size", "2",
         "--rollout.agent.batching", "turns", "--checkpoint.save_every", "2", "--checkpoint.keep_last", "5")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlcore.demo.tool import make_tool_data, make_tool_model

    root = tmp_path_factory.mktemp("agent_endpoint_e2e")
    model = make_tool_model(str(root / "model"))
    data, _ = make_tool_data(str(root / "data"), n_train=64, n_val=8)
    return root, model, data


@pytest.fixture(scope="module")
def runs(assets):
    root, model, data = assets
    a, b = str(root / "a"), str(root / "b")
    straight = run_torchrun(TRAIN, 2, *args(model, data, a, *EXACT))
    b_args = args(model, data, b, *EXACT, "--checkpoint.resume", "auto")
    kill9_when(2, b_args, r"saved checkpoint .*step_2$", r"^step +3/")
    run_torchrun(TRAIN, 2, *b_args)
    return {"a": a, "b": b, "straight": straight.stdout}


def test_agent_run_logs_episode_metrics_and_trains_the_engines_log_probs(runs):
    rows = read_rows(runs["a"])
    train = [r for r in rows if "agent/episodes" in r and "val/accuracy" not in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r["agent/failures"] == 0 and r["agent/requests_mean"] >= 1.0
        assert r["agent/segments_mean"] >= 1.0 and r["agent/train_rows"] >= 32
        assert r["timing/agent_request_s"] > 0.0
        # The trainer's log-probs of every segment's sampled tokens equal vLLM's (context tokens masked).
        assert r["rollout/mismatch_max"] < 1e-4
    assert any(r["agent/segments_mean"] > 1.0 for r in train)  # compacted histories: several segments
    assert "agent: rlcore/demo/agent.py:run in process workers" in runs["straight"]
    assert "tp=2 dp=1" in runs["straight"]
    val = [json.loads(line) for line in open(os.path.join(runs["a"], "val", f"step_{STEPS}.jsonl"))]
    assert val and all("conversation" in v for v in val)
    assert "val/accuracy" in rows[-1]


def test_kill9_then_resume_gives_the_same_rows(runs):
    a_rows, b_rows = read_rows(runs["a"]), read_rows(runs["b"])
    assert [r["step"] for r in b_rows] == [r["step"] for r in a_rows]
    for ra, rb in zip(a_rows, b_rows):
        assert comparable(ra) == comparable(rb), (ra["step"], comparable(ra), comparable(rb))


def test_partial_rollouts_cancel_running_episodes_and_run_their_groups_again(assets):
    root, model, data = assets
    out = str(root / "partial")
    run_torchrun(TRAIN, 2, *args(model, data, out, "--rollout.partial.enable", "true",
                                 "--rollout.tensor_parallel_size", "2",  # the stop rule on the follower too
                                 "--rollout.partial.oversample", "2", "--trainer.total_steps", "3",
                                 "--trainer.val_every", "0"))
    rows = [r for r in read_rows(out) if "rollout/suspended_groups" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["rollout/staleness_max"] == 0.0 and rows[0]["rollout/mismatch_max"] < 1e-4
    assert all(r["rollout/suspended_groups"] > 0 for r in rows)  # over the target: waiting in the pool
    assert all(r["agent/failures"] == 0 for r in rows)


def test_a_failing_agent_stops_the_run_with_exit_code_5(assets):
    root, model, data = assets
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=5",
           TRAIN, *args(model, data, str(root / "failing"), "--rollout.agent.entry", "tests/workers/agents.py:run")]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert rank_exit_codes(out) == {0: 5, 1: 5}, out[-4000:]
    assert "32 of 32 episodes failed (raised 32), more than rollout.agent.max_failure_frac=0.5" in out, out[-4000:]
    assert "KeyError: 'mode'" in out  # the agent's own traceback: its rows have no "mode"


def test_bench_agent_runs_at_a_tiny_size():
    """scripts/bench_agent.py as a user starts it (its figures are read, not tested): its last line holds,
    for each model size, each side's milliseconds per sample, its CPU split, and each endpoint variant's
    ratio to the built-in loop."""
    from test_benchmarks import run_bench

    sides = ("builtin", "process/continuous", "thread/turns")
    r = run_bench("bench_agent.py", "--calls", "1", "--prompts", "2", "--n", "4", "--sizes", "128x2x3,256x2x4",
                  "--variants", ",".join(sides[1:]))
    parts = ("engine", "loop", "endpoint", "agents")
    per_side = ["ms_per_sample", "cpu_ms_per_sample", *(f"cpu_{k}_ms" for k in parts)]
    assert set(r) == {f"{size}/{side}_{key}" for size in ("128x2x3", "256x2x4") for side in sides
                      for key in per_side + (["ratio"] if side != "builtin" else [])}
    assert all(v > 0 for k, v in r.items() if "_cpu_" not in k or k.endswith("_cpu_ms_per_sample"))
