"""A run directory per run: trainer.output_dir null differs between config files, and a checkpoint
stores its run's config so that checkpoint.resume=auto refuses one of a run configured differently
in what is trained (the end-to-end case is in tests/test_verl_e2e.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

pytestmark = pytest.mark.unit


def test_configs_that_leave_output_dir_unset_get_their_own(tmp_path):
    from rlcore.config.cli import parse_config

    a, b = tmp_path / "run_qwen2-7b.yaml", tmp_path / "run_qwen2-7b_math.yaml"
    for path in (a, b):
        path.write_text("trainer:\n  total_steps: 2\n")
    dirs = [parse_config(["--config", str(p)], "cpu").trainer.output_dir for p in (a, b)]
    assert dirs == [os.path.join("outputs", "run_qwen2-7b"), os.path.join("outputs", "run_qwen2-7b_math")]
    assert parse_config([f"--config={a}"], "cpu").trainer.output_dir == dirs[0]
    assert parse_config([], "cpu").trainer.output_dir == os.path.join("outputs", "run")
    assert parse_config(["--config", str(a), "--trainer.output_dir", "mine"], "cpu").trainer.output_dir == "mine"


def _checkpoint(tmp_path, cfg) -> str:
    from rlcore.run import run_config

    path = tmp_path / "out" / "checkpoints" / "step_2"
    path.mkdir(parents=True)
    for name, content in run_config.files(cfg).items():
        (path / name).write_text(json.dumps(content))
    return str(path)


def _config(**sections):
    from rlcore.config import Config, resolve

    cfg = Config()
    for name, values in sections.items():
        cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)})
    return resolve(cfg, "cpu")


def test_resume_auto_refuses_a_checkpoint_of_a_run_configured_differently(tmp_path):
    """Training keys that differ are named with both values; the length of the run, logging, paths,
    validation, checkpoints and engine sizes may differ; accept resumes on purpose; a checkpoint
    named by path is resumed as named; an old checkpoint without the file is resumed with a warning."""
    from rlcore.config import ConfigError
    from rlcore.run.run_config import check_resume

    first = _config(data={"train_files": ["gsm8k/train.parquet"]}, trainer={"total_steps": 2})
    path = _checkpoint(tmp_path, first)
    same = _config(data={"train_files": ["gsm8k/train.parquet"]}, trainer={"total_steps": 50, "output_dir": "x",
                                                                           "val_every": 5},
                   logging={"trackers": []}, checkpoint={"save_every": 3}, rollout={"kv_cache_gb": 3.0},
                   val={"n": 4}, offload={"params": True})
    assert check_resume(path, same) is None
    other = _config(data={"train_files": ["math/train.parquet"]}, optim={"lr": 2e-6}, trainer={"seed": 1})
    with pytest.raises(ConfigError) as err:
        check_resume(path, other)
    message = str(err.value)
    assert message.startswith(f"checkpoint.resume=auto found {path} in trainer.output_dir='outputs/run', but that run "
                              "was configured differently in 3 key(s) that change what is trained: data.train_files: "
                              '["gsm8k/train.parquet"] there, ["math/train.parquet"] now; optim.lr: 1e-06 there, 2e-06 '
                              "now; trainer.seed: 0 there, 1 now.")
    assert "checkpoint.resume_config_mismatch: accept" in message
    accepted = dataclasses.replace(other, checkpoint=dataclasses.replace(other.checkpoint, resume_config_mismatch="accept"))
    assert check_resume(path, accepted).startswith(f"checkpoint.resume: resuming {path}, written by a run configured "
                                                   "differently (data.train_files:")
    named = dataclasses.replace(other, checkpoint=dataclasses.replace(other.checkpoint, resume=path))
    assert check_resume(path, named).endswith("; resuming it as named")
    os.remove(os.path.join(path, "run_config.json"))
    assert check_resume(path, other).startswith(f"warning: checkpoint.resume: {path} stores no run_config.json")


def test_the_flag_takes_refuse_or_accept():
    from test_config_and_data import run_trainer

    proc = run_trainer("--checkpoint.resume_config_mismatch", "maybe", "--print_config")
    assert proc.returncode == 2 and "checkpoint.resume_config_mismatch" in proc.stderr, proc.stderr
    assert "'refuse', 'accept'" in proc.stderr and "Traceback" not in proc.stderr
