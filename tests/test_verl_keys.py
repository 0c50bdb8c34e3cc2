"""Three keys verl users expect (docs/from_verl.md): trainer.total_epochs, checkpoint.save_every=-1 and
data.truncation=left/right/middle. Each does what verl's does, with the differences the keys' help
texts name. All in-process: the arithmetic and decisions directly, the start-up path through the
calls train_grpo.py makes before any engine (parse_config, then preflight) on a tiny data file."""

from __future__ import annotations

import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit


def start_up(argv: list[str], world_size: int = 2):
    """parse_config then preflight (what train_grpo.main does up to the first engine): the config the
    run goes on with and preflight's return, or the SystemExit code."""
    import train_grpo
    from rlcore.run.ownership import release_output_dirs

    try:
        cfg = train_grpo.parse_config(argv)
        return cfg, train_grpo.preflight(cfg, 0, world_size)
    except SystemExit as e:
        return e.code, None
    finally:
        release_output_dirs()


@pytest.fixture
def base(tiny_model, toy_data, tmp_path):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
            "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]",
            "--trainer.output_dir", str(tmp_path / "out")]


@pytest.fixture
def tiny_file(toy_data, tmp_path) -> str:
    """10 toy rows (prompts of 6 tokens)."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(open(toy_data[0]).read().splitlines()[:10]) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- trainer.total_epochs

@pytest.mark.parametrize("epochs,prompts,per_step,steps,verl", [
    (1, 200, 32, 7, 6),  # 200 = 6 x 32 + 8: verl drops the 8, here step 7 takes them and 24 of epoch 2
    (3, 200, 32, 19, 18),  # 600 prompts drawn = 18.75 steps
    (2, 64, 32, 4, 4),  # prompts_per_step divides the prompts: verl's count exactly
    (1, 3, 8, 1, 0),  # fewer prompts than a step: verl would run 0 steps
    (3, 10, 4, 8, 6),
])
def test_epochs_to_steps_arithmetic(epochs, prompts, per_step, steps, verl):
    from rlcore.run.preflight import epochs_to_steps

    assert epochs_to_steps(epochs, prompts, per_step) == steps
    assert epochs * (prompts // per_step) == verl  # verl's count, for comparison
    assert steps == verl or prompts % per_step  # they differ only where a partial batch exists


@pytest.mark.parametrize("epochs,prompts,per_step", [(1, 200, 32), (3, 200, 32), (2, 64, 32), (3, 10, 4), (1, 3, 8)])
def test_epochs_draw_every_prompt_that_many_times(epochs, prompts, per_step):
    """total_steps steps of the real PromptSampler draw every prompt ``epochs`` times, plus fewer
    than prompts_per_step of one more epoch; one step fewer would leave some prompt short."""
    from rlcore.run.preflight import epochs_to_steps
    from rlcore.task.prompts import Prompt, PromptSampler

    data = [Prompt(ids=[i], text=str(i), answer="") for i in range(prompts)]
    steps = epochs_to_steps(epochs, prompts, per_step)
    sampler = PromptSampler(data, seed=7)
    drawn = Counter(p.text for _ in range(steps) for p in sampler.next_batch(per_step))
    assert min(drawn.values()) >= epochs and len(drawn) == prompts
    assert sum(drawn.values()) - epochs * prompts < per_step
    fewer = PromptSampler(data, seed=7)
    short = Counter(p.text for _ in range(steps - 1) for p in fewer.next_batch(per_step))
    assert steps == 1 or min(short.get(str(i), 0) for i in range(prompts)) < epochs


def test_resolve_total_steps_fills_in_agrees_or_refuses():
    from rlcore.config import Config, ConfigError, TrainerConfig
    from rlcore.run.preflight import resolve_total_steps

    cfg = Config(trainer=TrainerConfig(total_epochs=2, prompts_per_step=4))
    assert resolve_total_steps(cfg, 10) == "trainer.total_epochs 2 -> total_steps 5 (10 prompts, 4 per step)"
    assert cfg.trainer.total_steps == 5
    cfg = Config(trainer=TrainerConfig(total_epochs=1, prompts_per_step=4))
    line = resolve_total_steps(cfg, 10)
    assert line.startswith("trainer.total_epochs 1 -> total_steps 3 (10 prompts, 4 per step)")
    assert "the last step draws 2 prompts of one more epoch" in line
    agree = Config(trainer=TrainerConfig(total_epochs=2, total_steps=5, prompts_per_step=4))
    assert resolve_total_steps(agree, 10) is not None and agree.trainer.total_steps == 5
    with pytest.raises(ConfigError, match=r"trainer.total_steps=6 is invalid: trainer.total_epochs=2 over the 10 "
                                          r"training prompts at trainer.prompts_per_step=4 is 5 steps; set one"):
        resolve_total_steps(Config(trainer=TrainerConfig(total_epochs=2, total_steps=6, prompts_per_step=4)), 10)
    steps_only = Config(trainer=TrainerConfig(total_steps=6))
    assert resolve_total_steps(steps_only, 10) is None and steps_only.trainer.total_steps == 6


def test_total_steps_defaults_to_10_unless_epochs_are_set():
    from rlcore.config import Config, ConfigError, TrainerConfig, resolve

    assert resolve(Config(), "cpu").trainer.total_steps == 10
    assert resolve(Config(trainer=TrainerConfig(total_steps=3)), "cpu").trainer.total_steps == 3
    assert resolve(Config(trainer=TrainerConfig(total_epochs=2)), "cpu").trainer.total_steps is None  # preflight's
    with pytest.raises(ConfigError, match="trainer.total_epochs=0 is invalid: it must be > 0"):
        TrainerConfig(total_epochs=0)


def test_preflight_resolves_total_epochs_on_a_tiny_file(base, tiny_file, capsys):
    """10 prompts, 4 per step (2 ranks), 3 epochs -> 8 steps, on the Config the engines are built from;
    the final validation and the last checkpoint follow it."""
    import train_grpo
    from rlcore.config import TrainerConfig
    from rlcore.run.lifecycle import checkpoint_due

    cfg, out = start_up(base + ["--data.train_files", json.dumps([tiny_file]), "--trainer.total_steps", "null",
                                "--trainer.total_epochs", "3", "--trainer.prompts_per_step", "4"])
    assert out is not None, capsys.readouterr().err
    assert len(out[2]) == 10 and cfg.trainer.total_steps == 8
    assert "trainer.total_epochs 3 -> total_steps 8 (10 prompts, 4 per step)" in capsys.readouterr().out
    assert train_grpo.val_due(TrainerConfig(val_every=5, total_steps=cfg.trainer.total_steps), 8)  # the last step
    assert checkpoint_due(8, cfg.trainer.total_steps, cfg.checkpoint.save_every)


def test_preflight_counts_prompts_after_filtering(base, toy_data, tmp_path, capsys):
    """The prompts data.truncation=filter drops do not count: 4 short rows + 6 over the limit."""
    rows = [json.loads(line) for line in open(toy_data[0]).read().splitlines()[:10]]
    for r in rows[4:]:
        r["prompt"] = r["prompt"] + " " + r["prompt"]  # 12 tokens
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, out = start_up(base + ["--data.train_files", json.dumps([str(path)]), "--data.max_prompt_length", "8",
                                "--trainer.total_steps", "null", "--trainer.total_epochs", "2",
                                "--trainer.prompts_per_step", "4"])
    assert out is not None, capsys.readouterr().err
    assert cfg.trainer.total_steps == 2  # 2 x 4 prompts / 4
    assert "trainer.total_epochs 2 -> total_steps 2 (4 prompts, 4 per step)" in capsys.readouterr().out


def test_preflight_refuses_epochs_and_steps_that_disagree(base, capsys):
    code, _ = start_up(base + ["--trainer.total_epochs", "1"])  # demo_cpu.yaml sets total_steps: 100
    err = capsys.readouterr().err
    assert code == 2
    assert ("trainer.total_steps=100 is invalid: trainer.total_epochs=1 over the 200 training prompts at "
            "trainer.prompts_per_step=32 is 7 steps; set one of the two to null") in err


# ----------------------------------------------------------------------------- checkpoint.save_every=-1

@pytest.mark.parametrize("save_every,due", [
    (0, [5]),  # only the last step
    (2, [2, 4, 5]),  # every 2 and the last
    (-1, []),  # never: verl's save_freq=-1
])
def test_checkpoint_due(save_every, due):
    from rlcore.run.lifecycle import checkpoint_due

    assert [s for s in range(1, 6) if checkpoint_due(s, 5, save_every)] == due


def fake_run(tmp_path, save_every: int, save_hf_final: bool, total_steps: int = 3):
    from rlcore.config import CheckpointConfig, Config, TrainerConfig

    cfg = Config(checkpoint=CheckpointConfig(save_every=save_every, save_hf_final=save_hf_final),
                 trainer=TrainerConfig(total_steps=total_steps, output_dir=str(tmp_path / "out")))
    calls = []
    switch = SimpleNamespace(record_checkpoint=lambda what: calls.append(("record", what)), phase="training",
                             to_training=lambda: None)
    return SimpleNamespace(
        cfg=cfg, info=SimpleNamespace(rank=0, is_main=True, world_size=1),
        engines=SimpleNamespace(policy=object(), switch=switch, rollout=SimpleNamespace(shutdown=lambda **k: None)),
        state=SimpleNamespace(step=0, saved_step=-1, skips_total=0, skips_consecutive=0, skipped_saves=[]),
        resume_from=None,
        sampler=SimpleNamespace(prompts=SimpleNamespace(state_dict=lambda: {}, prompts=[]), state_dict=lambda: {}),
        entropy=None, calls=calls)


@pytest.fixture
def recorded(monkeypatch):
    """checkpoint.write / save / export_hf replaced by recorders (nothing reaches the disk)."""
    from rlcore.run import checkpoint

    calls = []
    monkeypatch.setattr(checkpoint, "write", lambda policy, out, step, *a, **k: calls.append(("write", step)))
    monkeypatch.setattr(checkpoint, "save", lambda policy, out, step, *a, **k: calls.append(("save", step)))
    monkeypatch.setattr(checkpoint, "export_hf", lambda policy, path, *a, **k: calls.append(
        ("export_hf", os.path.basename(path))))
    return calls


@pytest.mark.parametrize("save_hf_final", [False, True])
def test_save_every_minus_one_writes_no_checkpoint(tmp_path, recorded, save_hf_final):
    from rlcore.run.lifecycle import commit_checkpoint, write_due_checkpoint

    run = fake_run(tmp_path, -1, save_hf_final)
    for step in range(1, 4):
        run.state.step = step
        pending = write_due_checkpoint(run)
        assert pending is None
        commit_checkpoint(run, pending)
    # hf_final is an export (a model, no optimizer or data position), not a checkpoint: its own key
    assert recorded == ([("export_hf", "hf_final")] if save_hf_final else [])
    assert run.state.saved_step == -1 and not os.path.exists(run.cfg.trainer.output_dir)


def test_save_every_zero_still_saves_the_last_step(tmp_path, recorded):
    from rlcore.run.lifecycle import write_due_checkpoint

    run = fake_run(tmp_path, 0, False)
    pending = []
    for step in range(1, 4):
        run.state.step = step
        pending.append(write_due_checkpoint(run))
    assert pending == [None, None, 3] and recorded == [("write", 3)]


def test_save_every_minus_one_preempted_saves_nothing(tmp_path, recorded, monkeypatch, capsys):
    from contextlib import nullcontext

    from rlcore.errors import Exit
    from rlcore.run import lifecycle

    run = fake_run(tmp_path, -1, True, total_steps=10)
    run.state.step = 4
    run.watchdog = SimpleNamespace(phase=lambda name: nullcontext(), close=lambda: None)
    run.stop = SimpleNamespace(cancel_deadline=lambda: None, seconds_since_signal=lambda: 0.5)
    run.logger = SimpleNamespace(close=lambda: None)
    exits = []
    monkeypatch.setattr(lifecycle, "exit_process", lambda code, run_atexit=True: exits.append(code))
    lifecycle.stop_preempted(run, None)
    assert recorded == [] and exits == [Exit.PREEMPTED]
    assert "nothing saved (checkpoint.save_every=-1)" in capsys.readouterr().err


def test_save_every_minus_one_diverged_saves_nothing(tmp_path, recorded, monkeypatch, capsys):
    from rlcore.run import lifecycle

    run = fake_run(tmp_path, -1, True, total_steps=10)
    run.state.step, run.state.skips_consecutive = 6, run.cfg.trainer.max_consecutive_skips
    monkeypatch.setattr(lifecycle, "teardown", lambda r: None)
    with pytest.raises(SystemExit) as e:
        lifecycle.stop_if_diverged(run)
    assert e.value.code == 3 and recorded == []
    assert "No checkpoint was written (checkpoint.save_every=-1)" in capsys.readouterr().err


def test_save_every_minus_one_is_said_at_start_up(base, capsys):
    cfg, out = start_up(base + ["--checkpoint.save_every", "-1"])
    assert out is not None, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "checkpoint.save_every=-1: this run writes no checkpoint" in printed
    assert "checkpoint.save_hf_final=true still exports" in printed  # the export keeps its own meaning
    from rlcore.errors import ConfigError
    from rlcore.config import CheckpointConfig

    with pytest.raises(ConfigError, match=r"checkpoint.save_every=-2 is invalid: .* or -1 \(never save\)"):
        CheckpointConfig(save_every=-2)


# ----------------------------------------------------------------------------- data.truncation

@pytest.mark.parametrize("mode,max_len,kept", [
    ("left", 4, [6, 7, 8, 9]),  # the last max_len (verl: ids[-max_len:])
    ("right", 4, [0, 1, 2, 3]),  # the first max_len (verl: ids[:max_len])
    ("middle", 4, [0, 1, 8, 9]),  # max_len // 2 first + the rest last (verl: ids[:h] + ids[-(max_len - h):])
    ("middle", 5, [0, 1, 7, 8, 9]),
    ("middle", 1, [9]),
    ("left", 10, list(range(10))),  # not over the limit: unchanged
])
def test_truncate_ids(mode, max_len, kept):
    from rlcore.task.prompts import truncate_ids

    assert truncate_ids(list(range(10)), max_len, mode) == kept


def _verl_cut(ids, max_len, mode):
    """verl 0.9 RLHFDataset's raw_prompt_ids cut, written out for comparison."""
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    left_half = max_len // 2
    return ids[:left_half] + ids[-(max_len - left_half):]


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_matches_verl_on_every_length(mode):
    from rlcore.task.prompts import truncate_ids

    for n in range(1, 12):
        ids = [100 + i for i in range(n)]
        for max_len in range(1, n):
            assert truncate_ids(ids, max_len, mode) == _verl_cut(ids, max_len, mode)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_long_prompts_are_cut_and_counted(tiny_model, toy_data, tmp_path, mode):
    from transformers import AutoTokenizer

    from rlcore.config import DataConfig
    from rlcore.task.prompts import load_prompts, truncate_ids

    rows = [json.loads(line) for line in open(toy_data[0]).read().splitlines()[:10]]
    for r in rows[4:]:
        r["prompt"] = r["prompt"] + " " + r["prompt"]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    full = [tok(r["prompt"])["input_ids"] for r in rows]
    assert [len(ids) > 8 for ids in full] == [False] * 4 + [True] * 6
    prompts, stats = load_prompts([str(path)], DataConfig(max_prompt_length=8, truncation=mode), tok)
    assert stats == {"data/bad_rows": 0, "data/filtered_too_long": 0, "data/prompts": 10,
                     "data/truncated_too_long": 6}
    assert [p.ids for p in prompts] == [truncate_ids(ids, 8, mode) for ids in full]
    assert prompts[0].text == rows[0]["prompt"] and prompts[5].text == tok.decode(prompts[5].ids)
    _, filtered = load_prompts([str(path)], DataConfig(max_prompt_length=8), tok)
    assert filtered["data/filtered_too_long"] == stats["data/truncated_too_long"]  # the same prompts, counted alike


def test_truncated_count_is_printed_like_the_filtered_one(base, capsys):
    cfg, out = start_up(base + ["--data.max_prompt_length", "5", "--data.truncation", "left"])
    assert out is not None, capsys.readouterr().err
    assert all(len(p.ids) == 5 for p in out[2])
    assert ("train data: 200 prompts (0 bad rows skipped, 200 over data.max_prompt_length truncated, "
            "data.truncation=left)") in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_cutting_image_prompts_is_refused(mode):
    from rlcore.config import ConfigError, DataConfig

    with pytest.raises(ConfigError, match=rf"data.truncation='{mode}' is invalid: with data.image_key='images' a "
                                          r"cut could remove image placeholder tokens.*set data.truncation: filter"):
        DataConfig(image_key="images", truncation=mode)
    DataConfig(image_key="images", truncation="filter")  # filter and error stay allowed
    DataConfig(image_key="images", truncation="error")
