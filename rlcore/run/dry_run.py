"""A device dry run: the parts of the build that allocate no device memory, for a device this
machine does not have (``scripts/check_config.py --device cuda|npu``; run it on a login node
before ``sbatch``).

Each check goes through the real code and the real libraries' own validation, never a copy of
their rules:

    config            the trainer's parser and ``rlcore.config.resolve`` for DEVICE (dtype, attention,
                      experts kernel, weight load, sleep level; the MoE and weight-load rules)
    world             ``rlcore.run.preflight.validate_against_world`` for nproc x nnodes ranks
    attention         ``rlcore.engine.attention`` against the kernel packages installed here (a login node
                      should have the cluster's environment)
    veomni_ops        VeOmni's ``OpsImplementationConfig`` as the engine builds it, constructed with
                      VeOmni's own device probe (``is_torch_npu_available``) set to DEVICE
    vllm_engine_args  every keyword the rollout hands ``vllm.LLM`` (``rollout_settings.llm_kwargs``),
                      for the policy's engine and each judge's: checked against the installed vLLM's
                      ``EngineArgs`` fields, then ``EngineArgs.create_engine_config()`` (all of vLLM's
                      config validation, nothing loaded; only config.json and the safetensors headers
                      are read, no tokenizer, no network) on this machine's platform with the
                      device-only switches left out (``DEVICE_ONLY_KWARGS``) and, for CUDA, Triton
                      present; the sleep level against its ``LLM``. Advisory (decided by the device's
                      platform, not this one): block size and attention backend, CUDA/ACL graph
                      capture sizes, gpu_memory_utilization, sleep mode; vllm-ascend's own checks
    memory            ``rlcore.plan.memory`` per phase, checkpoint included
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from dataclasses import dataclass

from rlcore.config import Config, ConfigError

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str  # OK / WARN / FAIL
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.detail}"


@contextlib.contextmanager
def veomni_sees(device: str):
    """VeOmni's device probe answering for ``device`` (its validation asks it at construction)."""
    import veomni.utils.import_utils as import_utils

    saved = import_utils.is_torch_npu_available
    import_utils.is_torch_npu_available = lambda: device == "npu"
    try:
        yield
    finally:
        import_utils.is_torch_npu_available = saved


def _quiet(fn, *args, **kwargs):
    """Run ``fn``; a user error (ConfigError, ValueError, SystemExit of ``fail``) becomes its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return fn(*args, **kwargs), None
    except SystemExit:
        return None, err.getvalue().strip().removeprefix("error: ") or "invalid"
    except (ConfigError, ValueError, RuntimeError, TypeError) as e:
        return None, str(e)


def check_config(argv: list[str], device: str) -> tuple[Config | None, list[Check]]:
    from rlcore.config.cli import _parse
    from rlcore.config import resolve

    raw, problem = _quiet(_parse, argv)
    if problem:
        return None, [Check("config", FAIL, problem)]
    from rlcore.config import model_num_experts

    with warnings.catch_warnings():  # the attention check reports its fallback warning itself
        warnings.simplefilter("ignore")
        cfg, problem = _quiet(resolve, raw, device)
    if problem:
        return None, [Check("config", FAIL, problem)]
    m, r = cfg.model, cfg.rollout
    experts = model_num_experts(m.path)
    moe = f"{experts} experts via {m.moe_implementation}" if experts else "dense"
    detail = (f"resolved for {device}: dtype {m.dtype}, attention {m.attn_implementation}, {moe}, weight_load "
              f"{r.weight_load}, sleep_level {r.sleep_level}, enforce_eager {r.enforce_eager}")
    return cfg, [Check("config", OK, detail)]


def check_world(cfg: Config, world: int) -> Check:
    from rlcore.run.preflight import validate_against_world

    _, problem = _quiet(validate_against_world, cfg, world)
    return Check("world", FAIL, problem) if problem else Check("world", OK, f"{world} ranks")


def check_attention(cfg: Config, device: str) -> Check:
    from rlcore.engine.attention import pick_attn_implementation

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        picked, problem = _quiet(pick_attn_implementation, cfg.model.attn_implementation, device, dtype=cfg.model.dtype)
    if problem:
        return Check("attention", FAIL, problem)
    impl, reason = picked
    dense = device != "cpu" and impl in ("sdpa", "eager")
    return Check("attention", WARN if dense or caught else OK, f"{impl}: {reason}")


def check_veomni_ops(cfg: Config, device: str) -> Check:
    from rlcore.config import model_num_experts
    from rlcore.engine.kernels import ops_config

    m = cfg.model
    with veomni_sees(device):
        ops, problem = _quiet(ops_config, m.attn_implementation, m.moe_implementation, model_num_experts(m.path),
                              device)
    if problem:
        return Check("veomni_ops", FAIL, f"VeOmni's validation on {device}: {problem}")
    return Check("veomni_ops", OK, f"VeOmni accepts on {device}: attention {ops.attn_implementation}, experts "
                                   f"{ops.moe_implementation}, rms_norm {ops.rms_norm_implementation}, swiglu "
                                   f"{ops.swiglu_mlp_implementation}, rope {ops.rotary_pos_emb_implementation}")


# ``LLM`` keywords this machine's vLLM platform refuses that only set up device memory: left out of
# the dry run's ``create_engine_config`` (the run checks them on the device).
DEVICE_ONLY_KWARGS = ("enable_sleep_mode",)


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


@contextlib.contextmanager
def vllm_config_sees(device: str, *, r3: bool):
    """vLLM's config code answering, on this machine's platform, as it would on ``device`` where
    that can be emulated: CUDA installs bring Triton, so vLLM picks its V2 model runner there
    (vllm 0.32 config/vllm.py:720-737); with R3 the V2 runner is forced
    (``VLLM_USE_V2_MODEL_RUNNER=1``, Triton present) so the routed-experts checks behind it run
    (``_verify_aux_output_compatibility``, :1135-1158; vllm-ascend brings its own runner)."""
    import vllm.config.vllm as vllm_config

    triton = vllm_config.HAS_TRITON
    if device == "cuda" or r3:
        vllm_config.HAS_TRITON = True
    try:
        with environ_kept():
            if r3:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            yield
    finally:
        vllm_config.HAS_TRITON = triton


def check_vllm(cfg: Config, device: str) -> Check:
    with environ_kept():
        return _check_vllm(cfg, device)


def _check_vllm(cfg: Config, device: str) -> Check:
    """Every engine (the policy's, each judge's) through vLLM: its keywords against ``EngineArgs``'
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

    from rlcore.rollout.settings import config_llm_kwargs
    from rlcore.dist import detect_device
    from rlcore.rollout.judge import judge_llm_kwargs
    from rlcore.rollout.checks import check_engine_kwargs, check_sleep_level_supported
    from rlcore.rollout.routing import vllm_verdict

    r, here = cfg.rollout, detect_device()[0]
    r3, native = cfg.algorithm.routing_replay == "r3", here == device
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    judges = cfg.reward.judges()
    engines = [("", config_llm_kwargs(cfg, device))]
    for j in judges:  # each judge's engine (reward.models), as rlcore.rollout.judge builds it
        engines.append((f", judge {j.name!r}", judge_llm_kwargs(
            j, device, seed=cfg.trainer.seed, dtype=j.dtype or r.dtype or cfg.model.dtype,
            tp_size=j.tensor_parallel_size or r.tensor_parallel_size)))
    dropped = sorted({k for _, kw in engines for k in kw if k in DEVICE_ONLY_KWARGS}) if not native else []
    for who, kw in engines:
        checked = {k: v for k, v in kw.items() if k not in dropped}
        steps = [lambda: check_engine_kwargs(fields, kw), lambda: EngineArgs(**kw)]
        if not who:
            steps.append(lambda: check_sleep_level_supported(LLM, device, r.sleep_level))
        for step in steps:
            if problem := _quiet(step)[1]:
                return Check("vllm_engine_args", FAIL, f"vLLM {vllm.__version__}{who}: {problem}")
        with vllm_config_sees(device, r3=r3 and not native and not who), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = vllm_verdict(checked, here)
        if problem:
            return Check("vllm_engine_args", FAIL, f"vLLM {vllm.__version__}{who} refuses the engine config "
                                                   f"(EngineArgs.create_engine_config): {problem}")
    pin = {"npu": "0.23.0", "cuda": "0.32.0"}.get(device)
    note = "" if pin in (None, vllm.__version__) else f" (the {device} pin is vLLM {pin}: install the cluster's set here)"
    names = f" and those of judge(s) {', '.join(j.name for j in judges)}" if judges else ""
    detail = (f"vLLM {vllm.__version__} accepts all {len(engines[0][1])} LLM keywords{names} and builds "
              f"{'each engine' if judges else 'the engine'}'s config{' with r3' if r3 else ''}")
    if not native:  # what this platform's config hook decides for itself, and what it never sees
        platform = current_platform.device_name or current_platform.device_type or "this"
        how = [f"create_engine_config on this machine's {platform} platform"]
        how += [f"{', '.join(dropped)} left out"] if dropped else []
        how += (["V2 model runner forced for r3"] if r3 else ["Triton present as on CUDA"] if device == "cuda" else [])
        graphs = {"cuda": "CUDA", "npu": "ACL"}.get(device, device)
        detail += (f" ({', '.join(how)}); advisory until the {device} run: block size and attention backend "
                   f"(the platform's check_and_update_config), {graphs} graph sizes, gpu_memory_utilization, sleep "
                   f"mode, kernels" + (", vllm-ascend's own checks" if device == "npu" else ""))
    return Check("vllm_engine_args", OK if not note else WARN, detail + note)


def check_memory(cfg: Config, device: str, world: int, nproc: int, device_gb: float) -> Check:
    from rlcore.plan.memory import plan_from_config

    plan, problem = _quiet(plan_from_config, cfg, world, device_gb, device, nproc_per_node=nproc)
    if problem:
        return Check("memory", FAIL, problem)
    totals = ", ".join(f"{ph} {plan.total(ph) / 2**30:.1f}" for ph in plan.phases)
    verdict = OK if plan.fits else FAIL
    return Check("memory", verdict, f"GB per rank of {device_gb:g}: {totals} (limit {plan.limit / 2**30:.1f})"
                                    + ("" if plan.fits else "; " + "; ".join(plan.suggestions[:2])))


def dry_run(argv: list[str], device: str, nproc: int, nnodes: int = 1, device_gb: float = 80.0) -> list[Check]:
    """Every check, in order; after a config failure only that one (the rest need the config)."""
    cfg, checks = check_config(argv, device)
    if cfg is None:
        return checks
    world = nproc * nnodes
    checks.append(check_world(cfg, world))
    checks.append(check_attention(cfg, device))
    checks.append(check_veomni_ops(cfg, device))
    checks.append(check_vllm(cfg, device))
    checks.append(check_memory(cfg, device, world, nproc, device_gb))
    return checks
