"""Exact resume on the real entry point (2 CPU ranks under torchrun), plus the checkpoint folder's
atomicity rules as unit tests.

Four launches share one module fixture (8 training prompts, 4 per step: an epoch is 2 steps):
  A   6 steps straight through, a checkpoint every 2 steps.
  B1  the same run with a checkpoint every 3 steps, killed with kill -9 (launcher and both workers)
      once step_3 is complete and step 4 has been logged (a row the resumed run must not duplicate);
  B2  relaunched with checkpoint.resume=auto (step_3 is mid-epoch: epoch 1, index 4) and preempted
      by SIGUSR1 during step 5's generation (RLCORE_TEST_SIGNAL_STEP): both ranks drop step 5,
      checkpoint step 4 (an epoch boundary: epoch 1 used up) and exit 75;
  B3  resumed by path (B's output folder, resolved to its newest checkpoint) to step 6, exporting HF
      folders every 2 steps in bfloat16.
Exactness means equal, not close: every metrics.jsonl value but wall-clock ones (timing/, memory/,
perf/), and every bit of the final model and optimizer state (DCP checkpoints of step 6).
The optimizer is anyprecision_adamw (bf16 state, Kahan summation), the seed recipe's.
A judge is in the loop (rlcore/judge: a tiny reward model on its own in-process vLLM engine, half
of the reward), and so is a distillation teacher (rlcore/distill: another tiny Qwen3 on a third
engine, its reverse-KL advantage beside the reward's), so resuming with model-based rewards and
with on-policy distillation is covered by the same launches.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time

import pytest
import torch

from conftest import REPO, run_torchrun
from workers.launch import (TRAIN, Launch, become_subreaper, checkpoint_events, comparable, dcp_state, preempt_at,
                            rank_exit_codes, read_rows, reap, same)

STEPS = 6
TRACE = ("--logging.switch_trace", "true")
ASLEEP = "phase training, vLLM released ['kv_cache', 'weights']"  # emulated level-2 sleep
PROBE = os.path.join(REPO, "tests", "workers", "trainer_probe.py")


def judge_args(rm: str, teacher: str) -> list[str]:
    judge = {"name": "high_digit", "path": rm, "kind": "discriminative", "activation": "sigmoid",
             "pass_threshold": 0.5, "template": "{{ response.split()[0] if response.split() else '?' }}",
             "max_model_len": 32, "kv_cache_gb": 0.0625}
    return ["--reward.models", json.dumps([judge]), "--reward.components", '{"first_word_match": 1.0, "high_digit": 0.5}',
            "--distill.teacher", teacher, "--distill.reward_weight", "1.0", "--distill.coef", "0.5",
            "--distill.kv_cache_gb", "0.0625"]


def args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--checkpoint.keep_last", "10",
            # state carried across steps must resume too: the adaptive entropy coefficient (a target
            # above any entropy here: it grows every step) and Clip-Cov's draws (the torch RNG)
            "--exploration.entropy_target", "50", "--exploration.entropy_coef_step", "0.01",
            "--exploration.clip_cov_ratio", "0.05", "--exploration.clip_cov_lb", "-100",
            # the seed recipe's optimizer (bf16 state and Kahan buffer; rlcore/engine/optim.py): its state
            # comes back bit-exact after kill -9 and preemption (AdamW's: test_partial, test_vl_e2e, ...)
            "--optim.optimizer", "anyprecision_adamw",
            "--rollout.emulate_sleep", "true", *extra]  # level 2 as on a GPU, judge included (rlcore/rollout/cpu_sleep.py)


@pytest.fixture(scope="module")
def runs(tiny_model, toy_data, tmp_path_factory):
    from rlcore import quiet
    from rlcore.demo.toy import DEMO_RM_PREFERRED, make_tiny_model, make_tiny_reward_model

    root = tmp_path_factory.mktemp("resume")
    with quiet.filtered_output():
        judge = judge_args(make_tiny_reward_model(str(root / "rm"), preferred=DEMO_RM_PREFERRED),
                           make_tiny_model(str(root / "teacher"), seed=1, num_layers=3))
    a, b = str(root / "a"), str(root / "b")
    data = os.path.join(a, "train8.jsonl")  # next to A's output: a later test resumes A
    os.makedirs(a)
    with open(toy_data[0]) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:8])
    # A runs through the probe: the same main, plus a report of any non-local network access.
    straight = run_torchrun(PROBE, 2, *args(tiny_model, data, a, "--checkpoint.save_every", "2", *TRACE, *judge))

    b_args = args(tiny_model, data, b, "--checkpoint.save_every", "3", "--checkpoint.resume", "auto", *judge)
    killed = Launch(2, b_args)
    become_subreaper()  # the orphaned ranks become this process's children: their exit codes
    try:
        killed.wait_for(r"saved checkpoint .*step_3$", timeout=600)
        killed.wait_for(r"^step +4/", timeout=300)  # step 4 logged, not checkpointed: its row must go
        ranks = list(killed.worker_pids().values())
        os.killpg(killed.proc.pid, signal.SIGKILL)  # torchrun's group only: the ranks are in sessions of their own
        killed_at = time.monotonic()
        killed.proc.wait()
        rows_at_kill = [r["step"] for r in read_rows(b)]
        orphans = reap(ranks, timeout=20)  # rlcore/run/ownership.py: each rank ends when its launcher does
        orphans_gone_s = time.monotonic() - killed_at
        time.sleep(1.0)
        rows_after_kill = [r["step"] for r in read_rows(b)]
    finally:
        killed.close()
        become_subreaper(False)
    preempted = preempt_at(2, b_args, 5)
    finished = run_torchrun(TRAIN, 2, *args(tiny_model, data, b, "--checkpoint.save_every", "3",
                                            "--checkpoint.resume", b, "--checkpoint.hf_every", "2",
                                            "--checkpoint.hf_dtype", "bfloat16", *TRACE, *judge))
    return {"a": a, "b": b, "rows_at_kill": rows_at_kill, "rows_after_kill": rows_after_kill, "ranks": ranks,
            "orphans": orphans, "orphans_gone_s": orphans_gone_s, "preempted_out": preempted,
            "straight_out": straight.stdout + straight.stderr, "finished_out": finished.stdout,
            "finished_err": finished.stderr, "model": tiny_model}


def weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def trainer_state(ckpt: str) -> dict:
    return torch.load(os.path.join(ckpt, "extra_state", "extra_state_rank_0.pt"), weights_only=True)["user"]["trainer"]


def test_kill9_and_preemption_then_resume_is_exact(runs, tmp_path):
    a_rows, b_rows = read_rows(runs["a"]), read_rows(runs["b"])
    print(f"killed run had written rows for steps {runs['rows_at_kill']} when killed; its ranks ended "
          f"{runs['orphans_gone_s']:.2f} s after the launcher, codes {runs['orphans']}")
    assert runs["rows_at_kill"][:4] == [1, 2, 3, 4]
    # kill -9 of torchrun's process group alone: both ranks ended on their own (Exit.ORPHANED, or
    # killed at the watcher's own deadline) and wrote nothing after
    assert sorted(runs["orphans"]) == sorted(runs["ranks"]) and len(runs["ranks"]) == 2, runs["orphans"]
    assert set(runs["orphans"].values()) <= {77, -9} and runs["orphans_gone_s"] < 15, runs["orphans"]
    assert runs["rows_after_kill"] == runs["rows_at_kill"]
    preempted = runs["preempted_out"]
    assert "resumed from" in preempted and "step_3 at step 3" in preempted, preempted[-3000:]
    assert rank_exit_codes(preempted) == {0: 75, 1: 75}, preempted[-3000:]
    for rank in (0, 1):  # the signal hit step 5's generation: the step was dropped, step 4 saved
        assert f"rank {rank}: preempted at step 4 " in preempted, preempted[-3000:]
    assert "step_4 at step 4" in runs["finished_out"], runs["finished_out"][-3000:]
    # Rows the killed run wrote after step_3 were dropped on resume and written again: each step once.
    assert [r["step"] for r in b_rows] == list(range(1, STEPS + 1))
    for ra, rb in zip(a_rows, b_rows):
        assert comparable(ra) == comparable(rb), (ra["step"], comparable(ra), comparable(rb))
    assert any(r["actor/grad_norm"] > 0 for r in a_rows[3:])  # steps 4-6 really trained
    assert [r["actor/entropy_coef"] for r in b_rows] == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04, 0.05])
    # the judge scored every step: half the reward, its KV cache held only while it scored
    assert all(r["reward/mean"] == pytest.approx(r["reward/first_word_match"] + 0.5 * r["reward/high_digit"], abs=1e-6)
               and r["reward/high_digit_parse_fail_frac"] == 0 and r["timing/judge_s"] > 0 for r in b_rows)
    # (the judge's then the teacher's wake-up write this key: the teacher's last, its 0.0625 GiB less a
    # part block)
    assert all(r["memory/wake_judges_judge_kv_gb"] == pytest.approx(0.0625, abs=1e-4)
               and r["memory/train_judge_kv_gb"] == 0.0 for r in a_rows)
    # the teacher scored every step (its metrics resumed exactly above), awake only while it scored
    assert all(r["distill/reverse_kl"] > 0 and r["timing/teacher_s"] > 0 and r["memory/teacher_judge_kv_gb"] == pytest.approx(0.0625, abs=1e-4)
               for r in b_rows)
    assert all(r["actor/clip_cov_frac"] > 0 for r in b_rows)
    sa = dcp_state(os.path.join(runs["a"], "checkpoints", "step_6"), tmp_path)
    sb = dcp_state(os.path.join(runs["b"], "checkpoints", "step_6"), tmp_path)
    assert sa["model"].keys() == sb["model"].keys() and len(sa["model"]) == 25
    assert same(sa["model"], sb["model"]) and same(sa["optimizer"], sb["optimizer"])


def test_every_checkpoint_save_and_load_happens_with_vllm_released(runs):
    """The phase machine's record (logging.switch_trace) of A's saves and of B3's load and save: each
    in the train phase with the policy engine's weights and KV cache released (emulated level-2
    sleep; the judge and the teacher sleep outside scoring, see the memory metrics above), so the
    trainer state a save brings to the device never meets vLLM's (docs/memory_plan.md, checkpoint
    column). The loop used to save after the weight sync, with vLLM awake."""
    for rank in (0, 1):
        assert checkpoint_events(runs["straight_out"], rank) == [f"save step_{s}: {ASLEEP}" for s in (2, 4, 6)], \
            runs["straight_out"][-3000:]
        assert checkpoint_events(runs["finished_err"], rank) == [f"load step_4: {ASLEEP}", f"save step_6: {ASLEEP}"], \
            runs["finished_err"][-3000:]


def test_resume_follows_the_new_lr_schedule(runs, tmp_path):
    """Resuming A's step-4 checkpoint with another lr and schedule: the run continues at optimizer
    step 4 under the new settings (not the checkpoint's) and says so."""
    out = str(tmp_path / "relr")
    proc = run_torchrun(TRAIN, 2, *args(runs["model"], os.path.join(runs["a"], "train8.jsonl"), out,
                                        "--checkpoint.resume", os.path.join(runs["a"], "checkpoints", "step_4"),
                                        "--optim.lr", "2e-3", "--optim.lr_schedule", "cosine",
                                        "--checkpoint.save_hf_final", "false"))
    assert "lr [0.001] -> [0.002]" in proc.stdout and "lr_schedule constant -> cosine" in proc.stdout, proc.stdout
    lrs = {r["step"]: r["actor/lr"] for r in read_rows(out)}
    # one optimizer step per trainer step; cosine to 0 over 6: lr(k) = 2e-3 * (1 + cos(pi k / 6)) / 2
    assert lrs[5] == pytest.approx(2e-3 * 0.25, rel=1e-9) and lrs[6] == pytest.approx(1e-3 * (1 - 3 ** 0.5 / 2), rel=1e-9)


def test_resumes_covered_mid_epoch_and_epoch_boundary(runs):
    ckpts = os.path.join(runs["b"], "checkpoints")
    assert trainer_state(os.path.join(ckpts, "step_3"))["data"] == {"epoch": 1, "index": 4, "seed": 0}
    assert trainer_state(os.path.join(ckpts, "step_4"))["data"] == {"epoch": 1, "index": 8, "seed": 0}
    # the coefficient used by step 5 (0.01 a step from 0) and dynamic sampling's estimate (off: the prior)
    assert trainer_state(os.path.join(ckpts, "step_4"))["exploration"] == {"entropy_coef": pytest.approx(0.04)}
    assert trainer_state(os.path.join(ckpts, "step_4"))["sampling"] == {"keep_rate": 0.5}


def test_hf_exports_bf16_match_and_load_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    hf_root = os.path.join(runs["b"], "hf")
    assert sorted(os.listdir(hf_root)) == ["step_6"]  # B3 ran steps 5-6 with hf_every 2
    folder = os.path.join(hf_root, "step_6")
    assert json.load(open(os.path.join(folder, "config.json")))["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert next(model.parameters()).dtype == torch.bfloat16
    # bf16 export of B == A's fp32 export rounded to bf16, bit for bit; and it is not the base model.
    wa, wb = weights(os.path.join(runs["a"], "hf_final")), weights(os.path.join(runs["b"], "hf_final"))
    assert wa.keys() == wb.keys() == weights(folder).keys()
    for name in wa:
        assert wa[name].dtype == torch.float32 and wb[name].dtype == torch.bfloat16
        assert torch.equal(wa[name].to(torch.bfloat16), wb[name]), name
    base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32).state_dict()
    assert max((wa[k] - base[k]).abs().max().item() for k in wa) > 0


def test_no_network_access_at_run_time(runs):
    """Run A (build, 6 steps, checkpoints, HF export) made no Python-level attempt to reach a
    non-local address on either rank: no hub lookups, no telemetry (audit hooks in the probe)."""
    out = runs["straight_out"]
    for rank in (0, 1):
        assert f"probe: rank {rank} exit 0 engines_imported=['veomni', 'vllm'] remote_network=[]" in out, \
            [line for line in out.splitlines() if line.startswith("probe:")]


# ---------------------------------------------------------------------------------------------
# The checkpoint folder's rules, without a model (fake DCP folders)
# ---------------------------------------------------------------------------------------------


def fake_checkpoint(root, name, step=1, world=2):
    path = os.path.join(root, name)
    os.makedirs(os.path.join(path, "extra_state"))
    from torch.distributed.checkpoint.metadata import Metadata

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}), f)
    for r in range(world):
        torch.save({"user": {"trainer": {"step": step}}}, os.path.join(path, "extra_state", f"extra_state_rank_{r}.pt"))
    json.dump({"step": step, "world_size": world}, open(os.path.join(path, "meta.json"), "w"))
    return path


@pytest.mark.unit
def test_half_written_checkpoints_are_never_chosen(tmp_path):
    from rlcore.config import ConfigError
    from rlcore.run import checkpoint

    out = str(tmp_path)
    root = checkpoint.checkpoint_root(out)
    os.makedirs(root)
    assert checkpoint.find_resume(out, "auto") is None  # nothing yet: start fresh
    s2 = fake_checkpoint(root, "step_2", 2)
    fake_checkpoint(root, ".tmp-step_3", 3)  # killed during the save: never renamed
    os.makedirs(os.path.join(root, "step_4"))  # a folder without DCP metadata (damaged)
    assert checkpoint.find_resume(out, "auto") == s2  # no latest pointer yet: newest complete step
    checkpoint._write_latest(root, "step_2")
    assert checkpoint.find_resume(out, "auto") == s2
    assert checkpoint.find_resume(out, "never") is None
    assert checkpoint.find_resume(out, out) == s2  # an output_dir resolves to its newest checkpoint
    with pytest.raises(ConfigError, match="step_4' is incomplete: .metadata is missing; extra_state is missing"):
        checkpoint.find_resume(out, os.path.join(root, "step_4"))
    s1 = fake_checkpoint(root, "step_1", 1)
    fake_checkpoint(root, "step_9", 9)  # past latest: another timeline, not ours to delete
    checkpoint._prune(root, keep_last=1)
    # Leftovers and superseded checkpoints go; latest, the damaged folder and step_9 stay.
    assert sorted(os.listdir(root)) == ["latest", "step_2", "step_4", "step_9"]
    assert not os.path.exists(s1)


@pytest.mark.unit
def test_resume_checks_world_size_and_refuses_foreign_pickles(tmp_path):
    from rlcore.config import ConfigError
    from rlcore.run import checkpoint

    path = fake_checkpoint(str(tmp_path), "step_5", 5, world=2)
    checkpoint.validate_resume(path, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="written by 2 ranks but this run has 4"):
        checkpoint.validate_resume(path, rank=3, world_size=4)
    # Pickles that would run code on load are refused before VeOmni or DCP unpickle them.
    metadata = open(os.path.join(path, ".metadata"), "rb").read()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"x": os.system}, f)
    with pytest.raises(ConfigError, match="posix.system is not part of DCP metadata"):
        checkpoint.validate_resume(path, rank=1, world_size=2)
    open(os.path.join(path, ".metadata"), "wb").write(metadata)
    torch.save({"user": {"trainer": {"step": 5}}, "evil": os.system}, os.path.join(path, "extra_state", "extra_state_rank_1.pt"))
    with pytest.raises(ConfigError, match="refusing to unpickle"):
        checkpoint.validate_resume(path, rank=1, world_size=2)


@pytest.mark.unit
def test_missing_and_truncated_files_are_named_and_auto_falls_back(tmp_path):
    """The manifest written last by a save lists every file's size: a removed file and a truncated
    one each get their own message (step and file), distinct from the unsafe-pickle refusal, and
    resume=auto takes the newest complete checkpoint, saying which it skipped."""
    from rlcore.config import ConfigError
    from rlcore.run import checkpoint

    out = str(tmp_path)
    root = checkpoint.checkpoint_root(out)
    for step in (2, 4, 6):
        checkpoint._write_manifest(fake_checkpoint(root, f"step_{step}", step))
    checkpoint._write_latest(root, "step_6")
    os.remove(os.path.join(root, "step_6", "extra_state", "extra_state_rank_1.pt"))
    rank0 = os.path.join(root, "step_4", "extra_state", "extra_state_rank_0.pt")
    size = os.path.getsize(rank0)
    with open(rank0, "r+b") as f:
        f.truncate(size // 2)
    assert checkpoint.problems(os.path.join(root, "step_6")) == ["extra_state/extra_state_rank_1.pt is missing"]
    assert checkpoint.problems(os.path.join(root, "step_4")) == [
        f"extra_state/extra_state_rank_0.pt is truncated ({size // 2} of {size} bytes)"]
    said = []
    assert checkpoint.find_resume(out, "auto", report=said.append) == os.path.join(root, "step_2")
    assert said == ["checkpoint.resume: skipping incomplete step_6 (extra_state/extra_state_rank_1.pt is missing); "
                    f"step_4 (extra_state/extra_state_rank_0.pt is truncated ({size // 2} of {size} bytes)); "
                    "resuming from step_2"]
    with pytest.raises(ConfigError, match=r"step_6' is incomplete: extra_state/extra_state_rank_1.pt is missing"):
        checkpoint.find_resume(out, os.path.join(root, "step_6"))
    with pytest.raises(ConfigError, match=r"step_4' is incomplete: extra_state/extra_state_rank_0.pt is truncated"):
        checkpoint.find_resume(out, os.path.join(root, "step_4"))
    # A checkpoint from before manifests: the unpickling step tells missing and cut files from unsafe ones.
    old = fake_checkpoint(str(tmp_path / "old"), "step_3", 3)
    os.remove(os.path.join(old, "meta.json"))
    with open(os.path.join(old, ".metadata"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"step_3 is damaged: .*\.metadata cannot be read") as err:
        checkpoint.validate_resume(old, rank=0, world_size=2)
    assert "refusing to unpickle" not in str(err.value)
    os.remove(os.path.join(old, "extra_state", "extra_state_rank_1.pt"))
    with pytest.raises(ConfigError, match="has no state for rank 1"):
        checkpoint.validate_resume(old, rank=1, world_size=2)
    with pytest.raises(ConfigError, match=r"step_3 is incomplete: .*rng_rank0.pt is missing"):
        checkpoint._refuse(os.path.join(old, "rng_rank0.pt"), FileNotFoundError(2, "No such file"))


@pytest.mark.unit
def test_rng_state_roundtrips_without_pickle(tmp_path):
    import random

    import numpy as np

    from rlcore.run import checkpoint

    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    torch.rand(3), random.random(), np.random.rand(), np.random.randn()  # noqa: B018  (advance every stream)
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    expect = (torch.rand(4), random.random(), np.random.rand(2), np.random.randn())
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(4), random.random(), np.random.rand(2), np.random.randn())
    assert torch.equal(expect[0], got[0]) and expect[1] == got[1]
    assert np.array_equal(expect[2], got[2]) and expect[3] == got[3]


@pytest.mark.unit
def test_trim_metrics_drops_rows_after_the_checkpoint(tmp_path):
    from rlcore.run import checkpoint

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3, 4, 5)]
    path.write_text("\n".join(rows) + "\n" + '{"step": 6, "x"')  # torn last line of a killed run
    with open(path, "a") as handle:  # the logger's append handle stays valid across the trim
        assert checkpoint.trim_metrics(str(tmp_path), 3) == 3
        handle.write(json.dumps({"step": 4, "x": 40}) + "\n")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 3}, {"step": 4, "x": 40}]


@pytest.mark.unit
def test_accelerator_rng_state_is_saved_and_restored(monkeypatch, tmp_path):
    """The NPU generator (torch_npu's torch.npu) is checkpointed like CUDA's: without it a resumed
    Ascend run drew other dropout masks and sampling noise than an uninterrupted one. The device
    module here is a stand-in with torch.npu's RNG API (no Ascend on this machine)."""
    from rlcore.run import checkpoint

    class DeviceRng:
        def __init__(self, state):
            self.state = state

        def is_available(self):
            return True

        def is_initialized(self):
            return True

        def get_rng_state(self):
            return self.state.clone()

        def set_rng_state(self, state):
            self.state = state.clone()

    npu = DeviceRng(torch.tensor([7, 7, 7], dtype=torch.uint8))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    saved = checkpoint.rng_state()
    assert torch.equal(saved["npu"], torch.tensor([7, 7, 7], dtype=torch.uint8))
    torch.save(saved, tmp_path / "rng.pt")
    npu.state = torch.tensor([1, 2, 3], dtype=torch.uint8)  # the run went on
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(npu.state, torch.tensor([7, 7, 7], dtype=torch.uint8))
