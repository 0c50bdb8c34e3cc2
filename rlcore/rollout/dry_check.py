"""The dry run's vLLM part (``scripts/check_config.py``, rlcore.run.dry_run): every engine the run
would build (the policy's, each judge's) through vLLM's own engine-config validation, for a
device this machine may not have. Builds nothing.
"""

from __future__ import annotations

import contextlib
import os
import warnings


# ``LLM`` keywords this machine's vLLM platform refuses that only set up device memory: left out of
# the dry run's ``create_engine_config`` (the run checks them on the device).
DEVICE_ONLY_KWARGS = ("enable_sleep_mode",)
R3_RUNNER = {"v2": "V2 model runner forced for r3", "v1": "V1 model runner for r3, as vllm-ascend 0.23's NPU runner"}


@contextlib.contextmanager
def environ_kept():
    """``os.environ`` put back as it was: ``llm_kwargs`` (VLLM_CPU_KVCACHE_SPACE, vllm-ascend's NZ
    switch) and vLLM's platform config hook (LD_PRELOAD, LOCAL_WORLD_SIZE, thread and worker
    settings) write it, and the dry run builds nothing that needs them."""
    env = dict(os.environ)
    try:
        yield
    finally:
        for k in set(os.environ) - set(env):
            del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


def r3_runner(device: str) -> str:
    """The model runner that returns routed experts (R3) on ``device``, which the dry run judges R3 with:
    ``"v1"`` for npu on vLLM 0.23 (the pin): vllm-ascend 0.23.0's ``NPUWorker`` falls back to its V1 runner
    on vllm 0.23.0 whatever is asked (worker/worker.py:160-163), ``NPUModelRunner(GPUModelRunner)``
    (worker/model_runner_v1.py:268), which captures routed experts (:3884-3885, bound to its fused-MoE
    layers :3887-3900, captured per forward ops/fused_moe/fused_moe.py:201-204), where vLLM 0.23's own V2
    runner cannot ("Model Runner V2 does not yet support: routed experts capture", config/vllm.py:2027-2029,
    :2062-2071). ``"v2"`` otherwise: CUDA's default runner with Triton, and vllm 0.32's only runner for
    routed experts (its V1 refuses them, config/vllm.py:1144-1150)."""
    import vllm

    return "v1" if device == "npu" and vllm.__version__.startswith("0.23.") else "v2"


@contextlib.contextmanager
def vllm_config_sees(device: str, *, r3: bool):
    """vLLM's config code answering, on this machine's platform, as it would on ``device`` where
    that can be emulated: CUDA installs bring Triton, so vLLM picks its V2 model runner there
    (vllm 0.32 config/vllm.py:720-737); with R3 the runner that serves it on ``device`` (``r3_runner``)
    is forced (``VLLM_USE_V2_MODEL_RUNNER``, Triton present for V2) so the routed-experts checks behind
    it run (0.32's ``_verify_aux_output_compatibility``, :1135-1158; 0.23's PP and KV-connector checks,
    config/vllm.py:864-886)."""
    import vllm.config.vllm as vllm_config

    triton = vllm_config.HAS_TRITON
    runner = r3_runner(device) if r3 else None
    if device == "cuda" or runner == "v2":
        vllm_config.HAS_TRITON = True
    try:
        with environ_kept():
            if runner:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
            yield
    finally:
        vllm_config.HAS_TRITON = triton


def check_engines(cfg, device: str, quiet) -> tuple[bool | None, str]:
    """(True: accepted, False: accepted with a warning, None: refused; the detail). ``quiet(fn)``
    runs a step and returns (result, the user error's message or None)."""
    with environ_kept():
        return _check_engines(cfg, device, quiet)


def _check_engines(cfg, device: str, quiet) -> tuple[bool | None, str]:
    """Every engine (the policy's, each judge's, the distillation teacher's) through vLLM: its keywords against ``EngineArgs``'
    fields, then ``EngineArgs.create_engine_config()``, which runs all of vLLM's config validation
    without loading anything (architecture, max_model_len against the model, heads against TP,
    the pooling runner of a reward model, LoRA, multimodal limits, the scheduler, R3's
    routed-experts requirements). For another device it runs on this machine's platform with
    ``DEVICE_ONLY_KWARGS`` left out; what that platform decides differently stays advisory."""
    import dataclasses

    import vllm
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from rlcore.dist import detect_device
    from rlcore.rollout.checks import check_engine_kwargs, check_sleep_level_supported
    from rlcore.rollout.judge import judge_llm_kwargs
    from rlcore.rollout.routing import vllm_verdict
    from rlcore.rollout.settings import config_llm_kwargs

    r, here = cfg.rollout, detect_device()[0]
    r3, native = cfg.algorithm.routing_replay == "r3", here == device
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    judges = cfg.reward.judges()
    engines = [("", config_llm_kwargs(cfg, device))]
    for j in judges:  # each judge's engine (reward.models), as rlcore.rollout.judge builds it
        engines.append((f", judge {j.name!r}", judge_llm_kwargs(
            j, device, seed=cfg.trainer.seed, dtype=j.dtype or r.dtype or cfg.model.dtype,
            tp_size=j.tensor_parallel_size or r.tensor_parallel_size)))
    if cfg.distill.enabled:  # the distillation teacher's engine, a judge engine (rlcore.rollout.teacher)
        d = cfg.distill
        engines.append((", teacher", judge_llm_kwargs(d, device, seed=cfg.trainer.seed,
                                                      dtype=d.dtype or r.dtype or cfg.model.dtype,
                                                      tp_size=r.tensor_parallel_size)))
    dropped = sorted({k for _, kw in engines for k in kw if k in DEVICE_ONLY_KWARGS}) if not native else []
    for who, kw in engines:
        checked = {k: v for k, v in kw.items() if k not in dropped}
        steps = [lambda: check_engine_kwargs(fields, kw), lambda: EngineArgs(**kw)]
        if not who:
            steps.append(lambda: check_sleep_level_supported(LLM, device, r.sleep_level))
        for step in steps:
            if problem := quiet(step)[1]:
                return None, f"vLLM {vllm.__version__}{who}: {problem}"
        with vllm_config_sees(device, r3=r3 and not native and not who), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = vllm_verdict(checked, here)
        if problem:
            mine = f" (with rollout.engine_kwargs {r.engine_kwargs})" if r.engine_kwargs and not who else ""
            return None, (f"vLLM {vllm.__version__}{who} refuses the engine config "
                          f"(EngineArgs.create_engine_config){mine}: {problem}")
    pin = {"npu": "0.23.0", "cuda": "0.32.0"}.get(device)
    note = "" if pin in (None, vllm.__version__) else f" (the {device} pin is vLLM {pin}: install the cluster's set here)"
    names = f" and those of judge(s) {', '.join(j.name for j in judges)}" if judges else ""
    names += " and the distillation teacher's" if cfg.distill.enabled else ""
    detail = (f"vLLM {vllm.__version__} accepts all {len(engines[0][1])} LLM keywords{names} and builds "
              f"{'each engine' if len(engines) > 1 else 'the engine'}'s config{' with r3' if r3 else ''}")
    if not native:  # what this platform's config hook decides for itself, and what it never sees
        platform = current_platform.device_name or current_platform.device_type or "this"
        how = [f"create_engine_config on this machine's {platform} platform"]
        how += [f"{', '.join(dropped)} left out"] if dropped else []
        how += ([R3_RUNNER[r3_runner(device)]] if r3 else ["Triton present as on CUDA"] if device == "cuda" else [])
        graphs = {"cuda": "CUDA", "npu": "ACL"}.get(device, device)
        detail += (f" ({', '.join(how)}); advisory until the {device} run: block size and attention backend "
                   f"(the platform's check_and_update_config), {graphs} graph sizes, gpu_memory_utilization, sleep "
                   f"mode, kernels" + (", vllm-ascend's own checks" if device == "npu" else ""))
    return not note, detail + note
