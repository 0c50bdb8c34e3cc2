"""rollout.enable_chunked_prefill, rollout.enable_expert_parallel and rollout.engine_kwargs
(rlcore/rollout/engine_keys.py): how they enter the policy engine's ``LLM(...)`` keywords, what is
refused and why, and real CPU engines: an engine_kwargs value read back from the built engine and
acting on vLLM's requests, and vLLM's CPU expert-parallel engine crashing as the refusal says.
The dry-run cases (cuda/npu create_engine_config) are in tests/test_check_config.py, the exit-2
cases in tests/test_bad_inputs.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import QUIET_ENV, REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "engine_keys_worker.py")


@pytest.fixture(autouse=True)
def nz_env_kept(monkeypatch):
    """llm_kwargs for npu sets VLLM_ASCEND_ENABLE_NZ=0 and VLLM_ASCEND_ENABLE_FUSED_MC2=0 in os.environ
    (rollout.settings.disable_npu_nz): undone after."""
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_FUSED_MC2", "0")


def kwargs(device: str = "cuda", **extra) -> dict:
    from rlcore.rollout.settings import llm_kwargs

    return llm_kwargs("/m", device, tp_size=2, seed=3, max_model_len=256, dtype="bfloat16", kv_cache_gb=0.1,
                      gpu_memory_utilization=0.5, enforce_eager=False, multimodal=False, speed={}, **extra)


@pytest.mark.unit
def test_engine_kwargs_are_merged_last_and_nothing_else_moves():
    base = kwargs()
    got = kwargs(engine_kwargs={"max_logprobs": 5, "disable_log_stats": False})
    assert got == {**base, "max_logprobs": 5, "disable_log_stats": False}
    assert list(got)[-2:] == ["max_logprobs", "disable_log_stats"]  # last: after every key the rollout sets


@pytest.mark.unit
def test_additional_config_merges_key_by_key_and_keeps_nz_off():
    got = kwargs("npu", engine_kwargs={"additional_config": {"enable_shared_expert_dp": True}})
    assert got["additional_config"] == {"enable_shared_expert_dp": True, "weight_nz_mode": 0, "enable_fused_mc2": 0}
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"additional_config.weight_nz_mode=1 is refused: vllm-ascend's NZ"):
        kwargs("npu", engine_kwargs={"additional_config": {"weight_nz_mode": 1}})


@pytest.mark.unit
def test_fused_mc2_is_refused_and_turned_off_on_npu(monkeypatch, caplog):
    """Issue 66 F3: vllm-ascend 0.23.0 casts the experts to NZ whenever fused MC2 is on, whatever
    weight_nz_mode says, and with dynamic EPLB deletes them (ops/fused_moe/fused_moe.py:127-135). Its
    switch is additional_config.enable_fused_mc2, else VLLM_ASCEND_ENABLE_FUSED_MC2
    (ascend_config.py:173-178, 354-365): the key is refused, and on npu both are set to 0 (the env var
    with a warning naming it); other devices leave the env var alone."""
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"additional_config.enable_fused_mc2=1 is refused: vllm-ascend casts the "
                                          r"experts to the NZ format .*fused_moe.py:127-130.*deletes w13_weight"):
        kwargs("npu", engine_kwargs={"additional_config": {"enable_fused_mc2": 1}})
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_FUSED_MC2", "1")
    with caplog.at_level("WARNING", logger="rlcore.rollout"):
        got = kwargs("npu")
    assert got["additional_config"] == {"weight_nz_mode": 0, "enable_fused_mc2": 0}
    assert os.environ["VLLM_ASCEND_ENABLE_FUSED_MC2"] == "0"
    assert "VLLM_ASCEND_ENABLE_FUSED_MC2=1 overridden to 0: fused MC2 casts the experts to NZ" in caplog.text
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_FUSED_MC2", "1")
    assert "additional_config" not in kwargs("cuda") and os.environ["VLLM_ASCEND_ENABLE_FUSED_MC2"] == "1"


@pytest.mark.unit
def test_load_format_is_refused():
    """Issue 66 F6: ``load_format: dummy`` would have vLLM start from random weights, which the first
    rollout samples from before any sync: refused, naming why."""
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.load_format='dummy' is refused: the rollout sets "
                                          r"load_format itself; the engine must load model.path's safetensors"):
        kwargs(engine_kwargs={"load_format": "dummy"})


def test_every_key_the_rollout_sets_is_owned_and_named():
    """Every keyword llm_kwargs can produce (all switches on) is refused in engine_kwargs, so a
    free-form value never silently replaces one the rollout decided. (Imports vLLM: LoRA's ranks.)"""
    from rlcore.rollout import engine_keys, lora

    every = {**kwargs("cpu", routed_experts=True, runner="pooling", trust_remote_code=True,
                      limit_mm_per_prompt={"image": 1}),
             **kwargs("npu", sleep_mode=True, enable_chunked_prefill=True, expert_parallel=True),
             **lora.engine_kwargs(8)}
    every.pop("mm_processor_cache_gb", None)  # a tuning knob with no rollout key: engine_kwargs may set it
    assert set(every) - set(engine_keys.OWNED) == {"additional_config"}  # merged key by key instead
    for key, why in engine_keys.OWNED.items():
        with pytest.raises(ValueError, match=rf"rollout.engine_kwargs.{key}=1 is refused: the rollout sets {key} "
                                             rf"itself; "):
            engine_keys.check_keys({key: 1})
        assert why.startswith(("use ", "it ", "the ", "each ")), why  # the key to use, or why it is fixed


def test_owned_fields_exist_in_this_vllm():
    from vllm.engine.arg_utils import EngineArgs

    from rlcore.rollout import engine_keys

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(engine_keys.OWNED) <= fields, set(engine_keys.OWNED) - fields


@pytest.mark.unit
def test_unknown_names_get_the_closest_fields():
    from rlcore.errors import ConfigError
    from rlcore.rollout.engine_keys import check_fields

    fields = ["max_logprobs", "max_loras", "disable_log_stats", "swap_space"]
    with pytest.raises(ConfigError, match=r"engine_kwargs.max_logprob is invalid: .* did you mean max_logprobs, "
                                          r"max_loras\?"):
        check_fields({"max_logprob": 5}, fields)
    with pytest.raises(ConfigError, match=r"no field 'zzz'; see vLLM's EngineArgs"):
        check_fields({"zzz": 1}, fields)
    check_fields({"swap_space": 4}, fields)


@pytest.mark.unit
@pytest.mark.parametrize("device,value,expected", [
    ("cpu", None, {"enable_chunked_prefill": False}), ("cpu", False, {"enable_chunked_prefill": False}),
    ("cuda", None, {}), ("cuda", True, {"enable_chunked_prefill": True}), ("npu", False, {"enable_chunked_prefill": False})])
def test_chunked_prefill_per_device(device, value, expected):
    from rlcore.rollout.engine_keys import chunked_prefill_kwargs

    assert chunked_prefill_kwargs(device, value) == expected
    got = kwargs(device, enable_chunked_prefill=value)
    assert {k: v for k, v in got.items() if k == "enable_chunked_prefill"} == expected


def test_chunked_prefill_true_on_cpu_is_refused_with_the_vllm_line():
    """The line the refusal cites is what vLLM 0.32.0 runs: a discarded partial prefill rewinds a
    seeded request's generator with set_offset, which a CPU generator lacks."""
    import torch
    from vllm.v1.worker import gpu_model_runner

    from rlcore.rollout.engine_keys import chunked_prefill_kwargs

    with pytest.raises(ValueError, match="gpu_model_runner.py:3499-3502"):
        chunked_prefill_kwargs("cpu", True)
    lines = open(gpu_model_runner.__file__).read().splitlines()
    assert "gen.set_offset(gen.get_offset() - 4)" in lines[3501]
    with pytest.raises(RuntimeError, match="offset"):
        torch.Generator().set_offset(4)


def test_expert_parallel_keyword_and_the_vllm_source_behind_it():
    """vLLM's EP is ep_size = tp_size with the MoE's own TP 1 (fused_moe/config.py:1189-1236), and
    its CPU experts drop the expert map (cpu_moe.py:279, :303-315): the cited lines, read here."""
    import inspect

    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from rlcore.rollout.engine_keys import expert_parallel_kwargs

    assert expert_parallel_kwargs(True, "cuda") == {"enable_expert_parallel": True}
    assert expert_parallel_kwargs(False, "cpu") == {} and kwargs("npu", expert_parallel=True)["enable_expert_parallel"]
    with pytest.raises(ValueError, match="cpu_moe.py:279"):
        kwargs("cpu", expert_parallel=True)
    src = open(moe_config.__file__).read().splitlines()
    assert src[1188].strip() == "use_ep = (" and src[1220].strip() == "ep_size = tp_size"
    apply = inspect.getsource(cpu_moe.CPUUnquantizedExperts.apply)
    call = apply[apply.index("cpu_fused_moe("):]
    assert "expert_map" in apply[:apply.index("cpu_fused_moe(")] and "expert_map" not in call
    assert not hasattr(cpu_moe.CPUUnquantizedExperts, "supports_expert_map") or \
        "supports_expert_map" not in vars(cpu_moe.CPUUnquantizedExperts)


def test_an_engine_kwargs_value_takes_effect_in_a_real_cpu_engine(tiny_model, tmp_path):
    """ColocateRollout with engine_kwargs {max_logprobs: 3}: the built engine's config says 3
    (vLLM's default: 20), vLLM refuses a request for 4 log-probs and serves 3, and the rollout's
    samples still match a transformers forward (fp32, 1e-4)."""
    out = tmp_path / "kw.json"
    run_torchrun(WORKER, 1, "kwargs", tiny_model, str(out))
    got = json.loads((tmp_path / "kw.json.0").read_text())
    assert got["max_logprobs"] == 3
    assert "greater than max allowed: 3" in got["four_refused"], got
    assert all(3 <= k <= 4 for k in got["three_served"]), got  # top 3, plus the sampled token when outside them
    assert got["max_diff"] < 1e-4, got


def test_vllm_cpu_expert_parallel_engine_crashes_as_the_refusal_says(tmp_path):
    """vLLM's own TP-2 engine with enable_expert_parallel on the tiny Qwen3-MoE (the rollout's refusal
    bypassed) dies in its CPU fused-MoE kernel. If a vLLM upgrade makes this pass, lift the refusal
    (rollout.engine_keys.CPU_EP_REFUSAL)."""
    from rlcore.demo.toy import make_tiny_moe_model

    model = make_tiny_moe_model(str(tmp_path / "moe"))
    out = tmp_path / "ep.json"
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           WORKER, "ep", model, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and not (tmp_path / "ep.json.0").exists(), proc.stdout[-2000:]
    assert "SIGSEGV" in proc.stderr and "cpu_fused_moe" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.unit
@pytest.mark.parametrize("fixture,tp", [("qwen3_30b_a3b", 8), ("qwen3_vl_30b_a3b", 8), ("qwen3_30b_a3b", 4)])
def test_expert_parallel_leaves_the_memory_plan_unchanged_for_the_shipped_moe_models(fixture, tp):
    """Why rlcore/plan/memory.py takes no EP term. Weights: EP gives each rank E / tp whole experts,
    TP gives it 1 / tp of every expert: the same bytes when tp divides E (vLLM's expert map hands
    the remainder to the first ranks otherwise). Temporaries: the fused-MoE workspaces are (M, topk,
    max(I_local, K)) and (M, topk, max(2 I_local, K)) (vllm 0.32.0 fused_moe/experts/triton_moe.py:
    237-239), I_local = I / tp under TP and I under EP (the MoE's own TP is 1): equal while 2I <= K."""
    with open(os.path.join(REPO, "tests", "fixtures", fixture, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    experts, inter, hidden = c["num_experts"], c["moe_intermediate_size"], c["hidden_size"]
    expert_bytes = 3 * hidden * inter  # gate, up, down of one expert
    assert experts % tp == 0 and experts // tp * expert_bytes == experts * expert_bytes // tp
    workspace = lambda i: max(i, hidden) + max(2 * i, hidden)  # noqa: E731  per (token, top-k slot)
    assert workspace(inter) == workspace(inter // tp) == 2 * hidden


@pytest.mark.unit
def test_colocate_rollout_hands_the_keys_to_llm(monkeypatch):
    """ColocateRollout(vllm={...}) (what rlcore/run/build.py passes from the rollout section) reaches
    ``LLM(...)``, on tests/test_rollout_accel.py's fake vLLM (its EngineArgs given the two fields
    these keys add; both exist in the 0.23.0 and 0.32.0 pins)."""
    import test_rollout_accel as accel

    monkeypatch.setattr(accel, "ENGINE_ARGS", [*accel.ENGINE_ARGS, "enable_expert_parallel", "max_logprobs"])
    accel.fake_vllm.__wrapped__(monkeypatch)  # the fixture's body: a fake vllm in sys.modules
    accel.make("cuda", vllm=dict(enable_chunked_prefill=True, expert_parallel=True,
                                 engine_kwargs={"max_logprobs": 5}))
    built = accel.FakeLLM.built[-1]
    assert (built["enable_chunked_prefill"], built["enable_expert_parallel"], built["max_logprobs"]) == (True, True, 5)
    accel.make("cpu")
    assert accel.FakeLLM.built[-1]["enable_chunked_prefill"] is False
    assert "enable_expert_parallel" not in accel.FakeLLM.built[-1]
