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
    vllm_engine_args  every keyword the rollout hands ``vllm.LLM`` (``rollout.settings.llm_kwargs``),
                      for the policy's engine and each judge's: checked against the installed vLLM's
                      ``EngineArgs`` fields, then ``EngineArgs.create_engine_config()`` (all of vLLM's
                      config validation, nothing loaded; only config.json and the safetensors headers
                      are read, no tokenizer, no network) on this machine's platform with the
                      device-only switches left out (rlcore.rollout.dry_check.DEVICE_ONLY_KWARGS) and, for CUDA, Triton
                      present; the sleep level against its ``LLM``. Advisory (decided by the device's
                      platform, not this one): block size and attention backend, CUDA/ACL graph
                      capture sizes, gpu_memory_utilization, sleep mode; vllm-ascend's own checks
    memory            ``rlcore.plan.memory`` per phase, checkpoint included
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
    from rlcore.config import resolve
    from rlcore.config.cli import _parse

    raw, problem = _quiet(_parse, argv)
    if problem:
        return None, [Check("config", FAIL, problem)]
    from rlcore.hf_folder import folder_problem, model_num_experts

    # the trainer's own check (rlcore.run.preflight) before anything reads the folder: a hub name
    # would otherwise reach vLLM's EngineArgs, which asks huggingface_hub and raises its own error
    problem = folder_problem(raw.model.path)
    if problem:
        return None, [Check("config", FAIL, f"model.path={raw.model.path!r} is invalid: {problem}")]

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


def check_world(cfg: Config, nproc: int, nnodes: int = 1) -> Check:
    from rlcore.run.preflight import validate_against_world

    world = nproc * nnodes
    nodes = [rank // nproc for rank in range(world)]  # torchrun's numbering: one block per agent
    _, problem = _quiet(validate_against_world, cfg, world, nodes)
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
    from rlcore.hf_folder import model_num_experts
    from rlcore.engine.kernels import ops_config, veomni_sees

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
    """Every engine's keywords through vLLM's own config validation (rlcore.rollout.dry_check)."""
    from rlcore.rollout.dry_check import check_engines

    ok, detail = check_engines(cfg, device, _quiet)
    return Check("vllm_engine_args", FAIL if ok is None else OK if ok else WARN, detail)


def check_memory(cfg: Config, device: str, world: int, nproc: int, device_gb: float) -> Check:
    from rlcore.plan.memory import plan_from_config

    plan, problem = _quiet(plan_from_config, cfg, world, device_gb, device, nproc_per_node=nproc)
    if problem:
        return Check("memory", FAIL, problem)
    totals = ", ".join(f"{ph} {plan.total(ph) / 2**30:.1f}" for ph in plan.phases)
    verdict = OK if plan.fits else FAIL
    return Check("memory", verdict, f"GB per rank of {device_gb:g}: {totals} (limit {plan.limit / 2**30:.1f})"
                                    + ("" if plan.fits else "; " + "; ".join(plan.suggestions[:2])))


def dry_run(argv: list[str], device: str, nproc: int, nnodes: int = 1, device_gb: float = 80.0,
            pre_hopper: bool = False) -> list[Check]:
    """Every check, in order; after a config failure only that one (the rest need the config).
    On cuda, attention resolves as on the GPU node, not this machine: an SM90+ GPU with the pinned
    flash-attn-4, or (``pre_hopper``) an older one (rlcore.engine.attention.assume_gpu)."""
    from rlcore.engine.attention import assume_gpu

    with assume_gpu(("older" if pre_hopper else "fa4") if device == "cuda" else None):
        cfg, checks = check_config(argv, device)
        if cfg is None:
            return checks
        world = nproc * nnodes
        checks.append(check_world(cfg, nproc, nnodes))
        checks.append(check_attention(cfg, device))
        checks.append(check_veomni_ops(cfg, device))
        checks.append(check_vllm(cfg, device))
        checks.append(check_memory(cfg, device, world, nproc, device_gb))
    return checks
