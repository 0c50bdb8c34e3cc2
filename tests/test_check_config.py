"""scripts/check_config.py: the device dry run (rlcore/run/dry_run.py) of every shipped cluster config,
on this CPU machine, through the real libraries' validation (VeOmni's with its device probe set to
the config's device, the installed vLLM's EngineArgs.create_engine_config on this CPU platform).

The configs are run against stand-in model folders (the public config.json in tests/fixtures, a
safetensors file holding no tensors: vLLM reads its header) and empty data files, as a login node
would hold them. One interpreter runs them all (vLLM and VeOmni imported once) and reports whether a
dry run left the process environment changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import QUIET_ENV, REPO

RUNNER = textwrap.dedent("""
    import json, os, sys
    from rlcore import quiet
    quiet.install()
    from rlcore.run.dry_run import dry_run
    out, env_changed = [], set()
    for i, (argv, device, nproc, nnodes, *extra) in enumerate(json.loads(sys.argv[1])):
        env = dict(os.environ)
        with quiet.filtered_output():
            checks = dry_run(argv, device, nproc, nnodes, **(extra[0] if extra else {}))
        if i:  # the first one imports vLLM and VeOmni
            env_changed |= {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
        out.append([[c.name, c.status, c.detail] for c in checks])
    print(json.dumps({"checks": out, "env_changed": sorted(env_changed)}))
""")


def empty_safetensors(path) -> None:
    """A safetensors file holding no tensors (vLLM reads the header of a tied model's weights)."""
    from safetensors.torch import save_file

    save_file({}, str(path))


def stand_in(tmp_path, name: str, fixture: str) -> list[str]:
    model = tmp_path / name
    model.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", fixture, "config.json"), model)
    empty_safetensors(model / "model.safetensors")
    data = [str(tmp_path / f"{name}_train.parquet"), str(tmp_path / f"{name}_test.parquet")]
    for f in data:
        open(f, "w").close()
    return ["--model.path", str(model), "--data.train_files", json.dumps(data[:1]), "--data.val_files",
            json.dumps(data[1:]), "--trainer.output_dir", str(tmp_path / "out" / name)]


def judge_recipe(tmp_path, name: str = "judge", **judge_settings) -> list[str]:
    """configs/qwen3_8b_judge_16gpu.yaml with its judge pointed at a stand-in Qwen3-1.7B folder
    (and ``judge_settings`` set on it)."""
    import yaml

    judge = tmp_path / f"{name}_1_7b"
    judge.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "qwen3_1_7b", "config.json"), judge)
    empty_safetensors(judge / "model.safetensors")
    (judge / "tokenizer_config.json").write_text("{}")
    with open(os.path.join(REPO, "configs", "qwen3_8b_judge_16gpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["reward"]["models"][0].update(path=str(judge), **judge_settings)
    path = tmp_path / f"{name}_qwen3_8b_judge_16gpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path), *stand_in(tmp_path, f"{name}_j", "qwen3_8b")]


def opd_recipe(tmp_path, tokenizer_from: str) -> list[str]:
    """configs/qwen3_1_7b_from_8b_opd_16gpu.yaml on stand-in Qwen3-1.7B (student) and Qwen3-8B (teacher)
    folders that share one tokenizer (the tiny model's: the check compares the two)."""
    student_args = stand_in(tmp_path, "opd_student", "qwen3_1_7b")
    teacher = tmp_path / "opd_teacher"
    teacher.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "qwen3_8b", "config.json"), teacher)
    empty_safetensors(teacher / "model.safetensors")
    for folder in (tmp_path / "opd_student", teacher):
        for f in os.listdir(tokenizer_from):
            if f.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(os.path.join(tokenizer_from, f), folder)
    return ["--config", os.path.join(REPO, "configs", "qwen3_1_7b_from_8b_opd_16gpu.yaml"), *student_args,
            "--distill.teacher", str(teacher)]


def gpu_check_config(tmp_path, model_args: list[str]) -> str:
    """What scripts/gpu_check.sh would run, as a YAML file (its PRINT_CONFIG mode)."""
    env = {**os.environ, "PRINT_CONFIG": "1", "DEVICE": "cuda", "PYTHON": sys.executable, "NPROC": "2",
           "OUT": str(tmp_path / "gpu_check")}
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), *model_args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "gpu_check.yaml"
    path.write_text(proc.stdout)
    return str(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model, toy_data) -> dict[str, dict[str, list]]:
    from rlcore.demo.toy import make_tiny_moe_model

    tmp = tmp_path_factory.mktemp("check_config")
    cfg = lambda name: os.path.join(REPO, "configs", f"{name}.yaml")  # noqa: E731
    tiny = ["--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]"]
    cases = {
        "qwen3_8b_math_16gpu": (["--config", cfg("qwen3_8b_math_16gpu"), *stand_in(tmp, "a", "qwen3_8b")], "cuda", 8, 2),
        "qwen3_8b_math_32k_16gpu": (["--config", cfg("qwen3_8b_math_32k_16gpu"), *stand_in(tmp, "s", "qwen3_8b")],
                                    "cuda", 8, 2),
        "qwen3_8b_tool_math_16gpu": (["--config", cfg("qwen3_8b_tool_math_16gpu"), *stand_in(tmp, "f", "qwen3_8b")],
                                     "cuda", 8, 2),
        "qwen3_8b_lora_math_8gpu": (["--config", cfg("qwen3_8b_lora_math_8gpu"), *stand_in(tmp, "l", "qwen3_8b")],
                                    "cuda", 8, 1),
        "qwen3_8b_judge_16gpu": (judge_recipe(tmp), "cuda", 8, 2),
        "qwen3_1_7b_from_8b_opd_16gpu": (opd_recipe(tmp, tiny_model), "cuda", 8, 2),
        "qwen3_30b_a3b_math_16gpu": (["--config", cfg("qwen3_30b_a3b_math_16gpu"),
                                      *stand_in(tmp, "b", "qwen3_30b_a3b")], "cuda", 8, 2),
        "qwen3_vl_8b_geo3k_16gpu": (["--config", cfg("qwen3_vl_8b_geo3k_16gpu"), *stand_in(tmp, "c", "qwen3_vl_8b")],
                                    "cuda", 8, 2),
        "gpu_check": (["--config", gpu_check_config(tmp, tiny), *tiny, "--trainer.output_dir", str(tmp / "g")],
                      "cuda", 2, 1),
        "qwen3_8b_math_16npu": (["--config", cfg("qwen3_8b_math_16npu"), *stand_in(tmp, "d", "qwen3_8b")], "npu", 16, 1),
        # Ulysses (the 32k recipe, ulysses_size 2) where a flash kernel resolves: an A3 node's dies, and
        # CUDA GPUs older than Hopper (no flash-attn-4: sdpa, the project's own Ulysses path)
        "qwen3_8b_math_32k_npu": (["--config", cfg("qwen3_8b_math_32k_16gpu"), *stand_in(tmp, "t", "qwen3_8b")],
                                  "npu", 16, 1, {"device_gb": 64.0}),
        "qwen3_8b_math_32k_pre_hopper": (["--config", cfg("qwen3_8b_math_32k_16gpu"), *stand_in(tmp, "u", "qwen3_8b")],
                                         "cuda", 8, 2, {"pre_hopper": True}),
        "moe_on_npu": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "e", "qwen3_30b_a3b")], "npu", 16, 1),
        # the seed run (Ascend A3, 64 GB dies) and its CUDA twin, on Qwen3-VL-30B-A3B-Instruct's config.json
        "qwen3_vl_30b_a3b_geo3k_16npu": (["--config", cfg("qwen3_vl_30b_a3b_geo3k_16npu"),
                                          *stand_in(tmp, "v", "qwen3_vl_30b_a3b")], "npu", 16, 1, {"device_gb": 64.0}),
        "qwen3_vl_30b_a3b_geo3k_16gpu": (["--config", cfg("qwen3_vl_30b_a3b_geo3k_16gpu"),
                                          *stand_in(tmp, "w", "qwen3_vl_30b_a3b")], "cuda", 8, 2),
        "r3_cuda": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "h", "qwen3_30b_a3b"),
                     "--algorithm.routing_replay", "r3"], "cuda", 8, 2),
        "r3_npu": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "n", "qwen3_30b_a3b"),
                    "--algorithm.routing_replay", "r3"], "npu", 16, 1),
        # both passed the dry run while it only constructed EngineArgs; vLLM's create_engine_config refuses them
        "r3_cuda_without_prefix_caching": (["--config", cfg("qwen3_30b_a3b_math_16gpu"),
                                            *stand_in(tmp, "i", "qwen3_30b_a3b"), "--algorithm.routing_replay", "r3",
                                            "--rollout.enable_prefix_caching", "false"], "cuda", 8, 2),
        "judge_context_too_long": (judge_recipe(tmp, "long", max_model_len=65536), "cuda", 8, 2),
        # rollout.enable_expert_parallel and rollout.engine_kwargs (rlcore/rollout/engine_keys.py) through vLLM
        "ep_cuda": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "x", "qwen3_30b_a3b"),
                     "--rollout.enable_expert_parallel", "true", "--rollout.engine_kwargs", "{max_logprobs: 5}"],
                    "cuda", 8, 2),
        "ep_npu": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "y", "qwen3_30b_a3b"),
                    "--rollout.enable_expert_parallel", "true"], "npu", 16, 1),
        "engine_kwargs_bad_type": (["--config", cfg("qwen3_8b_math_16gpu"), *stand_in(tmp, "z", "qwen3_8b"),
                                    "--rollout.engine_kwargs", "{max_logprobs: many}"], "cuda", 8, 2),
        "engine_kwargs_bad_choice": (["--config", cfg("qwen3_30b_a3b_math_16gpu"), *stand_in(tmp, "k", "qwen3_30b_a3b"),
                                      "--rollout.engine_kwargs", "{kv_cache_dtype: int3}"], "npu", 16, 1),
        "r3_cpu": (["--config", cfg("demo_moe_cpu"), "--model.path", make_tiny_moe_model(str(tmp / "moe")),
                    "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", json.dumps([toy_data[0]]),
                    "--trainer.output_dir", str(tmp / "r3"), "--algorithm.routing_replay", "r3"], "cpu", 2, 1),
    }
    # The CUDA set's pure-Python wheels on the path, as on a cluster's login node (scripts/setup_env.sh
    # installs them there): flash-attn-4's namespace-package trap is in play, and VeOmni's own
    # probe finds liger-kernel.
    accel = [os.path.join(REPO, ".venv", "accel", name) for name in ("flash-attn-4", "liger-kernel")]
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join([REPO, *accel])}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(list(cases.values()))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reply = json.loads(proc.stdout.strip().splitlines()[-1])
    out = reply["checks"]
    assert reply["env_changed"] == [], f"the dry run left os.environ changed: {reply['env_changed']}"
    for name, checks in zip(cases, out):
        print(f"== {name}\n" + "\n".join(f"{s:<5} {n}: {d}" for n, s, d in checks))
    return {name: {n: [s, d] for n, s, d in checks} for name, checks in zip(cases, out)}


CUDA = ["qwen3_8b_math_16gpu", "qwen3_8b_math_32k_16gpu", "qwen3_8b_tool_math_16gpu", "qwen3_8b_lora_math_8gpu", "qwen3_30b_a3b_math_16gpu",
        "qwen3_vl_8b_geo3k_16gpu", "qwen3_8b_judge_16gpu", "qwen3_1_7b_from_8b_opd_16gpu", "gpu_check",
        "qwen3_vl_30b_a3b_geo3k_16gpu"]
NPU = ["qwen3_8b_math_16npu", "qwen3_vl_30b_a3b_geo3k_16npu", "moe_on_npu", "qwen3_8b_math_32k_npu"]


@pytest.mark.parametrize("name", CUDA + NPU + ["qwen3_8b_math_32k_pre_hopper"])
def test_every_shipped_accelerator_config_passes_the_dry_run(results, name):
    checks = results[name]
    assert list(checks) == ["config", "world", "attention", "veomni_ops", "vllm_engine_args", "memory"], checks
    assert all(status != "FAIL" for status, _ in checks.values()), checks


def test_the_dry_run_reports_what_each_device_would_run(results):
    assert "fused_triton" in results["qwen3_30b_a3b_math_16gpu"]["veomni_ops"][1]
    for name in CUDA:  # liger-kernel found by VeOmni's probe: its RMSNorm / SwiGLU / RoPE
        assert "rms_norm liger_kernel, swiglu liger_kernel, rope liger_kernel" in results[name]["veomni_ops"][1]
    assert "128 experts via triton, weight_load reload" in results["qwen3_30b_a3b_math_16gpu"]["config"][1]
    npu = results["qwen3_8b_math_16npu"]
    assert "VeOmni accepts on npu" in npu["veomni_ops"][1] and "experts eager" in npu["veomni_ops"][1]
    assert npu["attention"] == ["ok", npu["attention"][1]] and "npu_fusion_attention" in npu["attention"][1]
    # vLLM here is the CUDA/CPU 0.32.0; the NPU pin is 0.23.0: said, not hidden
    assert npu["vllm_engine_args"][0] == "warn" and "npu pin is vLLM 0.23.0" in npu["vllm_engine_args"][1]
    for name in CUDA:
        memory = results[name]["memory"][1]
        assert "checkpoint" in memory and "train" in memory and "generate" in memory, memory
    # flash_attn imports (the wheel's namespace package) but no entry point does on this machine
    # (flash_attn.cute needs nvidia-cutlass-dsl): never flash_attention_2. For cuda the dry run
    # resolves auto as on the GPU node it targets: an SM90+ GPU with the pinned flash-attn-4, said so
    for name in CUDA:
        assert "flash_attention_2" not in results[name]["config"][1]
    assert results["qwen3_8b_math_16gpu"]["attention"] == ["ok", results["qwen3_8b_math_16gpu"]["attention"][1]]
    assert "attention flash_attention_4" in results["qwen3_8b_math_16gpu"]["config"][1]


def test_ulysses_resolves_the_targets_flash_kernel_and_passes(results):
    """F1: the 32k recipe (ulysses_size 2) on cuda resolves flash-attn-4 (assumed SM90+: said in the
    attention line) and VeOmni's Ulysses flash path; on npu npu_fusion_attention through the same path;
    on GPUs older than Hopper (--pre-hopper) sdpa, the project's own Ulysses path. All pass."""
    cuda, npu, old = (results[n] for n in ("qwen3_8b_math_32k_16gpu", "qwen3_8b_math_32k_npu",
                                           "qwen3_8b_math_32k_pre_hopper"))
    assert "attention flash_attention_4" in cuda["config"][1] and "assumed for the dry run" in cuda["attention"][1]
    assert "attention veomni_flash_attention_4_with_sp" in cuda["veomni_ops"][1]
    assert "attention flash_attention_2" in npu["config"][1] and "veomni_flash_attention_2_with_sp" in npu["veomni_ops"][1]
    assert "attention sdpa" in old["config"][1] and old["attention"][0] == "warn"


def test_the_judge_recipe_plans_its_judging_phase(results):
    """The judge's engine keywords go through vLLM's create_engine_config too; the plan has a judging phase."""
    checks = results["qwen3_8b_judge_16gpu"]
    assert "and those of judge(s) clarity and builds each engine's config" in checks["vllm_engine_args"][1]
    assert " judge " in checks["memory"][1] and checks["memory"][0] == "ok", checks["memory"]


def test_the_distillation_recipe_plans_its_teacher_phase(results):
    """The teacher's engine keywords go through vLLM's create_engine_config; the plan has a teacher phase that fits."""
    checks = results["qwen3_1_7b_from_8b_opd_16gpu"]
    assert "and the distillation teacher's and builds each engine's config" in checks["vllm_engine_args"][1]
    assert " teacher " in checks["memory"][1] and checks["memory"][0] == "ok", checks["memory"]


def test_vllm_builds_every_engine_config_and_says_what_stays_advisory(results):
    """vLLM's create_engine_config runs for every engine on this CPU platform without the device-only
    switches; what only the device's platform decides is named, not claimed."""
    for name in CUDA:
        status, detail = results[name]["vllm_engine_args"]
        assert status == "ok" and "config (create_engine_config on this machine's cpu platform" in detail, detail
        assert "enable_sleep_mode left out" in detail and "advisory until the cuda run: block size" in detail
        assert "CUDA graph sizes, gpu_memory_utilization, sleep mode, kernels" in detail
    npu = results["qwen3_8b_math_16npu"]["vllm_engine_args"][1]
    assert "advisory until the npu run" in npu and "vllm-ascend's own checks" in npu


def test_what_vllm_refuses_fails_the_dry_run_with_its_reason(results):
    """Configs the former EngineArgs-only dry run passed: vLLM's own validation names the reason."""
    judge = results["judge_context_too_long"]["vllm_engine_args"]
    assert judge[0] == "FAIL" and "judge 'clarity' refuses the engine config" in judge[1], judge
    assert "max_model_len (65536) is greater than the derived max_model_len (max_position_embeddings=40960" in judge[1]
    r3 = results["r3_cuda_without_prefix_caching"]["vllm_engine_args"]
    assert r3[0] == "FAIL" and "AuxOutput Connector requires prefix caching" in r3[1], r3


def test_r3_is_judged_by_vllm_with_its_v2_model_runner(results):
    """R3 (vLLM returns routed experts): this CPU host's vLLM refuses it (its own check, V2 model
    runner); for CUDA the dry run forces the V2 runner so vLLM's other R3 requirements run."""
    cuda, cpu = results["r3_cuda"]["vllm_engine_args"], results["r3_cpu"]["vllm_engine_args"]
    assert cuda[0] == "ok" and "config with r3 (" in cuda[1] and "V2 model runner forced for r3" in cuda[1], cuda
    assert cpu[0] == "FAIL" and "AuxOutput Connector requires Model Runner V2" in cpu[1]


def test_r3_on_npu_is_judged_with_the_runner_vllm_ascend_runs(results):
    """R3 for npu: on the Ascend pin (vLLM 0.23, the NPU twin) vllm-ascend runs its V1-derived NPU runner,
    which returns routed experts, so the dry run judges R3 with vLLM's V1 runner and passes (forcing
    V2, as for CUDA, made vLLM 0.23 refuse it: "Model Runner V2 does not yet support: routed experts
    capture", a verdict about a runner Ascend never runs, rollout.dry_check.r3_runner). With vLLM 0.32
    installed (not the npu pin: the warning says so) the V2 runner is forced, as 0.32's V1 refuses R3."""
    import vllm

    status, detail = results["r3_npu"]["vllm_engine_args"]
    assert "builds the engine's config with r3 (" in detail, detail
    if vllm.__version__ == "0.23.0":
        assert status == "ok" and "V1 model runner for r3, as vllm-ascend 0.23's NPU runner" in detail, detail
    else:
        assert status == "warn" and "V2 model runner forced for r3" in detail, detail
        assert "(the npu pin is vLLM 0.23.0: install the cluster's set here)" in detail, detail


def test_the_seed_run_passes_on_an_ascend_a3_node(results):
    """configs/qwen3_vl_30b_a3b_geo3k_16npu.yaml (MoE + images, EP 16, TP 8, AnyPrecision AdamW) on 16
    NPUs of 64 GB: resolved for npu (VeOmni's fused_npu experts, its flash path), vLLM's engine config
    built, and every phase of the memory plan fits (the figures in the recipe's comment)."""
    checks = results["qwen3_vl_30b_a3b_geo3k_16npu"]
    assert "128 experts via npu, weight_load reload, sleep_level 2, enforce_eager False" in checks["config"][1]
    assert "experts fused_npu" in checks["veomni_ops"][1]
    assert checks["memory"] == ["ok", "GB per rank of 64: generate 51.2, sync 17.9, train 39.2, checkpoint 41.3 "
                                      "(limit 61.0)"], checks["memory"]
    twin = results["qwen3_vl_30b_a3b_geo3k_16gpu"]
    assert "128 experts via triton" in twin["config"][1] and "experts fused_triton" in twin["veomni_ops"][1]
    assert "GB per rank of 80: generate 72.0, sync 17.9, train 39.6, checkpoint 41.3" in twin["memory"][1], twin["memory"]


def test_expert_parallel_and_engine_kwargs_go_through_vllms_engine_config(results):
    """rollout.enable_expert_parallel on a MoE model passes vLLM's create_engine_config for cuda and
    npu (one more LLM keyword each; engine_kwargs' max_logprobs one more again), and engine_kwargs
    values vLLM refuses fail the dry run with vLLM's own message."""
    base = results["qwen3_30b_a3b_math_16gpu"]["vllm_engine_args"][1]
    count = lambda d: int(d.split(" accepts all ")[1].split()[0])  # noqa: E731
    assert results["ep_cuda"]["vllm_engine_args"][0] == "ok"
    assert count(results["ep_cuda"]["vllm_engine_args"][1]) == count(base) + 2
    assert results["ep_cuda"]["memory"] == results["qwen3_30b_a3b_math_16gpu"]["memory"]  # E / tp experts: same bytes
    assert results["ep_npu"]["vllm_engine_args"][0] == "warn"  # the npu pin note, as for every npu config
    assert count(results["ep_npu"]["vllm_engine_args"][1]) == count(results["moe_on_npu"]["vllm_engine_args"][1]) + 1
    status, detail = results["engine_kwargs_bad_type"]["vllm_engine_args"]
    assert status == "FAIL" and "(with rollout.engine_kwargs {'max_logprobs': 'many'})" in detail
    assert "Input should be a valid integer" in detail, detail
    status, detail = results["engine_kwargs_bad_choice"]["vllm_engine_args"]
    assert status == "FAIL" and "Input should be 'auto', 'float16', 'bfloat16', 'fp8'" in detail, detail


def test_the_script_exits_2_naming_the_failed_check(tmp_path):
    """The command a user runs: one line per check, exit 2 and the failed checks named."""
    args = stand_in(tmp_path, "m", "qwen3_30b_a3b")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_config.py"), "--config",
                           os.path.join(REPO, "configs", "qwen3_30b_a3b_math_16gpu.yaml"), "--device", "npu",
                           "--nproc", "16", "--", *args, "--rollout.emulate_sleep", "true"], cwd=REPO,
                          env={**os.environ, **QUIET_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "check FAILED on npu x 16: config", proc.stdout
    assert proc.stdout.startswith("FAIL  config: rollout.emulate_sleep=true is for CPU runs")


@pytest.mark.unit
@pytest.mark.parametrize("recipe", ["qwen3_vl_30b_a3b_geo3k_16npu", "qwen3_vl_30b_a3b_geo3k_16gpu"])
def test_the_seed_recipe_holds_the_seed_runs_settings(recipe):
    """The settings the design was validated with (Qwen3-VL-30B-A3B GRPO on Geometry3K), in both recipes."""
    import yaml

    c = yaml.safe_load(open(os.path.join(REPO, "configs", f"{recipe}.yaml")))
    r, a, o, t = c["rollout"], c["algorithm"], c["optim"], c["trainer"]
    assert (r["n"], r["tensor_parallel_size"], r["enforce_eager"], r["sleep_level"], r["free_kv_cache"]) == (5, 8, False, 2, True)
    assert (r["max_response_length"], c["data"]["max_prompt_length"], c["data"]["truncation"]) == (2048, 2048, "filter")
    assert (t["prompts_per_step"], a["mini_batches"], a["micro_batch_size"], t["total_steps"]) == (256, 2, 2, 120)
    assert (o["optimizer"], o["lr"], a["kl_loss_coef"], a["kl_loss_type"], a["entropy_coef"]) == (
        "anyprecision_adamw", 1e-6, 0.01, "low_var_kl", 0.0)
    assert c["model"]["gradient_checkpointing"] and all(c["offload"][k] for k in ("params", "optimizer", "ref"))
    assert t["val_before_train"] and c["parallel"]["ep_size"] == (16 if recipe.endswith("npu") else 8)
    if recipe.endswith("npu"):  # the seed run's "chunked prefill off" (the CUDA twin keeps vLLM's default)
        assert r["enable_chunked_prefill"] is False


def test_a_hub_name_as_model_path_exits_2_with_how_to_download_it(tmp_path):
    """A converted verl script keeps verl's hub name in model.path: the dry run stops at the
    trainer's own check (exit 2, how to download the model), never reaching huggingface_hub through
    vLLM's EngineArgs (a traceback before). With rollout expert parallelism the resolve says the
    same instead of calling the model dense."""
    data = tmp_path / "d.jsonl"
    data.write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: Qwen/Qwen3-30B-A3B}}\ndata: {{train_files: [{data}]}}\n"
                   "rollout: {tensor_parallel_size: 2, enable_expert_parallel: true}\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_config.py"), "--config", str(cfg),
                           "--device", "cuda", "--nproc", "2"], cwd=tmp_path, env={**os.environ, **QUIET_ENV},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("FAIL  config: model.path='Qwen/Qwen3-30B-A3B' is invalid: no config.json there"), first
    assert "hf download Qwen/Qwen3-30B-A3B --local-dir /models/Qwen3-30B-A3B" in first
    assert "dense" not in proc.stdout


@pytest.mark.unit
def test_expert_parallel_on_an_unreadable_model_is_not_called_dense(tmp_path):
    from rlcore.config import ConfigError
    from rlcore.config.cli import _parse
    from rlcore.rollout.engine_keys import check_config

    cfg = _parse(["--model.path", "Qwen/Qwen3-30B-A3B", "--rollout.tensor_parallel_size", "2",
                  "--rollout.enable_expert_parallel", "true"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg, "cuda")
    assert "dense" not in str(e.value) and "hf download Qwen/Qwen3-30B-A3B" in str(e.value)
