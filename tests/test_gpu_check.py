"""scripts/gpu_check.sh and its verdict (scripts/gpu_check_report.py), on a machine without a GPU:
the script refuses clearly, and the report passes or fails synthetic metrics.jsonl files for the
right reasons. The check itself (3 GRPO steps on 1-2 GPUs) needs a GPU and is not run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")
REPORT = os.path.join(REPO, "scripts", "gpu_check_report.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_check_report  # noqa: E402


def bare_path(tmp_path, **fakes) -> str:
    """A PATH with the basic tools only (no nvidia-smi / npu-smi of the test machine) plus stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "env", "cat", "id"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def run_check(env: dict, tmp_path) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", SCRIPT], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.unit
def test_gpu_check_refuses_without_an_accelerator(tmp_path):
    proc = run_check({"PATH": bare_path(tmp_path)}, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no NVIDIA GPU (nvidia-smi is not on PATH)" in proc.stderr and "DEVICE=npu" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()  # refused before building anything
    proc = run_check({"PATH": str(tmp_path / "bin"), "DEVICE": "npu"}, tmp_path)
    assert proc.returncode == 2 and "no Ascend NPU (npu-smi is not on PATH)" in proc.stderr, proc.stderr
    proc = run_check({"PATH": str(tmp_path / "bin"), "DEVICE": "tpu"}, tmp_path)
    assert proc.returncode == 2 and "DEVICE=tpu" in proc.stderr


@pytest.mark.unit
def test_gpu_check_refuses_when_torch_sees_no_gpu(tmp_path):
    """nvidia-smi is there (a stand-in) but torch.cuda.is_available() is False (this CPU build)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    path = bare_path(tmp_path, **{"nvidia-smi": "#!/bin/bash\necho 'GPU 0: NVIDIA H100'\n"})
    proc = run_check({"PATH": path, "PYTHON": sys.executable}, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch.cuda.is_available() is False" in proc.stderr and "requirements-cuda.txt" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_check({"PATH": path, "PYTHON": str(tmp_path / "missing" / "python")}, tmp_path)
    assert proc.returncode == 2 and "no Python at" in proc.stderr


@pytest.mark.unit
def test_gpu_check_overrides_are_valid_trainer_config(tmp_path):
    """The check's train_grpo.py arguments parse against the current config (PRINT_CONFIG=1 skips
    the device checks), and they select the accelerator path the check is for."""
    import yaml

    for device in ("cuda", "npu"):
        proc = run_check({"PRINT_CONFIG": "1", "DEVICE": device, "PYTHON": sys.executable, "NPROC": "2"}, tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        cfg = yaml.safe_load(proc.stdout)
        assert cfg["parallel"]["device"] == device and cfg["model"]["dtype"] == "bfloat16"
        assert cfg["offload"]["params"] is True and cfg["offload"]["optimizer"] is True
        r = cfg["rollout"]
        assert (r["sleep_level"], r["weight_load"], r["enforce_eager"], r["tensor_parallel_size"]) == (2, "direct", False, 2)
        assert cfg["trainer"]["total_steps"] == 3 and cfg["trainer"]["output_dir"] == str(tmp_path / "out" / "run")
        assert cfg["model"]["path"] == str(tmp_path / "out" / "assets" / "tiny_qwen3")
    proc = run_check({"PRINT_CONFIG": "1", "PYTHON": sys.executable, "NPROC": "1", "WEIGHT_LOAD": "reload",
                      "ENFORCE_EAGER": "true"}, tmp_path)
    r = yaml.safe_load(proc.stdout)["rollout"]
    assert (r["weight_load"], r["enforce_eager"], r["tensor_parallel_size"]) == ("reload", True, 1)


# ---------------------------------------------------------------------------------------------
# the report on synthetic runs
# ---------------------------------------------------------------------------------------------


def row(step: int, **over) -> dict:
    r = {"step": step, "timing/step_s": 2.0 + step, "rollout/mismatch_max": 2e-4 * step, "rollout/mismatch_kl": 1e-7,
         "actor/skipped_steps": 0.0, "actor/grad_norm": 0.5, "memory/offload_params_allocated_gb": 0.01,
         "memory/wake_weights_allocated_gb": 1.2, "memory/generate_peak_allocated_gb": 3.5,
         "memory/train_reserved_gb": 2.0}
    r.update(over)
    return {k: v for k, v in r.items() if v is not None}


def write_run(tmp_path, rows) -> str:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run)


def cli(run_dir, *extra) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, REPORT, "--run-dir", run_dir, "--steps", "3", *extra],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # one JSON line, nothing else on stdout
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.mark.unit
def test_report_passes_a_good_run(tmp_path):
    run = write_run(tmp_path, [row(1), row(2), row(3)])
    rc, out, _ = cli(run, "--device", "cuda", "--nproc", "2", "--tp", "2")
    assert rc == 0 and out["pass"] is True and out["reasons"] == [], out
    assert out["check"] == "gpu_check" and (out["device"], out["nproc"], out["tp"]) == ("cuda", 2, 2)
    assert out["mismatch_max"] == pytest.approx(6e-4) and out["mismatch_max_per_step"] == pytest.approx([2e-4, 4e-4, 6e-4])
    assert out["mismatch_kl"] == pytest.approx(1e-7) and out["max_logp_diff"] == 1e-3
    assert out["step_s"] == 5.0 and out["step_s_all"] == [3.0, 4.0, 5.0] and out["steps_logged"] == 3
    assert out["memory_gb"] == {"offload_params_allocated_gb": 0.01, "wake_weights_allocated_gb": 1.2,
                                "generate_peak_allocated_gb": 3.5, "train_reserved_gb": 2.0}


@pytest.mark.unit
def test_report_fails_for_each_reason(tmp_path):
    # mismatch above the threshold (on one step only: the worst step counts)
    rc, out, _ = cli(write_run(tmp_path, [row(1), row(2, **{"rollout/mismatch_max": 0.05}), row(3)]))
    assert rc == 1 and out["pass"] is False and out["mismatch_max"] == 0.05
    assert len(out["reasons"]) == 1 and "rollout/mismatch_max=0.05 > 0.001" in out["reasons"][0]
    # ... which a looser threshold accepts
    rc, out, _ = cli(write_run(tmp_path, [row(1), row(2, **{"rollout/mismatch_max": 0.05}), row(3)]),
                     "--max-logp-diff", "0.1")
    assert rc == 0 and out["pass"] is True
    # the metric is not logged at all: named, not a crash
    rc, out, _ = cli(write_run(tmp_path, [row(s, **{"rollout/mismatch_max": None}) for s in (1, 2, 3)]))
    assert rc == 1 and out["mismatch_max"] is None
    assert any(r.startswith("metric rollout/mismatch_max is missing from metrics.jsonl (steps [1, 2, 3])")
               for r in out["reasons"]), out
    rc, out, _ = cli(write_run(tmp_path, [row(1), row(2), row(3, **{"rollout/mismatch_kl": None})]))
    assert rc == 1 and out["reasons"] == [out["reasons"][0]] and "rollout/mismatch_kl is missing" in out["reasons"][0]
    # a non-finite mismatch, skipped steps (NaN loss), missing memory metrics
    bad = row(3, **{"rollout/mismatch_max": "nan", "actor/skipped_steps": 1.0})
    bad = {k: v for k, v in bad.items() if not k.startswith("memory/")}
    rc, out, _ = cli(write_run(tmp_path, [row(1), row(2), bad]))
    text = " | ".join(out["reasons"])
    assert rc == 1 and out["mismatch_max"] == "nan", out
    assert "rollout/mismatch_max is not finite" in text and "actor/skipped_steps=1.0" in text
    assert "no memory/* metrics" in text
    # the trainer failed after 2 steps
    rc, out, _ = cli(write_run(tmp_path, [row(1), row(2)]), "--rc", "1", "--log", "/tmp/x/train.log")
    assert rc == 1 and out["reasons"] == ["the trainer exited 1 (see /tmp/x/train.log)", "2 of 3 steps logged in metrics.jsonl"]
    # nothing logged at all
    rc, out, _ = cli(str(tmp_path / "empty"), "--rc", "2")
    assert rc == 1 and out["steps_logged"] == 0 and out["reasons"][1] == "0 of 3 steps logged in metrics.jsonl"


@pytest.mark.unit
def test_report_keeps_the_last_row_of_a_repeated_step(tmp_path):
    rows = [row(1), row(2), row(3, **{"rollout/mismatch_max": 0.5}), row(3)]  # step 3 logged again
    assert [r["rollout/mismatch_max"] for r in gpu_check_report.read_rows(write_run(tmp_path, rows))] == \
        pytest.approx([2e-4, 4e-4, 6e-4])


# ---------------------------------------------------------------------------------------------
# the cluster recipes (docs/cluster.md) that gpu_check.sh prepares a cluster for
# ---------------------------------------------------------------------------------------------


def recipe_config(tmp_path, recipe: str, model_name: str, model_config: str | dict, device: str):
    """``configs/<recipe>.yaml`` parsed for ``device`` against a stand-in model folder (its
    config.json: a fixture file under tests/fixtures or a dict; empty weights) and empty data
    files at the recipe's paths. Returns (config, recipe path)."""
    from rlcore.cli import parse_config

    model = tmp_path / model_name
    model.mkdir()
    if isinstance(model_config, dict):
        (model / "config.json").write_text(json.dumps(model_config))
    else:
        shutil.copy(os.path.join(REPO, "tests", "fixtures", model_config, "config.json"), model)
    (model / "model.safetensors").write_bytes(b"")
    data = [str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet")]
    for f in data:
        open(f, "w").close()
    path = os.path.join(REPO, "configs", f"{recipe}.yaml")
    cfg = parse_config(["--config", path, "--model.path", str(model), "--data.train_files", json.dumps(data[:1]),
                        "--data.val_files", json.dumps(data[1:]), "--trainer.output_dir", str(tmp_path / "out")],
                       device_type=device)
    return cfg, path


@pytest.mark.unit
@pytest.mark.parametrize("recipe,device", [("qwen3_8b_math_16gpu", "cuda"), ("qwen3_8b_math_16npu", "npu")])
def test_cluster_recipe_is_valid_for_16_ranks(recipe, device, tmp_path):
    """Every key of the recipe exists and its sizes fit a world of 16 (a stand-in Qwen3-8B folder
    and data files at the recipe's paths)."""
    from rlcore.preflight import validate_against_world

    cfg, path = recipe_config(tmp_path, recipe, "Qwen3-8B", {"model_type": "qwen3", "max_position_embeddings": 40960},
                              device)
    validate_against_world(cfg, 16)
    assert cfg.model.dtype == "bfloat16" and cfg.offload.params and cfg.offload.optimizer
    assert cfg.reward.components == {"math": 1.0} and cfg.rollout.tensor_parallel_size == 2
    with open(path) as f:
        text = f.read()
    assert "data/gsm8k/train.parquet" in text and "sbatch" in text  # the documented data path and launch line


@pytest.mark.unit
def test_moe_recipe_is_valid_for_16_ranks_and_fits(tmp_path):
    """configs/qwen3_30b_a3b_math_16gpu.yaml: keys exist, EP 8 divides the 16 ranks and the 128
    experts of Qwen3-30B-A3B (its public config.json, tests/fixtures), and the memory plan fits 80 GB."""
    from rlcore.memory_plan import plan_from_config
    from rlcore.preflight import validate_against_world

    cfg, _ = recipe_config(tmp_path, "qwen3_30b_a3b_math_16gpu", "Qwen3-30B-A3B", "qwen3_30b_a3b", "cuda")
    validate_against_world(cfg, 16)
    assert cfg.parallel.ep_size == 8 and cfg.model.moe_implementation == "triton"
    assert cfg.rollout.weight_load == "reload"  # auto, for an MoE model
    plan = plan_from_config(cfg, 16, 80, "cuda", nproc_per_node=8)
    assert plan.fits, plan
    # The checkpoint phase: the save runs before the weight sync, while vLLM sleeps. Saving after it
    # (vLLM awake with its whole budget) would add the trainer's params and AdamW state to the
    # generate phase: 68.0 + 7.1 + 14.2 = 89.3 GB, over the 77 GB limit.
    ckpt, gen = plan.phases["checkpoint"], plan.phases["generate"]
    assert plan.total("checkpoint") <= plan.limit and ckpt["kv_cache"] == ckpt["vllm_weights"] == 0
    awake = plan.total("generate") + ckpt["trainer_params"] + ckpt["optimizer"]
    assert awake > plan.limit, awake / 2**30
    assert gen["trainer_params"] == gen["optimizer"] == 0  # offloaded while generating


@pytest.mark.unit
def test_vl_recipe_is_valid_for_16_ranks_and_fits(tmp_path):
    """configs/qwen3_vl_8b_geo3k_16gpu.yaml: keys exist, sizes fit a world of 16, the image settings
    are the geo3k ones, and the memory plan (vision tower included) fits 80 GB, the GPUs of the dense
    recipe, with the whole batch in one wave. Qwen3-VL-8B-Instruct's public config.json: tests/fixtures."""
    from rlcore.config import resolve
    from rlcore.memory_plan import plan_from_config
    from rlcore.preflight import validate_against_world

    cfg, path = recipe_config(tmp_path, "qwen3_vl_8b_geo3k_16gpu", "Qwen3-VL-8B-Instruct", "qwen3_vl_8b", "cuda")
    validate_against_world(cfg, 16)
    assert cfg.model.dtype == "bfloat16" and cfg.offload.params and cfg.offload.optimizer
    assert cfg.data.image_key == "images" and cfg.data.apply_chat_template
    assert cfg.rollout.limit_mm_per_prompt == {"image": 1, "video": 0}
    assert cfg.reward.components == {"math": 1.0} and cfg.rollout.tensor_parallel_size == 2
    resolved = resolve(cfg, "cuda")  # sdpa with images: the shared prompt (one image encode per group) is on
    assert resolved.model.attn_implementation == "sdpa" and resolved.algorithm.share_prompt is True
    assert resolved.rollout.sleep_level == 2
    plan = plan_from_config(cfg, 16, 80, "cuda", nproc_per_node=8)
    assert plan.fits, plan
    assert plan.inputs.shape.vision_params() == 576_388_336 and plan.inputs.vllm_images == 1
    assert plan.kv["sequences"] >= plan.kv["batch_sequences"] == 128, plan.kv  # one generation wave
    with open(path) as f:
        text = f.read()
    assert "convert_data.py geo3k" in text and "data/geo3k/train.parquet" in text and "sbatch" in text
