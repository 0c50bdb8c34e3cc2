"""Multi-turn GRPO through the real entry point (2 CPU ranks, conftest.run_torchrun): the tool
demo's config with the environment-served lookup tool, DAPO dynamic sampling and shared-prompt
packing on, one vLLM engine sharded over both ranks (TP 2: the leader runs the tools, the other rank
takes its answers), the train phase as one Ulysses group of the 2 ranks (tool tokens attended to,
masked out of the loss, in every rank's half of the row); a run killed with kill -9, preempted and
resumed writes the same metrics rows as one run straight through.

  A   4 steps straight through, a checkpoint every 2 steps, validation at the end.
  B1  the same run killed with kill -9 once step_2 is saved and step 3 is logged.
  B2  relaunched with checkpoint.resume=auto (from step_2), preempted by SIGUSR1 in step 4's generation
      phase (after its conversations, before training): step 4 is dropped, step 3 checkpointed, exit 75.
      Resuming after a preemption is the same code with or without tools (tests/test_resume.py).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun
from workers.launch import TRAIN, comparable, kill9_when, preempt_at, rank_exit_codes, read_rows

STEPS = 4


def args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_tool_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", json.dumps([data]),
            "--trainer.output_dir", out, "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4",
            "--rollout.n", "8", "--trainer.val_every", "4", "--trainer.val_before_train", "false",
            "--val.max_samples", "8", "--algorithm.dynamic_sampling", "true", "--algorithm.share_prompt", "true",
            "--rollout.tensor_parallel_size", "2", "--checkpoint.save_every", "2", "--checkpoint.keep_last", "5",
            "--rollout.emulate_sleep", "true",  # level 2 as on a GPU (rlcore/rollout/cpu_sleep.py)
            "--parallel.ulysses_size", "2",  # the train phase as one Ulysses group: half of every row per rank
            *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from rlcore.demo.tool import make_tool_data, make_tool_model

    root = tmp_path_factory.mktemp("agent_e2e")
    model = make_tool_model(str(root / "model"))
    data, _ = make_tool_data(str(root / "data"), n_train=64, n_val=8)
    a, b = str(root / "a"), str(root / "b")
    straight = run_torchrun(TRAIN, 2, *args(model, data, a))
    b_args = args(model, data, b, "--checkpoint.resume", "auto")
    kill9_when(2, b_args, r"saved checkpoint .*step_2$", r"^step +3/")
    preempted = preempt_at(2, b_args, 4)
    return {"a": a, "b": b, "straight": straight.stdout, "preempted": preempted}


def test_multi_turn_run_logs_tool_metrics_and_conversations(runs):
    rows = read_rows(runs["a"])
    train = [r for r in rows if "rollout/turns_mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert 1.0 <= r["rollout/turns_mean"] <= 3.0
        assert r["rollout/tool_errors_frac"] == 0.0 and r["rollout/tool_timeout_frac"] == 0.0
        assert sum(r[f"rollout/finish_{k}_frac"] for k in ("stop", "env_done", "max_turns", "length")) == pytest.approx(1.0)
        assert r["timing/tool_s"] >= 0.0
        # The trainer's log-probs of the model's tokens equal vLLM's (tool tokens are masked out).
        assert r["rollout/mismatch_max"] < 1e-4
    assert any(r["rollout/tool_calls_mean"] > 0 for r in train)
    assert "multi-turn: 3 turns, 24 tokens per conversation, tools: none, environment" in runs["straight"]
    assert "tp=2 dp=1" in runs["straight"] and "Ulysses sequence parallel 2" in runs["straight"]
    val = [json.loads(line) for line in open(os.path.join(runs["a"], "val", f"step_{STEPS}.jsonl"))]
    assert val and all("conversation" in v and "tool_calls" in v for v in val)
    assert "val/tool_calls_mean" in rows[-1]


def test_kill9_and_preemption_then_resume_is_exact_with_multi_turn(runs):
    preempted = runs["preempted"]
    assert "step_2 at step 2" in preempted and rank_exit_codes(preempted) == {0: 75, 1: 75}, preempted[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: preempted at step 3 " in preempted, preempted[-3000:]
    assert os.path.isdir(os.path.join(runs["b"], "checkpoints", "step_3"))
    a_rows, b_rows = read_rows(runs["a"]), read_rows(runs["b"])
    assert [r["step"] for r in b_rows] == [1, 2, 3]  # step 3 written again after the resume, once
    for ra, rb in zip(a_rows, b_rows):
        assert comparable(ra) == comparable(rb), (ra["step"], comparable(ra), comparable(rb))
