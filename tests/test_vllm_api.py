"""Every vLLM name the rollout relies on exists in the installed vLLM (issue 12: a version bump
must fail here, naming the attribute and its user in rlcore/colocate_rollout.py, not on a cluster).

The ``unit`` tests inspect classes and modules without building an engine; the last test reads
the attribute chain off a real tp=2 engine (tests/workers/accel_worker.py CHAIN, one launch
shared with tests/test_rollout_accel.py). The NPU pin (vllm 0.23.0) lacks some of these:
docs/accelerators.md lists them and the branches that handle them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing

import pytest

# (module, attribute path, where the rollout uses it)
NAMES = [
    ("vllm", "LLM.generate", "ColocateRollout.generate"),
    ("vllm", "LLM.sleep", "release_memory (accelerators)"),
    ("vllm", "LLM.wake_up", "resume_memory (accelerators)"),
    ("vllm", "LLM.collective_rpc", "update_weights (reload_weights), update_weights_from_path"),
    ("vllm", "LLM.reset_prefix_cache", "update_weights, resume_memory"),
    ("vllm", "LLM.release_kv_cache_memory", "release_memory at sleep level 0 (vllm >= 0.32)"),
    ("vllm", "SamplingParams", "ColocateRollout._sampling_params"),
    ("vllm.inputs", "TokensPrompt", "ColocateRollout.generate"),
    ("vllm.config", "set_current_vllm_config", "ColocateRollout._load_direct"),
    ("vllm.distributed.parallel_state", "destroy_model_parallel", "ColocateRollout.shutdown"),
    ("vllm.distributed.parallel_state", "_WORLD", "ColocateRollout.shutdown"),
    ("vllm.engine.arg_utils", "EngineArgs", "LLM(**kwargs) in ColocateRollout._build_engine"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights", "update_weights (weight_load=reload, CUDA)"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.reload_weights", "update_weights (weight_load=reload, CPU)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", "update_weights (model.load_weights)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights", "Worker.reload_weights"),
    ("vllm.v1.engine.core", "EngineCore.shutdown", "replayed minus the PG teardown by ColocateRollout.shutdown"),
    ("vllm.v1.engine.core_client", "InprocClient", "ColocateRollout.shutdown (llm_engine.engine_core)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.shutdown", "ColocateRollout.shutdown"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.reset_encoder_cache", "ColocateRollout._reset_encoder_cache (image prompts)"),
    ("vllm.model_executor.models.registry", "_SUBPROCESS_COMMAND", "rollout.checks.registry_subprocess_with_shim"),
    ("vllm.distributed.device_communicators.cpu_communicator", "_CPUSHMDistributed.make_group_name",
     "rollout.cpu_kv.scope_cpu_shm_names (CPU, tp > 1)"),
]

# Every keyword ColocateRollout may pass to LLM(...): rlcore/colocate_rollout.py _build_engine,
# _memory_kwargs, rollout.settings.speed_kwargs, disable_npu_nz, engine_keys.chunked_prefill_kwargs, multimodal_kwargs.
LLM_KWARGS = [
    "model", "tensor_parallel_size", "distributed_executor_backend", "seed", "dtype", "max_model_len",
    "enforce_eager", "logprobs_mode", "use_tqdm_on_load", "kv_cache_memory_bytes", "gpu_memory_utilization",
    "enable_sleep_mode", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "additional_config",
    "enable_chunked_prefill", "limit_mm_per_prompt", "mm_processor_cache_gb",
]


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module,path,used_by", NAMES, ids=[f"{m}:{p}" for m, p, _ in NAMES])
def test_name_exists(module, path, used_by):
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{path} vanished from the installed vLLM ({e}); rlcore uses it in {used_by}")


@pytest.mark.unit
def test_method_signatures():
    from vllm import LLM

    expect = {"sleep": "level", "wake_up": "tags", "collective_rpc": "kwargs", "generate": "use_tqdm"}
    for method, param in expect.items():
        params = inspect.signature(getattr(LLM, method)).parameters
        assert param in params, f"LLM.{method} lost its {param!r} argument (used by rlcore/colocate_rollout.py)"
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = inspect.signature(GPUModelRunner.reload_weights).parameters
    for p in ("weights_iterator", "weights_path"):
        assert p in params, f"reload_weights lost {p!r} (collective_rpc kwargs in update_weights*)"


@pytest.mark.unit
def test_llm_accepts_every_kwarg_we_pass():
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    explicit = set(inspect.signature(LLM.__init__).parameters)
    missing = [k for k in LLM_KWARGS if k not in fields and k not in explicit]
    assert not missing, f"LLM/EngineArgs no longer take {missing} (passed by ColocateRollout._build_engine)"


@pytest.mark.unit
def test_option_values_we_rely_on():
    from vllm.config.model import LogprobsMode
    from vllm.config.parallel import DistributedExecutorBackend

    assert "processed_logprobs" in typing.get_args(LogprobsMode), "logprobs_mode='processed_logprobs' is gone"
    backends = set(typing.get_args(DistributedExecutorBackend))
    assert "external_launcher" in backends, f"distributed_executor_backend 'external_launcher' gone: {backends}"


@pytest.mark.unit
def test_sampling_params_fields():
    from vllm import SamplingParams

    kw = dict(n=2, temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, seed=3, stop_token_ids=[1], logprobs=0,
              detokenize=False)
    sp = SamplingParams(**kw)
    for k, v in kw.items():
        assert getattr(sp, k) == v, f"SamplingParams.{k} changed meaning (set in ColocateRollout._sampling_params)"


@pytest.mark.unit
def test_inproc_client_finalizer_and_v2_seeding_premise():
    """Facts the code branches on: InprocClient's finalizer (detached in shutdown) and the V2
    sampler seeding unseeded requests from numpy's global RNG (why every request is seeded)."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    assert "_finalizer" in inspect.getsource(InprocClient.__init__), \
        "InprocClient._finalizer gone: check ColocateRollout.shutdown still keeps the default process group"
    assert "np.random" in inspect.getsource(SamplingStates.add_request), \
        "V2 sampler no longer seeds from numpy: rollout.checks.unseeded_call_seed's reason changed (keep it)"


@pytest.fixture(scope="module")
def ranks(tiny_model):
    from workers.accel_launch import accel_results

    return accel_results(tiny_model)


def test_attribute_chain_on_a_real_engine(ranks):
    """llm.llm_engine.model_executor.driver_worker.worker.model_runner... on a built engine."""
    for r in ranks:
        assert not r["missing_chain"], "vLLM attribute chain broken on rank %d:\n  %s" % (
            r["rank"], "\n  ".join(r["missing_chain"]))


@pytest.mark.unit
def test_cpu_shm_names_are_scoped_to_the_launch(monkeypatch):
    """Two live tp > 1 runs on one host: vLLM would give both the same shm group name (the
    ident of ``env://`` is the same for every torchrun launch); scoped by MASTER_PORT they differ,
    and the stale-file cleanup's pattern still matches them."""
    import fnmatch
    import types

    from vllm.distributed.device_communicators import cpu_communicator as cc

    from rlcore.rollout.cpu_kv import scope_cpu_shm_names

    original = cc._CPUSHMDistributed.make_group_name
    monkeypatch.setattr(cc._CPUSHMDistributed, "make_group_name", original)  # put back after the test
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what cpu_worker.py:147-152 derives from env://
    comm = types.SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    plain = cc._CPUSHMDistributed.make_group_name(comm)
    assert plain == "//-tp:0-[0-1]-cpushm"  # the same for every launch: what collides
    monkeypatch.setenv("MASTER_PORT", "29513")
    assert scope_cpu_shm_names() == "29513"
    first = cc._CPUSHMDistributed.make_group_name(comm)
    assert scope_cpu_shm_names("40007") == "40007"  # idempotent: re-scoped, not scoped twice
    second = cc._CPUSHMDistributed.make_group_name(comm)
    assert first == "//-tp:0-[0-1]-run29513-cpushm" and second == "//-tp:0-[0-1]-run40007-cpushm"
    assert fnmatch.fnmatch(first + "_0", "*cpushm*")  # rlcore.rollout.cpu_kv.remove_stale_cpu_shm's glob
