"""The judges' part of the memory plan (and the distillation teacher's, the same kind of engine):
each engine's shape and share, and the scoring phases' verdict (a config error when it cannot fit: the judges' budgets are the user's own).
Also what waits in host memory between steps: sleeping judges and teacher, suspended rollouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlcore.errors import ConfigError


@dataclass(frozen=True)
class JudgePlan:
    """A judge's engine (rlcore/judge): its model's shape, its device share while awake, its sleep
    level (1: weights wait in host memory, 2: reloaded from disk) and dtype bytes."""

    shape: object  # rlcore.plan.model_shape.ModelShape
    gpu_memory_utilization: float
    sleep_level: int = 1
    c: int = 2

    def host_bytes(self, tp: int) -> int:
        """Host memory per rank while asleep: the weights at level 1 (vLLM's CPU backup), 0 at 2."""
        return self.c * self.shape.params // tp if self.sleep_level == 1 else 0


def teacher_plan(cfg, dtype_bytes: dict) -> JudgePlan | None:
    """distill.teacher's engine (a judge engine, rlcore.rollout.teacher) as the plan sees it; None without one."""
    from rlcore.plan.model_shape import ModelShape

    d = cfg.distill
    if not d.enabled:
        return None
    return JudgePlan(ModelShape.from_path(d.teacher), d.gpu_memory_utilization, d.sleep_level or 1,
                     dtype_bytes[d.dtype or cfg.rollout.dtype or cfg.model.dtype])


def check_judging_fits(plan) -> None:
    """Accelerators, on every rank before anything loads (this plan): the judging phase and the
    distillation teacher's must fit. The plan's other phases are only printed, as without them; the
    scoring engines' budgets are set by the user and known exactly, so a scoring phase over the
    limit is a config error."""
    gb = 2**30
    if "teacher" in plan.phases and plan.total("teacher") > plan.limit:
        t = plan.phases["teacher"]["teacher"]
        raise ConfigError(
            f"distill.gpu_memory_utilization={plan.inputs.teacher.gpu_memory_utilization:g}: the teacher's phase "
            f"needs {plan.total('teacher') / gb:.1f} GB per rank (the teacher awake {t / gb:.1f} GB, plus "
            f"{(plan.total('teacher') - t) / gb:.1f} GB the trainer and the sleeping engines keep) but the limit is "
            f"{plan.limit / gb:.1f} GB: lower it, offload the trainer (offload.params / offload.optimizer: true), "
            "or use rollout.sleep_level 1 or 2")
    if "judge" not in plan.phases or plan.total("judge") <= plan.limit:
        return
    parts = plan.phases["judge"]
    raise ConfigError(
        f"reward.models: the judging phase needs {plan.total('judge') / gb:.1f} GB per rank (judges awake "
        f"{parts['judges'] / gb:.1f} GB = their gpu_memory_utilization x {plan.inputs.device_gb:g} GB, plus "
        f"{(plan.total('judge') - parts['judges']) / gb:.1f} GB the trainer and the sleeping policy engine keep) "
        f"but the limit is {plan.limit / gb:.1f} GB: lower reward.models[].gpu_memory_utilization, offload the "
        "trainer (offload.params / offload.optimizer: true), or use rollout.sleep_level 1 or 2")


# Host bytes per suspended token: a token id, vLLM's log-prob and the policy version, each a Python
# object in a list (rlcore.step.partial.Seq). Measured with tracemalloc: 109 B with a new int per
# version, 81 B as the loop appends them (one int per step); tests/test_partial.py checks the bound.
SUSPENDED_TOKEN_BYTES = 110


def suspended_sequences(p) -> int:
    """Most sequences a replica keeps suspended after a step: the groups in flight beyond the ones
    trained (rollout.partial.oversample), n each; every rank of a TP group holds the same ones."""
    groups = p.prompts_per_step / p.dp
    return int((math.ceil(p.oversample * groups) - groups) * p.n)


def host_lines(p, gb: int) -> list[str]:
    """The plan's lines for host memory per rank (``p``: rlcore.plan.memory.PlanInputs)."""
    lines = []
    if p.judges:
        host = sum(j.host_bytes(p.tp) for j in p.judges)
        lines.append(f"judges asleep: {host / gb:.2f} GB host memory per rank (weights kept at sleep level 1)")
    if p.teacher:
        lines.append(f"teacher asleep: {p.teacher.host_bytes(p.tp) / gb:.2f} GB host memory per rank "
                     "(weights kept at sleep level 1)")
    if p.oversample > 1:
        seqs = suspended_sequences(p)
        lines.append(f"suspended rollouts: up to {seqs} sequences x {p.response_len} tokens = "
                     f"{seqs * p.response_len * SUSPENDED_TOKEN_BYTES / gb:.2f} GB host memory per rank "
                     f"(token ids, log-probs, versions; written into each checkpoint); their KV cache is "
                     f"refilled by a prefill in the next step")
    return lines
