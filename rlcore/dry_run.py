"""A device dry run: the parts of the build that allocate no device memory, for a device this
machine does not have (``scripts/check_config.py --device cuda|npu``; run it on a login node
before ``sbatch``).

Each check goes through the real code and the real libraries' own validation, never a copy of
their rules:

    config            the trainer's parser and ``rlcore.config.resolve`` for DEVICE (dtype, attention,
                      experts kernel, weight load, sleep level; the MoE and weight-load rules)
    world             ``rlcore.preflight.validate_against_world`` for nproc x nnodes ranks
    attention         ``rlcore.attention`` against the kernel packages installed here (a login node
                      should have the cluster's environment)
    veomni_ops        VeOmni's ``OpsImplementationConfig`` as the engine builds it, constructed with
                      VeOmni's own device probe (``is_torch_npu_available``) set to DEVICE
    vllm_engine_args  every keyword the rollout hands ``vllm.LLM`` (``colocate_rollout.llm_kwargs``),
                      checked against the installed vLLM's ``EngineArgs`` fields and constructed as an
                      ``EngineArgs``; the sleep level against its ``LLM``
    memory            ``rlcore.memory_plan`` per phase, checkpoint included
"""

from __future__ import annotations

import contextlib
import io
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
    from rlcore.cli import _parse
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
    from rlcore.preflight import validate_against_world

    _, problem = _quiet(validate_against_world, cfg, world)
    return Check("world", FAIL, problem) if problem else Check("world", OK, f"{world} ranks")


def check_attention(cfg: Config, device: str) -> Check:
    from rlcore.attention import pick_attn_implementation

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
    from rlcore.engine_kernels import ops_config

    m = cfg.model
    with veomni_sees(device):
        ops, problem = _quiet(ops_config, m.attn_implementation, m.moe_implementation, model_num_experts(m.path),
                              device)
    if problem:
        return Check("veomni_ops", FAIL, f"VeOmni's validation on {device}: {problem}")
    return Check("veomni_ops", OK, f"VeOmni accepts on {device}: attention {ops.attn_implementation}, experts "
                                   f"{ops.moe_implementation}, rms_norm {ops.rms_norm_implementation}, swiglu "
                                   f"{ops.swiglu_mlp_implementation}, rope {ops.rotary_pos_emb_implementation}")


def check_vllm(cfg: Config, device: str) -> Check:
    import dataclasses

    import vllm
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from rlcore.build import config_llm_kwargs
    from rlcore.rollout_checks import check_engine_kwargs, check_sleep_level_supported

    from rlcore.judge.engine import judge_llm_kwargs

    r = cfg.rollout
    kwargs = config_llm_kwargs(cfg, device)
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    for step in (lambda: check_engine_kwargs(fields, kwargs), lambda: EngineArgs(**kwargs),
                 lambda: check_sleep_level_supported(LLM, device, r.sleep_level)):
        _, problem = _quiet(step)
        if problem:
            return Check("vllm_engine_args", FAIL, f"vLLM {vllm.__version__}: {problem}")
    judges = cfg.reward.judges()
    for j in judges:  # each judge's engine (reward.models), as rlcore.judge.engine builds it
        jk = judge_llm_kwargs(j, device, seed=cfg.trainer.seed, dtype=j.dtype or r.dtype or cfg.model.dtype,
                              tp_size=j.tensor_parallel_size or r.tensor_parallel_size)
        for step in (lambda: check_engine_kwargs(fields, jk), lambda: EngineArgs(**jk)):
            if problem := _quiet(step)[1]:
                return Check("vllm_engine_args", FAIL, f"vLLM {vllm.__version__}, judge {j.name!r}: {problem}")
    pin = {"npu": "0.23.0", "cuda": "0.32.0"}.get(device)
    note = "" if pin in (None, vllm.__version__) else f" (the {device} pin is vLLM {pin}: install the cluster's set here)"
    if cfg.algorithm.routing_replay == "r3":
        from rlcore.dist import detect_device
        from rlcore.rollout_routing import vllm_verdict

        if detect_device()[0] != device:  # vLLM judges its own platform only
            note += f"; r3's routed-experts check (vLLM's own) runs on the {device} machine at the run's start"
        elif problem := _quiet(vllm_verdict, kwargs, device)[0]:
            return Check("vllm_engine_args", FAIL, f"vLLM {vllm.__version__} refuses r3's routed experts: {problem}")
    names = f" and those of judge(s) {', '.join(j.name for j in judges)}" if judges else ""
    return Check("vllm_engine_args", OK if not note else WARN,
                 f"vLLM {vllm.__version__} accepts all {len(kwargs)} LLM keywords{names}{note}")


def check_memory(cfg: Config, device: str, world: int, nproc: int, device_gb: float) -> Check:
    from rlcore.memory_plan import plan_from_config

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
