"""Accelerator-only paths of the colocated rollout (issue 12, findings 3-6 and speed settings).

The ``unit`` tests drive ``ColocateRollout`` and ``rlcore.rollout.checks`` against small fakes of
vLLM's LLM / worker / model (no vLLM import, no engine); each fake mirrors the pinned source it
stands for, cited where it matters (docs/accelerators.md has the table). The last tests read a
real tp=2 engine on 2 CPU ranks (tests/workers/accel_worker.py, one launch shared with
tests/test_vllm_api.py).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace as NS

import numpy as np
import torch
import pytest

import rlcore.colocate_rollout as cr
from rlcore.dist import DistInfo
from rlcore.rollout import checks as rc, settings as rs

# ----------------------------------------------------------------------------- fakes

# vLLM fuses q/k/v and gate/up into one parameter each; load_weights reports vLLM names.
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
HF_NAMES = ["model.embed_tokens.weight"] + [
    f"model.layers.0.{m}.{p}.weight" for m, ps in (("self_attn", "q_proj k_proj v_proj o_proj"),
                                                     ("mlp", "gate_proj up_proj down_proj")) for p in ps.split()
] + ["model.norm.weight"]


def vllm_name(hf: str) -> str:
    parts = hf.split(".")
    return ".".join(FUSED.get(p, p) for p in parts)


class FusedMoE:  # stands for vllm 0.23 / vllm-ascend's FusedMoE (matched by class name; 0.32's real MoERunner: test_vl_moe)
    pass


class AscendFusedMoE(FusedMoE):
    pass


class FakeModel:
    """vLLM model: its own (fused) parameter names; load_weights returns the names it loaded, as
    vLLM's AutoWeightsLoader does (vllm 0.32.0 model_loader/reload/inplace.py:95 uses it)."""

    def __init__(self, moe: bool = False):
        self.params = sorted({vllm_name(n) for n in HF_NAMES})
        self.moe = moe
        self.loads = 0

    def named_parameters(self):
        return [(n, None) for n in self.params]

    def modules(self):
        return [self] + ([AscendFusedMoE()] if self.moe else [])

    def named_modules(self):  # no fused-expert Parameters: rollout.expert_layout keeps nothing
        return [("", m) for m in self.modules()]

    def load_weights(self, weights):
        self.loads += 1
        return {vllm_name(n) for n, _ in weights}


def fake_sampler(mode: str = "processed_logprobs"):
    """vLLM's Sampler: logprobs_mode on itself and on its top-k/top-p sampler (vllm 0.23.0
    v1/sample/sampler.py:67-69). vllm-ascend 0.23.0 builds it with "raw_logprobs" whatever the
    engine says (vllm_ascend/worker/model_runner_v1.py:333)."""
    return NS(logprobs_mode=mode, topk_topp_sampler=NS(logprobs_mode=mode))


class FakeWorker:
    def __init__(self, model, has_reload: bool, runner_has_reload: bool = False, sampler_mode: str = "processed_logprobs"):
        self.model_runner = NS(get_model=lambda: model, kv_caches=[], sampler=fake_sampler(sampler_mode))
        self.vllm_config = NS()
        reload = lambda weights_iterator=None, weights_path=None: model.load_weights(weights_iterator or [])  # noqa: E731
        if has_reload:  # vllm 0.32.0 gpu_worker.py:629 -> model_runner.reload_weights -> model.load_weights
            self.reload_weights = reload
        if runner_has_reload:  # vllm 0.23.0 gpu_model_runner.py:5320 (inherited by vllm-ascend's NPUModelRunner)
            self.model_runner.reload_weights = reload


class FakeLLMWithoutKVRelease:
    """vllm.LLM as the rollout uses it, as in vllm 0.26.0 / 0.23.0 (no release_kv_cache_memory).
    ``generate`` seeds an unseeded request from numpy's GLOBAL RNG, exactly like vllm 0.32.0's
    V2 runner (v1/worker/gpu/sample/states.py:54-57)."""

    built: list[dict] = []
    model_moe = False
    worker_has_reload = True
    runner_has_reload = False
    sampler_mode = "processed_logprobs"  # what the engine's kwarg gives on CUDA/CPU

    def __init__(self, **kwargs):
        FakeLLM.built.append(kwargs)
        self.model = FakeModel(moe=FakeLLM.model_moe)
        self.worker = FakeWorker(self.model, FakeLLM.worker_has_reload, FakeLLM.runner_has_reload,
                                 FakeLLM.sampler_mode)
        self.rpcs: list = []
        vllm_config = NS(model_config=NS(dtype=kwargs.get("dtype"), enforce_eager=kwargs["enforce_eager"]),
                         cache_config=NS(enable_prefix_caching=kwargs.get("enable_prefix_caching", True)),
                         scheduler_config=NS(max_num_seqs=kwargs.get("max_num_seqs", 256),
                                             max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 8192)))
        self.llm_engine = NS(model_executor=NS(driver_worker=NS(worker=self.worker)), vllm_config=vllm_config)
        self.engine_seeds: list[int] = []
        self.calls: list[str] = []

    def generate(self, inputs, params, use_tqdm=False):
        outs = []
        for x, p in zip(inputs, params if isinstance(params, list) else [params] * len(inputs)):
            seed = p.seed if p.seed is not None else int(np.random.randint(0, 2**62))
            self.engine_seeds.append(seed)
            prompt_lp = [None] + [{t: NS(logprob=-0.5)} for t in x["prompt_token_ids"][1:]]  # prompt_logprobs=0
            outs.append(NS(outputs=[NS(token_ids=[seed % 97 + i], logprobs=[{seed % 97 + i: NS(logprob=-1.0)}],
                                       finish_reason="length") for i in range(getattr(p, "n", 1))],
                           prompt_logprobs=prompt_lp,
                           prompt_token_ids=list(x["prompt_token_ids"])))  # RequestOutput's (vllm 0.32.0 outputs.py)
        return outs

    def collective_rpc(self, method, kwargs=None):
        # A name is looked up on the worker, a callable gets the worker first (vllm 0.23.0
        # v1/serial_utils.py:486-510).
        self.rpcs.append(method)
        func = getattr(self.worker, method) if isinstance(method, str) else (lambda **kw: method(self.worker, **kw))
        return func(**(kwargs or {}))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")



class FakeLLM(FakeLLMWithoutKVRelease):  # vllm 0.32.0 (entrypoints/llm.py:861)
    def release_kv_cache_memory(self):
        self.calls.append("release_kv_cache_memory")


# vllm 0.23.0 engine/arg_utils.py: model 415, dtype 435, seed 437, max_model_len 438,
# distributed_executor_backend 449, tensor_parallel_size 465, block_size 504, enable_prefix_caching 505,
# gpu_memory_utilization 518, kv_cache_memory_bytes 519, max_num_batched_tokens 520, max_num_seqs 524,
# logprobs_mode 526, enforce_eager 543, enable_sleep_mode 661, additional_config 685, use_tqdm_on_load 687;
# enable_chunked_prefill (an EngineArgs field since vLLM 0.4; CPU only: rollout.engine_keys.chunked_prefill_kwargs).
ENGINE_ARGS = ("model dtype seed max_model_len distributed_executor_backend tensor_parallel_size enable_prefix_caching "
               "gpu_memory_utilization kv_cache_memory_bytes max_num_batched_tokens max_num_seqs logprobs_mode "
               "enforce_eager enable_sleep_mode additional_config use_tqdm_on_load enable_chunked_prefill block_size").split()


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake ``vllm`` package in sys.modules; the rollout imports it lazily."""
    FakeLLM.built, FakeLLM.model_moe, FakeLLM.worker_has_reload = [], False, True
    FakeLLM.runner_has_reload, FakeLLM.sampler_mode = False, "processed_logprobs"
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: NS(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    config = types.ModuleType("vllm.config")
    config.set_current_vllm_config = lambda cfg: nullcontext()
    arg_utils = types.ModuleType("vllm.engine.arg_utils")  # the LLM kwargs vllm 0.23.0 and 0.32.0 accept
    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", [(k, object, None) for k in ENGINE_ARGS])
    for name, m in (("vllm", mod), ("vllm.inputs", inputs), ("vllm.config", config),
                    ("vllm.engine.arg_utils", arg_utils)):
        monkeypatch.setitem(sys.modules, name, m)
    from rlcore.rollout import process_state

    monkeypatch.setattr(process_state, "accel_module", lambda device_type: None)  # no torch.cuda/npu RNG here
    monkeypatch.delenv(rs.NZ_ENV, raising=False)
    monkeypatch.delenv(rs.FUSED_MC2_ENV, raising=False)
    return mod


def make(device: str, rank: int = 0, world: int = 1, **kw) -> cr.ColocateRollout:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world, device_type=device,
                    backend="gloo")
    return cr.ColocateRollout("/model", info, **kw)


# ----------------------------------------------------------------------------- finding 3: NZ


@pytest.mark.unit
def test_nz_turned_off_on_npu_only(fake_vllm, monkeypatch):
    import os

    make("npu")
    assert os.environ[rs.NZ_ENV] == "0", "vllm-ascend NPUWorker.wake_up raises while NZ is on"
    assert FakeLLM.built[-1]["additional_config"] == {"weight_nz_mode": 0, "enable_fused_mc2": 0}  # key wins over env
    for device in ("cpu", "cuda"):
        monkeypatch.setenv(rs.NZ_ENV, "2")
        make(device)
        assert os.environ[rs.NZ_ENV] == "2" and "additional_config" not in FakeLLM.built[-1]
    env = {rs.NZ_ENV: "1"}
    assert rs.disable_npu_nz("npu", env) and env[rs.NZ_ENV] == "0"
    env = {}
    assert rs.disable_npu_nz("cuda", env) == {} and env == {}


# ----------------------------------------------------------------------------- finding 4: load path


@pytest.mark.unit
def test_weight_load_choice_per_platform():
    assert rs.pick_weight_load("cuda", "auto") == "direct"
    assert rs.pick_weight_load("npu", "auto") == "direct"  # vllm-ascend 0.23 NPUWorker: no reload_weights
    assert rs.pick_weight_load("cpu", "auto") == "reload"  # oneDNN repacking needs vLLM's reload
    assert rs.pick_weight_load("npu", "reload") == "reload"
    assert rs.pick_weight_load("cuda", "auto", moe=True) == "reload"  # fused-MoE post-processing
    with pytest.raises(ValueError, match="CPU"):
        rs.pick_weight_load("cpu", "direct")
    with pytest.raises(ValueError):
        rs.pick_weight_load("cuda", "fast")
    for device in ("cuda", "npu"):  # no fused-MoE backend is known to need no post-load step
        with pytest.raises(ValueError, match="not supported for mixture-of-experts models.*use reload"):
            rs.pick_weight_load(device, "direct", moe=True)


@pytest.mark.unit
def test_weight_load_checked_against_the_built_worker(fake_vllm):
    FakeLLM.worker_has_reload = False  # a worker and runner without reload_weights
    assert make("npu").weight_load == "direct"
    with pytest.raises(RuntimeError, match="no reload_weights"):
        make("npu", weight_load="reload")
    FakeLLM.worker_has_reload, FakeLLM.model_moe = True, True
    with pytest.raises(RuntimeError, match="MoE"):  # vllm-ascend re-lays experts out after loading
        make("npu")
    assert make("npu", weight_load="reload").weight_load == "reload"
    with pytest.raises(RuntimeError, match="MoE experts on cuda"):  # vLLM's FlashInfer MoE backends re-lay them too
        make("cuda")
    assert make("cuda", weight_load="reload").weight_load == "reload"


# ----------------------------------------------------------------------------- finding 5: level 2


@pytest.mark.unit
@pytest.mark.parametrize("weight_load", ["direct", "reload"])
def test_level2_push_must_write_every_parameter(fake_vllm, weight_load):
    ro = make("cuda", weight_load=weight_load)
    ro.release_memory()  # sleep level 2 (auto)
    ro.resume_memory(["weights"])
    assert not ro.weights_valid and ro.llm.calls[:2] == ["sleep(2)", "wake_up(['weights'])"]
    skip = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(RuntimeError) as e:
        ro.update_weights(((n, torch.zeros(1)) for n in HF_NAMES if n not in skip), full=True)
    assert all(n in str(e.value) for n in skip), str(e.value)
    assert not ro.weights_valid
    assert ro.update_weights(((n, torch.zeros(1)) for n in HF_NAMES), full=True) == len(HF_NAMES)
    assert ro.weights_valid
    # Later partial pushes (full=False) are allowed; the spy is gone from the model.
    ro.update_weights(iter([(HF_NAMES[0], torch.zeros(1))]), full=False)
    assert "load_weights" not in vars(ro.llm.model)


@pytest.mark.unit
def test_level2_missing_shard_of_fused_param(fake_vllm):
    """vLLM reports a fused parameter (gate_up_proj) loaded once any shard arrived, so a missing
    up_proj passes the vLLM-name check; the HF-name check against the previous full push catches it."""
    ro = make("cuda")
    ro.update_weights((n, torch.zeros(1)) for n in HF_NAMES)  # a full push: its names are the reference
    ro.release_memory()
    ro.resume_memory()
    with pytest.raises(RuntimeError, match="up_proj"):
        ro.update_weights((n, torch.zeros(1)) for n in HF_NAMES if "up_proj" not in n)
    assert not ro.weights_valid


@pytest.mark.unit
def test_completeness_helpers():
    model = FakeModel()
    assert rc.missing_params(model, model.params) == []
    with rc.capture_load_weights(model) as calls:
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", None)])
    assert calls == [{"model.layers.0.self_attn.qkv_proj.weight"}] and "load_weights" not in vars(model)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        rc.require_all_loaded(model, calls, "push")
    rc.require_all_loaded(model, [None], "push")  # a model that does not report: warned, not raised


# ----------------------------------------------------------------------------- finding 6: seeds


@pytest.mark.unit
def test_unseeded_generate_sends_seeded_requests(fake_vllm):
    """TP ranks with different numpy states must still agree; the fake engine would seed an
    unseeded request from numpy's global RNG like vLLM 0.32's V2 runner."""
    tp0, tp1 = make("cuda", rank=0, world=4, tp_size=2), make("cuda", rank=1, world=4, tp_size=2)
    other_dp = make("cuda", rank=2, world=4, tp_size=2)
    samples = {}
    for name, ro, np_seed in (("tp0", tp0, 1), ("tp1", tp1, 2), ("dp1", other_dp, 1)):
        np.random.seed(np_seed)
        before = np.random.get_state()[1].copy()
        samples[name] = [ro.generate([[1, 2], [3]], n=2) for _ in range(2)]
        assert np.array_equal(before, np.random.get_state()[1]), "the trainer's numpy stream was consumed"
    assert all(s is not None for ro in (tp0, tp1) for s in ro.llm.engine_seeds)
    assert tp0.llm.engine_seeds == tp1.llm.engine_seeds  # same TP group: identical requests
    assert samples["tp0"] == samples["tp1"]
    assert samples["tp0"][0] != samples["tp0"][1]  # a new stream position per call
    assert set(tp0.llm.engine_seeds).isdisjoint(other_dp.llm.engine_seeds)  # DP replicas differ
    # A fresh engine (a resumed run) replays the same unseeded seeds.
    again = make("cuda", rank=0, world=4, tp_size=2)
    again.generate([[1, 2], [3]], n=2)
    assert again.llm.engine_seeds == tp0.llm.engine_seeds[:2]
    assert rc.unseeded_call_seed(0, 0) != rc.unseeded_call_seed(1, 0) != rc.unseeded_call_seed(0, 1)


@pytest.mark.unit
def test_score_sends_a_seeded_request(fake_vllm):
    """F7: the sync check's score() is greedy, but an unseeded request would still draw numpy's
    global RNG on the V2 runner (vllm 0.32.0 v1/worker/gpu/sample/states.py:54-57)."""
    ro = make("cuda")
    np.random.seed(3)
    before = np.random.get_state()[1].copy()
    assert ro.score([[1, 2, 3], [4, 5]]) == [[-0.5, -0.5], [-0.5]]
    assert None not in ro.llm.engine_seeds and len(ro.llm.engine_seeds) == 2
    assert np.array_equal(before, np.random.get_state()[1]), "score() drew the trainer's numpy stream"


# ----------------------------------------------------------------------------- F3: workspace manager


@pytest.mark.unit
def test_each_engine_keeps_its_workspace_manager(fake_vllm, monkeypatch):
    """F3: a GPU worker's init_device re-binds vLLM's process-global workspace manager (vllm 0.32.0
    v1/worker/gpu_worker.py:547-558 -> workspace.py:307-333), which the fused-MoE kernel reads on every
    call (modular_kernel.py:1141-1144). Building a second engine leaves the first one's bound, and
    each engine's calls run on its own."""
    ws = types.ModuleType("vllm.v1.worker.workspace")
    ws._manager = None
    worker_pkg, v1 = types.ModuleType("vllm.v1.worker"), types.ModuleType("vllm.v1")
    worker_pkg.workspace, v1.worker = ws, worker_pkg
    for name, m in (("vllm.v1", v1), ("vllm.v1.worker", worker_pkg), ("vllm.v1.worker.workspace", ws)):
        monkeypatch.setitem(sys.modules, name, m)
    managers = iter(["policy's", "judge's"])
    built = FakeLLM.__init__

    def init(self, **kwargs):  # what the GPU worker's init_device does during LLM(...)
        built(self, **kwargs)
        ws._manager = next(managers)

    monkeypatch.setattr(FakeLLM, "__init__", init)
    policy = make("cuda")
    assert ws._manager == "policy's"
    judge = make("cuda")
    assert ws._manager == "policy's", "building the judge re-bound the policy's scratch"
    seen, generate = [], FakeLLM.generate
    monkeypatch.setattr(FakeLLM, "generate", lambda self, *a, **kw: seen.append(ws._manager) or generate(self, *a, **kw))
    judge.generate([[1]], n=1)
    policy.generate([[1]], n=1)
    policy.release_memory()
    assert seen == ["judge's", "policy's"] and ws._manager == "policy's"


@pytest.mark.unit
def test_storage_sleep_refused_for_a_judge_that_zeroes_kv_blocks(fake_vllm, monkeypatch):
    """F5: vLLM zeroes new KV blocks of hybrid (Mamba / linear attention) models through addresses
    computed once (KVBlockZeroer, vllm 0.32.0 v1/worker/utils.py:122-175) when the scheduler's
    ``needs_kv_cache_zeroing`` is set (v1/core/sched/scheduler.py:376): the judge's storage sleep
    moves the KV cache, so it is refused; the kv mode (CPU) keeps the storage and is allowed."""
    from rlcore.judge.config import JudgeConfig
    from rlcore.rollout.judge import JudgeEngine, rollout_kwargs

    built = FakeLLM.__init__

    def init(self, **kwargs):
        built(self, **kwargs)
        self.llm_engine.engine_core = NS(engine_core=NS(scheduler=NS(needs_kv_cache_zeroing=True)))

    monkeypatch.setattr(FakeLLM, "__init__", init)
    shut = []
    monkeypatch.setattr(cr.ColocateRollout, "shutdown", lambda self: shut.append(True))
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device_type="cuda", backend="gloo")
    jcfg = JudgeConfig(name="hybrid", path="/model", kind="generative", template="{{ response }}")

    def engine(dtype):
        return cr.ColocateRollout(jcfg.path, info, **rollout_kwargs(jcfg, "cuda", seed=0, dtype=dtype))

    with pytest.raises(ValueError, match=r"reward.models\['hybrid'\].*zeroed before use.*plain attention"):
        JudgeEngine(jcfg, engine("bfloat16"))
    assert shut == [True], "the refused engine is shut down"
    assert JudgeEngine(jcfg, engine("float32"), offload="kv").offload == "kv"
    assert rc.kv_zeroing_needed(NS(llm_engine=NS())) is False  # an engine without the flag (older vLLM)


# ----------------------------------------------------------------------------- speed settings


@pytest.mark.unit
def test_enforce_eager_auto_per_device(fake_vllm):
    assert rs.pick_enforce_eager("cpu", None) is True
    assert rs.pick_enforce_eager("cuda", None) is False and rs.pick_enforce_eager("npu", None) is False
    assert rs.pick_enforce_eager("cuda", True) is True and rs.pick_enforce_eager("cpu", False) is False
    for device, eager in (("cpu", True), ("cuda", False), ("npu", False)):
        assert make(device).enforce_eager is eager and FakeLLM.built[-1]["enforce_eager"] is eager
    assert FakeLLM.built[-1]["enable_sleep_mode"] is True  # accelerators: sleep-mode allocator


@pytest.mark.unit
def test_cpu_kv_env_hidden_during_build_only(fake_vllm, monkeypatch):
    import os

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # would override kv_cache_memory_bytes
    make("cpu", kv_cache_gb=0.25)
    assert FakeLLM.built[-1]["kv_cache_memory_bytes"] == 2**28 and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


@pytest.mark.unit
def test_speed_kwargs_reach_llm_only_when_set(fake_vllm):
    keys = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")
    make("cuda")
    assert not set(keys) & set(FakeLLM.built[-1]), "None must leave vLLM's defaults alone"
    ro = make("cuda", max_num_seqs=64, max_num_batched_tokens=4096, enable_prefix_caching=False)
    assert {k: FakeLLM.built[-1][k] for k in keys} == {"max_num_seqs": 64, "max_num_batched_tokens": 4096,
                                                       "enable_prefix_caching": False}
    line = ro.describe()
    for part in ("on cuda", "tp=1", "enforce_eager=False", "weight_load=direct", "sleep level 2",
                 "prefix_caching=False", "max_num_seqs=64", "max_num_batched_tokens=4096"):
        assert part in line, (part, line)
    assert rs.speed_kwargs(enable_prefix_caching=False) == {"enable_prefix_caching": False}
    assert "block_size" not in FakeLLM.built[-1]  # cuda: vLLM's own default
    make("cuda", block_size=32)
    assert FakeLLM.built[-1]["block_size"] == 32


# ----------------------------------------------------------------------------- older vLLM (NPU pin)


@pytest.mark.unit
def test_sleep_level0_needs_release_kv_cache_memory(fake_vllm):
    fake_vllm.LLM = FakeLLMWithoutKVRelease
    with pytest.raises(ValueError, match="release_kv_cache_memory"):
        make("npu", sleep_level=0)
    make("npu", sleep_level=2)
    make("cpu", sleep_level=0)  # CPU never sleeps: resizes the KV buffer instead


@pytest.mark.unit
def test_finalizer_detached_when_present():
    detached = []
    rc.detach_client_finalizer(NS(_finalizer=NS(detach=lambda: detached.append(1))))  # vllm 0.32
    rc.detach_client_finalizer(NS())  # vllm 0.26 InprocClient: no finalizer
    assert detached == [1]


# ----------------------------------------------------------------------------- real engine, tp=2


@pytest.fixture(scope="module")
def ranks(tiny_model):
    from workers.accel_launch import accel_results

    return accel_results(tiny_model)


def test_tp_engine_leaves_no_shm_files(ranks, tiny_model):
    """vLLM's CPU tensor-parallel communicator unlinks its /dev/shm files in C++ destructors at
    exit; a rank that ended with os._exit left them, and the next tp=2 engine on the host failed
    ("create shm in SHMManager failed. errno: 17"). rlcore.dist.exit_process keeps them running."""
    from workers.accel_launch import SHM_LEFT

    assert SHM_LEFT[tiny_model] == set()


def test_tp_ranks_agree_on_unseeded_samples(ranks):
    """Real engine, tp=2, seed=None, a different numpy/torch/python RNG state on each rank."""
    r0, r1 = ranks
    assert r0["unseeded_first"] == r1["unseeded_first"], "TP ranks sampled different tokens with seed=None"
    assert r0["unseeded_second"] == r1["unseeded_second"]
    assert r0["unseeded_first"] != r0["unseeded_second"], "two unseeded calls returned the same samples"
    assert r0["np_rng_untouched"] and r1["np_rng_untouched"]


def test_level2_completeness_on_real_reload(ranks):
    for r in ranks:
        assert "model.norm.weight" in r["partial_push"] and "down_proj" in r["partial_push"], r["partial_push"]
        assert r["valid_after_partial"] is False and r["valid_after_full"] is True
    assert ranks[0]["greedy_after_full"] == ranks[1]["greedy_after_full"]


def test_speed_settings_in_effect(ranks):
    for r in ranks:
        assert r["in_effect"] == {"enforce_eager": True, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                                  "enable_prefix_caching": True}
        assert r["describe"].startswith("vLLM on cpu: tp=2 dp=1 dtype=float32 enforce_eager=True"), r["describe"]


# ----------------------------------------------------------------------------- NPU pin: vllm 0.23.0 + vllm-ascend 0.23.0


@pytest.mark.unit
def test_npu_sampler_gets_processed_logprobs(fake_vllm):
    """vllm-ascend 0.23.0 builds AscendSampler() with raw_logprobs (model_runner_v1.py:333,
    sample/sampler.py:15,73): the LLM kwarg alone would give logprobs of the unscaled logits."""
    FakeLLM.sampler_mode = "raw_logprobs"
    ro = make("npu")
    assert FakeLLM.built[-1]["logprobs_mode"] == "processed_logprobs"
    sampler = ro._model_runner().sampler
    assert sampler.logprobs_mode == sampler.topk_topp_sampler.logprobs_mode == "processed_logprobs"
    # Helper: no change where the mode already matches or the runner has no such sampler (V2 runner).
    assert rc.align_sampler_logprobs_mode(NS(sampler=fake_sampler()), "processed_logprobs") is False
    assert rc.align_sampler_logprobs_mode(NS(), "processed_logprobs") is False
    assert rc.align_sampler_logprobs_mode(NS(sampler=NS(logprobs_mode="raw_logprobs")), "processed_logprobs")
    with pytest.raises(RuntimeError, match="top-k/top-p"):
        rc.align_sampler_logprobs_mode(NS(sampler=NS(logprobs_mode="raw_logprobs", topk_topp_sampler=NS())),
                                       "processed_logprobs")


@pytest.mark.unit
def test_reload_through_the_model_runner_without_worker_reload(fake_vllm):
    """vllm-ascend 0.23.0's NPUWorker has no reload_weights; its NPUModelRunner inherits vLLM's
    GPUModelRunner.reload_weights (vllm 0.23.0 gpu_model_runner.py:5320), which 0.26.0rc1's
    NPUWorker.reload_weights calls (worker.py:1115-1116)."""
    FakeLLM.worker_has_reload, FakeLLM.runner_has_reload, FakeLLM.model_moe = False, True, True
    with pytest.raises(RuntimeError, match="MoE"):
        make("npu")  # direct cannot load experts on NPU ...
    ro = make("npu", weight_load="reload")  # ... reload can, through the runner
    assert ro.update_weights((n, torch.zeros(1)) for n in HF_NAMES) == len(HF_NAMES)
    ro.update_weights_from_path("/ckpt")
    assert ro.llm.rpcs == [rc.runner_reload_weights] * 2 and ro.llm.model.loads == 2
    assert rc.reload_weights_method(NS(reload_weights=1, model_runner=NS(reload_weights=1))) == "reload_weights"
    assert rc.reload_weights_method(NS(model_runner=NS())) is None
    FakeLLM.worker_has_reload = True  # the worker's own method wins (vLLM's Worker, CPUWorker)
    ro = make("cuda", weight_load="reload")
    ro.update_weights((n, torch.zeros(1)) for n in HF_NAMES)
    assert ro.llm.rpcs == ["reload_weights"]


@pytest.mark.unit
def test_engine_kwargs_refused_before_the_build(fake_vllm):
    rc.check_engine_kwargs(ENGINE_ARGS, {k: None for k in ENGINE_ARGS})
    with pytest.raises(ValueError, match="logprobs_mode.*logits / T"):
        rc.check_engine_kwargs([k for k in ENGINE_ARGS if k != "logprobs_mode"], {"logprobs_mode": "x"})
    fake_vllm_args = sys.modules["vllm.engine.arg_utils"]
    fake_vllm_args.EngineArgs = dataclasses.make_dataclass("EngineArgs", [("model", object, None)])
    with pytest.raises(ValueError, match="lacks"):
        make("cuda")
    assert FakeLLM.built == []


@pytest.mark.unit
def test_runner_reload_runs_under_the_workers_vllm_config(fake_vllm):
    """As vLLM's Worker.reload_weights does (vllm 0.32.0 v1/worker/gpu_worker.py:629-631)."""
    seen = []

    @contextmanager
    def current(cfg):
        seen.append(("enter", cfg))
        yield
        seen.append(("exit", cfg))

    sys.modules["vllm.config"].set_current_vllm_config = current
    config = NS(name="the worker's")
    worker = NS(vllm_config=config, model_runner=NS(reload_weights=lambda **kw: seen.append(("reload", kw))))
    rc.runner_reload_weights(worker, weights_path="/ckpt")
    assert seen == [("enter", config), ("reload", {"weights_path": "/ckpt"}), ("exit", config)]


@pytest.mark.unit
def test_prefix_cache_reset_is_checked_and_retried():
    """LLM.reset_prefix_cache returns False and keeps the cache while blocks are held (vllm 0.32.0
    v1/core/block_pool.py:827-844): retried, then an error, never a silent stale cache."""
    class Engine:
        def __init__(self, answers):
            self.answers, self.calls = list(answers), 0

        def reset_prefix_cache(self):
            self.calls += 1
            return self.answers.pop(0)

    flaky = Engine([False, True])
    rc.reset_prefix_cache(flaky)
    assert flaky.calls == 2
    stuck = Engine([False] * 3)
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache 3 times"):
        rc.reset_prefix_cache(stuck, attempts=3)
    rc.reset_prefix_cache(Engine([None]))  # a vLLM whose method returns nothing: nothing to check
