"""scripts/gpu_check.sh and its verdict (scripts/gpu_check_report.py), on a machine without a GPU:
the script refuses clearly, every part's trainer arguments (base, judge, lora, moe_r3) parse and
resolve for cuda and npu, the parts run in order with stand-ins for torchrun (skip and failure
included), and the report passes or fails synthetic metrics.jsonl files for the right reasons, per
part and overall. The check itself (a few GRPO steps per part on 1-2 GPUs) needs a GPU and is not run here."""

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
def test_gpu_check_refuses_unknown_parts(tmp_path):
    """A typo in PARTS or PRINT_CONFIG stops before the device checks (exit 2, the valid names)."""
    proc = run_check({"PATH": bare_path(tmp_path), "PARTS": "base,lroa"}, tmp_path)
    assert proc.returncode == 2 and "unknown part 'lroa'" in proc.stderr and "base,judge,lora,moe,ulysses,teacher,moe_r3" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_check({"PATH": str(tmp_path / "bin"), "PRINT_CONFIG": "moe3"}, tmp_path)
    assert proc.returncode == 2 and "PRINT_CONFIG=moe3" in proc.stderr, proc.stderr


PARTS = ("base", "judge", "lora", "moe", "ulysses", "teacher", "moe_r3")


@pytest.fixture(scope="module")
def check_out(tmp_path_factory) -> str:
    """An OUT with the assets gpu_check.sh builds (scripts/prepare_demo.py --out OUT/assets)."""
    out = tmp_path_factory.mktemp("gpu_check_out")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_demo.py"), "--out",
                           str(out / "assets")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


def printed_config(part: str, device: str, out: str, tmp_path, **env) -> tuple[dict, str]:
    """gpu_check.sh's config for ``part`` (PRINT_CONFIG=part): as YAML (a dict) and its file."""
    import yaml

    proc = subprocess.run(["bash", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": out, "PRINT_CONFIG": "1" if part == "base" else part,
                               "DEVICE": device, "PYTHON": sys.executable, "NPROC": "2", **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    path = tmp_path / f"{part}_{device}.yaml"
    path.write_text(proc.stdout)
    return yaml.safe_load(proc.stdout), str(path)


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_gpu_check_overrides_are_valid_trainer_config(device, check_out, tmp_path, capsys):
    """Each part's train_grpo.py arguments parse against the current config (PRINT_CONFIG=PART skips
    the device checks), select the accelerator path and the part's feature, and resolve for the
    device against the assets prepare_demo.py builds, with sizes that fit the 2 ranks (MoE on npu too:
    no longer refused, the rollout restores vllm-ascend 0.23's swapped experts)."""
    import gpu_check_report
    from rlcore.config.cli import parse_config
    from rlcore.run.preflight import validate_against_world

    assets = os.path.join(check_out, "assets")
    for part in PARTS:
        cfg, path = printed_config(part, device, check_out, tmp_path)
        assert cfg["parallel"]["device"] == device and cfg["model"]["dtype"] == "bfloat16"
        assert cfg["offload"]["params"] is True and cfg["offload"]["optimizer"] is True
        r = cfg["rollout"]
        assert (r["enforce_eager"], r["tensor_parallel_size"]) == (False, 2)
        assert cfg["trainer"]["total_steps"] == 3 and cfg["trainer"]["output_dir"] == os.path.join(check_out, part, "run")
        assert cfg["checkpoint"]["resume"] == "never"
        model = "tiny_qwen3_moe" if part.startswith("moe") else "tiny_qwen3"
        assert cfg["model"]["path"] == os.path.join(assets, model)
        assert (r["sleep_level"], r["weight_load"]) == {"lora": (1, "direct"), "moe": (2, "reload"),
                                                        "moe_r3": (2, "reload")}.get(part, (2, "direct"))
        assert (cfg["lora"]["rank"] > 0) == (part == "lora")
        assert (cfg["algorithm"]["routing_replay"] == "r3") == (part == "moe_r3")
        judges = cfg["reward"]["models"]
        assert bool(judges) == (part == "judge")
        if part == "judge":  # the judge the report reads (reward/<JUDGE>), and its only reward
            assert [j["name"] for j in judges] == [gpu_check_report.JUDGE]
            assert cfg["reward"]["components"] == {gpu_check_report.JUDGE: 1.0}
            assert judges[0]["path"] == os.path.join(assets, "tiny_rm_high_digits")
        if part.startswith("moe"):
            assert cfg["parallel"]["ep_size"] == 2 and r["enable_prefix_caching"] is (part == "moe_r3" or None)
        assert cfg["parallel"]["ulysses_size"] == (2 if part == "ulysses" else 1)
        assert (cfg["distill"]["teacher"] == os.path.join(assets, "tiny_qwen3")) == (part == "teacher")
        resolved = parse_config(["--config", path], device_type=device)
        validate_against_world(resolved, 2)
        assert resolved.rollout.sleep_level == (1 if part == "lora" else 2)
        assert resolved.rollout.check_sync == ("off" if part == "lora" else "warn")
        if part.startswith("moe"):
            assert resolved.model.moe_implementation == {"cuda": "triton", "npu": "npu"}[device]
        if part == "ulysses":  # the device's flash kernel through VeOmni's Ulysses path (no GPU here: FA4 on
            # cuda needs its entry point, so this machine resolves sdpa there; npu resolves its kernel)
            assert resolved.model.attn_implementation == {"cuda": "sdpa", "npu": "flash_attention_2"}[device]
        if part == "judge":
            assert resolved.reward.judges()[0].kind == "discriminative"


def test_gpu_check_knobs_reach_every_part(check_out, tmp_path):
    """NPROC, WEIGHT_LOAD, ENFORCE_EAGER, STEPS and extra arguments reach each part (moe_r3 reloads
    whatever WEIGHT_LOAD says: a direct load is refused for MoE); extra arguments come last and win."""
    env = {"NPROC": "1", "WEIGHT_LOAD": "reload", "ENFORCE_EAGER": "true", "STEPS": "2"}
    for part in PARTS:
        cfg, _ = printed_config(part, "cuda", check_out, tmp_path, **env)
        r = cfg["rollout"]
        assert (r["weight_load"], r["enforce_eager"], r["tensor_parallel_size"]) == ("reload", True, 1)
        assert cfg["trainer"]["total_steps"] == 2 and cfg["parallel"]["ep_size"] == 1
    proc = subprocess.run(["bash", SCRIPT, "--rollout.sleep_level", "0", "--trainer.seed", "7"], cwd=REPO,
                          env={**os.environ, "OUT": check_out, "PRINT_CONFIG": "lora", "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  sleep_level: 0\n" in proc.stdout and "  seed: 7\n" in proc.stdout


# ---------------------------------------------------------------------------------------------
# the parts in order, with stand-ins for the device, torchrun and the assets
# ---------------------------------------------------------------------------------------------

FAKE_PYTHON = """#!/bin/bash
case "$1 $2" in
    "scripts/gpu_check_report.py --probe") echo "a library's banner"; echo 2; exit 0 ;;
    "scripts/gpu_check_report.py --ascend-ops") echo "a library's banner"; echo "${{FAKE_ASCEND_OPS:-ok: fake}}"; exit 0 ;;
    "scripts/prepare_demo.py --out") mkdir -p "$3"; exit 0 ;;
esac
exec {python} "$@"
"""

# torchrun's stand-in: the part's hand-written metrics into trainer.output_dir, its arguments
# beside them, exit code FAKE_RC_<part> (0)
FAKE_TORCHRUN = """#!{python}
import json, os, shutil, sys
args = sys.argv[1:]
run = args[len(args) - 1 - args[::-1].index("--trainer.output_dir") + 1]
part = os.path.basename(os.path.dirname(run))
os.makedirs(run)
with open(os.path.join(os.path.dirname(run), "argv.json"), "w") as f:
    json.dump(args, f)
shutil.copy(os.path.join(os.environ["FAKE_ROWS"], part + ".jsonl"), os.path.join(run, "metrics.jsonl"))
print("trainer of", part)
sys.exit(int(os.environ.get("FAKE_RC_" + part, "0")))
"""


def good_rows(part: str) -> list[dict]:
    extra = {"judge": {f"reward/{gpu_check_report.JUDGE}": 0.4, f"reward/{gpu_check_report.JUDGE}_parse_fail_frac": 0.0,
                       "timing/judge_s": 0.3},
             "moe": {"rollout/experts_restored": 4.0, "rollout/experts_fused": 0.0}, "ulysses": {"perf/sp_pad_frac": 0.05},
             "teacher": {"distill/reverse_kl": 0.02, "timing/teacher_s": 0.4},
             "moe_r3": {"actor/router_agreement": 0.93, "actor/router_replay_missing": 0.0}}.get(part, {})
    return [row(s, **extra) for s in (1, 2, 3)]


def fake_run(tmp_path, device: str, rows: dict[str, list[dict]], *args, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(parents=True)
    tools = {"python": FAKE_PYTHON, "torchrun": FAKE_TORCHRUN, "nvidia-smi": "#!/bin/bash\n", "npu-smi": "#!/bin/bash\n"}
    for name, text in tools.items():
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "rows").mkdir()
    for part, part_rows in rows.items():
        (tmp_path / "rows" / f"{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part_rows))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"), "DEVICE": device,
           "FAKE_ROWS": str(tmp_path / "rows"), "ASCEND_HOME": str(tmp_path / "no_cann"), **env}
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env={**os.environ, "OUT": str(tmp_path / "out"), **env},
                          capture_output=True, text=True, timeout=300)


def verdict(proc: subprocess.CompletedProcess) -> dict:
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # one JSON line, nothing else on stdout
    return json.loads(lines[0])


@pytest.mark.unit
def test_gpu_check_runs_each_part_and_skips_moe_r3_on_npu(tmp_path):
    """DEVICE=npu, all parts: base, judge, lora and moe run (each its own torchrun with its arguments
    and the extra ones last), moe_r3 (not in the seed recipe) is skipped with the reason unless PARTS
    names it; vllm-ascend's custom-op check is in the JSON line; one failing part fails the check."""
    out = tmp_path / "out"
    proc = fake_run(tmp_path, "npu", {p: good_rows(p) for p in PARTS}, "--trainer.seed", "7", FAKE_RC_lora="1",
                    FAKE_ASCEND_OPS="ok: custom ops load on soc_version 253 (A3)")
    res = verdict(proc)
    assert proc.returncode == 1 and res["pass"] is False, res
    assert (res["passed"], res["failed"], res["skipped"]) == (["base", "judge", "moe", "ulysses", "teacher"], ["lora"],
                                                              ["moe_r3"])
    assert list(res["parts"]) == list(PARTS) and (res["device"], res["nproc"], res["tp"]) == ("npu", 2, 2)
    assert res["ascend_custom_ops"] == "ok: custom ops load on soc_version 253 (A3)"
    assert res["reasons"] == [f"lora: the trainer exited 1 (see {out}/lora/train.log)"]
    assert "PARTS=moe_r3 runs it" in res["parts"]["moe_r3"]["skipped"] and res["parts"]["moe_r3"]["pass"] is None
    assert not (out / "moe_r3").exists() and "moe_r3 skipped" in proc.stderr
    assert res["parts"]["moe"]["experts_restored"] == 4.0 and res["parts"]["moe"]["experts_sync"] == "per-expert"
    assert "lora: the trainer exited 1" in proc.stderr and "trainer of lora" in proc.stderr  # the log's end
    argv = json.loads((out / "moe" / "argv.json").read_text())
    last = lambda key: argv[len(argv) - 1 - argv[::-1].index(key) + 1]  # noqa: E731  (the last one wins)
    assert last("--parallel.ep_size") == "2" and last("--rollout.weight_load") == "reload"
    for part in ("base", "judge", "lora", "moe"):
        argv = json.loads((out / part / "argv.json").read_text())
        assert argv[:4] == ["--standalone", "--nproc_per_node", "2", "train_grpo.py"] and argv[-2:] == ["--trainer.seed", "7"]
        assert ("--lora.rank" in argv) == (part == "lora") and ("--reward.models" in argv) == (part == "judge")
        assert res["parts"][part]["run_dir"] == str(out / part / "run") and (out / part / "train.log").exists()


@pytest.mark.unit
def test_gpu_check_parts_switch(tmp_path):
    """PARTS picks the parts (on cuda moe_r3 runs); a rerun replaces a part's old output."""
    out = tmp_path / "out"
    (out / "moe_r3" / "run").mkdir(parents=True)
    (out / "moe_r3" / "run" / "metrics.jsonl").write_text("stale\n")
    proc = fake_run(tmp_path, "cuda", {p: good_rows(p) for p in PARTS}, PARTS="moe_r3, base", NPROC="1")
    res = verdict(proc)
    assert proc.returncode == 0 and res["pass"] is True and res["reasons"] == [], res
    assert list(res["parts"]) == ["base", "moe_r3"] and res["skipped"] == [] and res["nproc"] == 1
    assert res["parts"]["moe_r3"]["router_agreement"] == 0.93
    argv = json.loads((out / "moe_r3" / "argv.json").read_text())
    assert argv[argv.index("--algorithm.routing_replay") + 1] == "r3" and not (out / "judge").exists()
    # named in PARTS, moe_r3 runs on npu too
    proc = fake_run(tmp_path / "again", "npu", {"moe_r3": good_rows("moe_r3")}, PARTS="moe_r3")
    assert proc.returncode == 0 and verdict(proc)["passed"] == ["moe_r3"], proc.stderr
    # every part skipped: nothing was checked, which is no pass
    rep = subprocess.run([sys.executable, REPORT, "--out", str(tmp_path), "--skipped", "moe_r3=why"],
                         capture_output=True, text=True, timeout=60)
    res = verdict(rep)
    assert rep.returncode == 1 and res["pass"] is False and res["reasons"][0].startswith("no part ran (moe_r3 skipped:")


@pytest.mark.unit
def test_gpu_check_stops_when_vllm_ascends_ops_do_not_load(tmp_path):
    """On NPU the custom-op check runs before any part: an ERROR line is exit 2 with its fix, no part runs."""
    proc = fake_run(tmp_path, "npu", {}, FAKE_ASCEND_OPS="ERROR vllm-ascend does not match this NPU (soc_version 253): "
                                                          "... use vllm-ascend's A3 image")
    assert proc.returncode == 2 and "A3 image" in proc.stderr and proc.stdout == "", proc.stderr
    assert not (tmp_path / "out" / "base").exists()


@pytest.mark.unit
@pytest.mark.parametrize("case,expect", [
    ("ok", "ok: custom ops load on soc_version 253 (A3)"),
    ("wrong_soc", "ERROR vllm-ascend does not match this NPU (soc_version 253): Current device type: A3 does not "
                  "match the installed version's device type: A2"),
    ("no_library", "ERROR vllm-ascend's custom op library (vllm_ascend.vllm_ascend_C) did not load"),
    ("no_routing_op", "ERROR vllm-ascend's op library loaded without npu_moe_init_routing_custom")])
def test_ascend_ops_check_logic(monkeypatch, case, expect):
    """ascend_ops() against stand-ins of torch_npu and vllm_ascend.utils with exactly the names it calls
    (vllm-ascend 0.23.0 utils.py:845-866 check_ascend_device_type, :409-467 enable_custom_op)."""
    import types

    import torch

    def check_type():
        if case == "wrong_soc":  # utils.py:864-866's assertion
            raise AssertionError("Current device type: A3 does not match the installed version's device type: A2, "
                                 "please check your installation package.")

    utils = types.SimpleNamespace(check_ascend_device_type=check_type, enable_custom_op=lambda: case != "no_library",
                                  get_ascend_device_type=lambda: "A3")
    npu = types.SimpleNamespace(npu=types.SimpleNamespace(get_soc_version=lambda: 253))
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setitem(sys.modules, "vllm_ascend", types.SimpleNamespace(utils=utils))
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    ops = types.SimpleNamespace(**({} if case == "no_routing_op" else {"npu_moe_init_routing_custom": object()}))
    monkeypatch.setattr(torch.ops, "_C_ascend", ops, raising=False)
    got = gpu_check_report.ascend_ops()
    assert got.startswith(expect), got
    if case != "ok":
        assert "ascend910_9391" in got and "docs/install.md" in got


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
    run.mkdir(parents=True, exist_ok=True)
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


def part_reasons(part: str, rows: list[dict], **limits) -> list[str]:
    limits = {"steps": 3, "max_logp_diff": 1e-3, **limits}
    out = gpu_check_report.part_report(part, rows, **limits)
    assert out["pass"] is (not out["reasons"])
    return out["reasons"]


@pytest.mark.unit
def test_report_judge_part(tmp_path):
    J = gpu_check_report.JUDGE
    good = good_rows("judge")
    out = gpu_check_report.part_report("judge", good, steps=3, max_logp_diff=1e-3)
    assert out["pass"] is True and out["judge_reward_per_step"] == [0.4] * 3 and out["judge_s"] == 0.3
    assert part_reasons("base", [row(s) for s in (1, 2, 3)]) == []  # base needs no judge metrics ...
    missing = part_reasons("judge", [row(s) for s in (1, 2, 3)])  # ... the judge part does
    assert missing == [f"metric reward/{J} is missing from metrics.jsonl (steps [1, 2, 3])",
                       f"metric reward/{J}_parse_fail_frac is missing from metrics.jsonl (steps [1, 2, 3])",
                       "metric timing/judge_s is missing from metrics.jsonl (steps [1, 2, 3])"]
    bad = [good[0], {**good[1], f"reward/{J}": 1.7}, {**good[2], f"reward/{J}_parse_fail_frac": 0.25}]
    text = " | ".join(part_reasons("judge", bad))
    assert f"reward/{J} outside [0, 1]" in text and f"reward/{J}_parse_fail_frac=0.25" in text
    assert "not finite" in part_reasons("judge", [good[0], good[1], {**good[2], f"reward/{J}": "nan"}])[0]


@pytest.mark.unit
def test_report_lora_part():
    assert part_reasons("lora", good_rows("lora")) == []
    reasons = part_reasons("lora", [row(1), row(2, **{"actor/grad_norm": 0.0}), row(3)])
    assert reasons == ["actor/grad_norm is 0 on some step ([0.5, 0.0, 0.5]): the adapter gets no gradient"]
    assert "needs at least 2 steps" in part_reasons("lora", [row(1)], steps=1)[0]
    # a stale adapter in vLLM shows as the mismatch from step 2: the base checks apply to every part
    reasons = part_reasons("lora", [row(1), row(2, **{"rollout/mismatch_max": 0.3}), row(3)])
    assert len(reasons) == 1 and reasons[0].startswith("rollout/mismatch_max=0.3 > 0.001")


@pytest.mark.unit
def test_report_moe_r3_part():
    good = good_rows("moe_r3")
    out = gpu_check_report.part_report("moe_r3", good, steps=3, max_logp_diff=1e-3, min_router_agreement=0.5)
    assert out["pass"] is True and out["router_agreement"] == 0.93 and out["min_router_agreement"] == 0.5
    bad = [good[0], {**good[1], "actor/router_agreement": 0.17}, {**good[2], "actor/router_replay_missing": 12.0}]
    reasons = part_reasons("moe_r3", bad)
    assert len(reasons) == 2 and reasons[0].startswith("actor/router_agreement=0.17 < 0.5")
    assert reasons[1].startswith("actor/router_replay_missing=12")
    assert part_reasons("moe_r3", bad[:2] + [good[2]], min_router_agreement=0.1) == []
    reasons = part_reasons("moe_r3", [row(s) for s in (1, 2, 3)])  # R3 never ran (e.g. an r2 or dense run)
    assert [r.split(" is missing")[0] for r in reasons] == ["metric actor/router_agreement",
                                                           "metric actor/router_replay_missing"]


@pytest.mark.unit
def test_report_of_all_parts(tmp_path):
    """--out with --ran/--skipped: each part's run read from OUT/PART/run, the verdict overall."""
    out = tmp_path / "out"
    for part in PARTS:
        write_run(out / part, good_rows(part))
    ran = [f"--ran={p}=0" for p in ("lora", "base", "judge", "moe_r3", "moe", "teacher", "ulysses")]
    proc = subprocess.run([sys.executable, REPORT, "--out", str(out), *ran, "--device", "cuda", "--nproc", "1"],
                          capture_output=True, text=True, timeout=60)
    res = verdict(proc)
    assert proc.returncode == 0 and res["pass"] is True and res["passed"] == list(PARTS) == list(res["parts"]), res
    assert res["parts"]["judge"]["log"] == str(out / "judge" / "train.log") and res["out"] == str(out)
    assert res["nproc"] == 1 and "tp" not in res
    # a judge that scored nothing, moe_r3 skipped: the judge fails the whole check, the skip does not
    write_run(out / "judge", [{**r, f"reward/{gpu_check_report.JUDGE}_parse_fail_frac": 1.0} for r in good_rows("judge")])
    proc = subprocess.run([sys.executable, REPORT, "--out", str(out), "--ran", "base=0", "--ran", "judge=0",
                           "--skipped", "moe_r3=not on npu"], capture_output=True, text=True, timeout=60)
    res = verdict(proc)
    assert proc.returncode == 1 and (res["passed"], res["failed"], res["skipped"]) == (["base"], ["judge"], ["moe_r3"])
    assert res["reasons"] == [f"judge: {r}" for r in res["parts"]["judge"]["reasons"]] and len(res["reasons"]) == 1
    assert res["parts"]["moe_r3"] == {"pass": None, "skipped": "not on npu"}
    # a part name the report does not know, or no run named at all: a usage error
    for bad in (["--ran", "moe2=0"], ["--ran", "base=x"], []):
        proc = subprocess.run([sys.executable, REPORT, "--out", str(out), *bad], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", bad


@pytest.mark.unit
def test_report_one_run_with_a_part(tmp_path):
    """--run-dir with --part applies that part's checks to one run (a rerun's verdict by hand)."""
    run = write_run(tmp_path, [row(1), row(2), row(3)])
    rc, out, _ = cli(run, "--part", "moe_r3")
    assert rc == 1 and "actor/router_agreement is missing" in out["reasons"][0]


# ---------------------------------------------------------------------------------------------
# the cluster recipes (docs/cluster.md) that gpu_check.sh prepares a cluster for
# ---------------------------------------------------------------------------------------------


def recipe_config(tmp_path, recipe: str, model_name: str, model_config: str | dict, device: str):
    """``configs/<recipe>.yaml`` parsed for ``device`` against a stand-in model folder (its
    config.json: a fixture file under tests/fixtures or a dict; empty weights) and empty data
    files at the recipe's paths. Returns (config, recipe path)."""
    from rlcore.config.cli import parse_config

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
    from rlcore.run.preflight import validate_against_world

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
    from rlcore.plan.memory import plan_from_config
    from rlcore.run.preflight import validate_against_world

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
    from rlcore.plan.memory import plan_from_config
    from rlcore.run.preflight import validate_against_world

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


@pytest.mark.unit
def test_report_moe_part():
    """moe: rollout/experts_restored on every step (the wake-up's check ran), reported at its largest."""
    out = gpu_check_report.part_report("moe", good_rows("moe"), steps=3, max_logp_diff=1e-3)
    assert out["pass"] and out["experts_restored"] == 4.0, out
    # the per-expert checkpoint's experts went per expert (the NPU pin's vllm 0.23 Qwen3-MoE loader)
    assert out["experts_sync"] == "per-expert" and out["experts_fused_per_step"] == [0.0] * 3, out
    fused = [row(s, **{"rollout/experts_restored": 0.0, "rollout/experts_fused": 1.0}) for s in (1, 2, 3)]
    assert gpu_check_report.part_report("moe", fused, steps=3, max_logp_diff=1e-3)["experts_sync"] == "fused"
    assert part_reasons("moe", [row(s) for s in (1, 2, 3)]) == [
        "metric rollout/experts_restored is missing from metrics.jsonl (steps [1, 2, 3])",
        "metric rollout/experts_fused is missing from metrics.jsonl (steps [1, 2, 3])"]


@pytest.mark.unit
def test_report_ulysses_and_teacher_parts():
    assert part_reasons("ulysses", good_rows("ulysses")) == [] and part_reasons("teacher", good_rows("teacher")) == []
    assert part_reasons("ulysses", [row(s) for s in (1, 2, 3)]) == [
        "metric perf/sp_pad_frac is missing from metrics.jsonl (steps [1, 2, 3])"]
    assert part_reasons("ulysses", [row(s, **{"perf/sp_pad_frac": 1.0}) for s in (1, 2, 3)]) == [
        "perf/sp_pad_frac=[1.0, 1.0, 1.0]: outside [0, 1)"]
    assert len(part_reasons("teacher", [row(s, **{"timing/teacher_s": 0.1}) for s in (1, 2, 3)])) == 1


@pytest.mark.unit
def test_gpu_check_skips_ulysses_on_one_device(tmp_path):
    proc = fake_run(tmp_path, "cuda", {p: good_rows(p) for p in PARTS}, PARTS="base,ulysses", NPROC="1")
    res = verdict(proc)
    assert res["passed"] == ["base"] and res["skipped"] == ["ulysses"] and "NPROC=1" in res["parts"]["ulysses"]["skipped"]
