"""After every weight sync, the trainer and vLLM must score a fixed probe alike (``rollout.check_sync``).

A sync can be silently wrong: every tensor pushed, no error, and the engine still samples from
another policy (a tied LM head kept its CPU packed copy of the first checkpoint: rlcore/rollout/cpu_repack.py;
q/k/v split over two load calls; a stale prefix cache). ``rollout/mismatch_*`` shows it on the
step's own samples, but nothing stopped a run on it. This check does, on every rank:

    before the push   the trainer scores the probe (teacher-forced, temperature 1), capturing the
                      outputs of the embedding, every decoder layer and the final norm
    after the push    vLLM scores the same tokens (``prompt_logprobs``: raw log-softmax, which is
                      what temperature 1 gives on the trainer's side)

The largest difference over all ranks is ``rollout/sync_probe_max`` (``_mean`` beside it). Above
the tolerance (``rollout.check_sync_tol``; null = ``TOLERANCE[dtype]``) the run names the first
parameter group whose output differs (vLLM re-scores the probe with its layers hooked; an eager
engine is needed for that: CUDA/ACL graphs skip Python hooks) and then warns (``warn``, the
default) or stops with exit code 4 (``strict``), before it trains on the engine's samples.

The probe is the first two training prompts (at most 64 tokens each, vision tokens removed), split
in half: the second half is scored as a response, through the trainer's own packing code.
"""

from __future__ import annotations


import logging
import re
from contextlib import contextmanager, nullcontext

import torch

from rlcore.algo import grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.dist import all_reduce_max, all_reduce_sum

log = logging.getLogger("rlcore.step.sync_check")

# Largest |trainer - vLLM| log-prob over the probe tokens that still counts as the same policy.
# fp32: measured 4.8e-7 (tiny Qwen3 / Llama, tied or not) and 6.2e-5 (SmolLM2-135M) on CPU; a
# stale tied head showed 0.010 after one lr-1e-6 step and 0.6 after one lr-1e-2 step.
# bf16/fp16: two different kernels each rounding at 8 (11) mantissa bits; see docs/platform.md.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}
# A group "agrees" when max|a - b| <= this x max|b| (relative; the localisation after a breach).
GROUP_RTOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
PROBE_PROMPTS = 2
PROBE_MAX_TOKENS = 64


class SyncMismatchError(RuntimeError):
    """rollout.check_sync=strict and vLLM scored the probe differently from the trainer."""


def probe_sequences(prompt_ids: list[list[int]], skip_ids=(), n: int = PROBE_PROMPTS,
                    max_len: int = PROBE_MAX_TOKENS) -> list[list[int]]:
    """The first ``n`` prompts with at least 4 tokens once ``skip_ids`` (vision slots) are removed,
    each cut to ``max_len`` tokens."""
    skip, out = set(skip_ids), []
    for ids in prompt_ids:
        kept = [t for t in ids if t not in skip][:max_len]
        if len(kept) >= 4:
            out.append(kept)
        if len(out) == n:
            break
    return out


def probe_batch(seqs: list[list[int]]) -> RolloutBatch:
    """Each sequence as prompt (first half) + response (second half), so that the trainer's own
    packing and response-only logits score it."""
    cut = [max(1, len(s) // 2) for s in seqs]
    resp = [s[c:] for s, c in zip(seqs, cut)]
    return RolloutBatch([s[:c] for s, c in zip(seqs, cut)], resp, [[0.0] * len(r) for r in resp],
                             [""] * len(seqs), ["length"] * len(seqs), 1)


# ----------------------------------------------------------------------------- parameter groups


def group_of(name: str) -> str | None:
    """The parameter group a module's output stands for: ``embedding``, ``layer N`` or ``final
    norm`` (HF names as VeOmni keeps them, and vLLM's; a vision tower's layers are not probed)."""
    if re.search(r"(^|\.)(visual|vision_tower|vision_model)(\.|$)", name):
        return None
    if name.endswith("embed_tokens"):
        return "embedding"
    m = re.search(r"(^|\.)layers\.(\d+)$", name)
    if m:
        return f"layer {m.group(2)}"
    if name.endswith("model.norm") or name == "norm" or name.endswith("language_model.norm"):
        return "final norm"
    return None


def _stream(output) -> torch.Tensor:
    """The residual stream a module hands on: HF layers return it (alone or first in a tuple);
    vLLM's decoder layers return (hidden, residual), whose sum it is; vLLM's final norm returns
    (normed, residual)."""
    if isinstance(output, tuple):
        if len(output) == 2 and isinstance(output[1], torch.Tensor) and output[1].shape == output[0].shape:
            return output[0] + output[1]
        output = output[0]
    return output


@contextmanager
def capture_groups(model):
    """Record each group's output (float32, on the CPU, flattened to (tokens, hidden)) while the
    block runs; yields the dict."""
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        group = group_of(name)
        if group is None:
            continue

        def hook(_m, _inp, output, group=group):
            if group == "final norm" and isinstance(output, tuple):
                out = output[0]  # vLLM: (normed, residual)
            else:
                out = _stream(output)
            captured[group] = out.detach().float().reshape(-1, out.shape[-1]).cpu()

        handles.append(module.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _group_order(name: str) -> tuple[int, int]:
    if name == "embedding":
        return (0, 0)
    if name == "final norm":
        return (2, 0)
    return (1, int(name.split()[1]))


def first_differing_group(trainer: dict[str, torch.Tensor], engine: dict[str, torch.Tensor], rtol: float,
                          tokens: int) -> tuple[str, str]:
    """(group, detail): the first group, in forward order, whose output differs; ``lm_head`` when
    every hidden group agrees (then only the head's weights, or its kernel, can explain it)."""
    compared = []
    for name in sorted(set(trainer) & set(engine), key=_group_order):
        a, b = trainer[name][:tokens], engine[name][:tokens]
        if a.shape != b.shape:
            return name, f"output shapes differ: trainer {tuple(a.shape)}, vLLM {tuple(b.shape)}"
        rel = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        if rel > rtol:
            before = f"; {compared[-1]} and all before it agree" if compared else ""
            return name, f"relative difference {rel:.2e} > {rtol:g}{before}"
        compared.append(name)
    if not compared:
        return "unknown", "no parameter group could be compared (no hooks fired: is the engine compiled?)"
    return "lm_head", f"the {len(compared)} groups before it agree within {rtol:g} (embedding .. final norm)"


# ----------------------------------------------------------------------------- the check


class SyncCheck:
    """One rank's check; ``before_sync`` and ``after_sync`` are collective (call them on every rank)."""

    def __init__(self, mode: str, dtype: str, probe: list[list[int]], device, tol: float | None = None,
                 is_main: bool = True, every: int = 1):
        if mode not in ("off", "warn", "strict"):
            raise ValueError(f"check_sync={mode!r}: choose off, warn or strict")
        self.mode, self.dtype, self.device, self.is_main = mode, dtype, device, is_main
        self.every, self.syncs = max(1, every), 0  # check the 1st sync and every ``every``-th after it
        self._force = False
        self.tol = TOLERANCE.get(dtype, 0.1) if tol is None else tol
        self.batch = probe_batch(probe) if probe else None
        self._trainer_lp: torch.Tensor | None = None
        self._trainer_groups: dict[str, torch.Tensor] = {}
        self.metrics: dict[str, float] = {}
        self.last_breach: tuple[str, str] | None = None  # (group, detail) of the latest breach

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.batch is not None

    def describe(self) -> str:
        if not self.enabled:
            return "off" if self.mode == "off" else "off (no probe: no prompt has 4 text tokens)"
        every = "every sync" if self.every == 1 else f"every {self.every} syncs"
        return f"{self.mode}, tol {self.tol:g}, {len(self.batch)} probe sequences, {every}"

    def before_sync(self, policy) -> str:
        """The trainer's log-probs of the probe (its parameters must still be the synced ones)."""
        if not self.enabled:
            return "no-op (rollout.check_sync off)"
        self.syncs += 1
        if (self.syncs - 1) % self.every and not self._force:
            return f"no-op (rollout.check_sync_every={self.every})"
        self._force = False
        # Under Ulysses sequence parallelism a rank's layers see a slice of the row: no per-layer
        # comparison then (a breach is reported without its first differing group).
        capture = capture_groups(policy.model) if getattr(policy, "sp", None) is None else nullcontext({})
        with capture as groups:
            lp = grpo.compute_logprobs_in_chunks(policy, self.batch, 1.0, len(self.batch), self.device)
        self._trainer_lp, self._trainer_groups = lp.cpu(), dict(groups)
        return f"trainer scored {int(self.batch.response_mask().sum())} probe tokens"

    def at_resume(self, step: int) -> None:
        """The next sync pushes the weights of ``step`` from a checkpoint: check it whatever the
        schedule (a resume is a path of its own), and count it as ``step``'s sync, so that the
        syncs after it are checked as in the run that was not interrupted."""
        self.syncs, self._force = step - 1, True

    def after_sync(self, rollout) -> str:
        """vLLM's log-probs of the same tokens; compare, log, and on a breach warn or raise."""
        if not self.enabled or self._trainer_lp is None:
            return "no-op (rollout.check_sync off or not due)"
        mask = self.batch.response_mask()  # (N, T)
        diff = ((self._engine_logprobs(rollout) - self._trainer_lp).abs() * mask)
        worst, = all_reduce_max([diff.max().item()])
        total, count = all_reduce_sum([diff.sum().item(), mask.sum().item()])
        self.metrics = {"rollout/sync_probe_max": worst, "rollout/sync_probe_mean": total / max(count, 1.0)}
        self._trainer_lp = None
        if worst <= self.tol:
            return f"vLLM agrees: max |d log-prob| {worst:.2e} <= {self.tol:g}"
        group, detail = self.last_breach = self._localise(rollout)  # every rank: the breach is global
        message = (f"after the weight sync vLLM scores the probe differently from the trainer: max |d log-prob| "
                   f"{worst:.3g} > rollout.check_sync_tol={self.tol:g} ({self.dtype}). First differing parameter "
                   f"group on this rank: {group} ({detail}). The engine would sample from a policy other than "
                   f"the one being trained. If the difference is expected numerical noise (other kernels, "
                   f"lower precision), raise rollout.check_sync_tol; otherwise report it with this message.")
        if self.mode == "strict":
            raise SyncMismatchError(message + " Stopped because rollout.check_sync=strict (warn only logs it).")
        if self.is_main:
            log.warning(message)
        return f"MISMATCH {worst:.2e} ({group})"

    def _engine_logprobs(self, rollout) -> torch.Tensor:
        b = self.batch
        scored = rollout.score([p + r for p, r in zip(b.prompt_ids, b.response_ids)])
        out = torch.zeros_like(b.response_mask())  # (N, T)
        for i, (p, r) in enumerate(zip(b.prompt_ids, b.response_ids)):
            out[i, : len(r)] = torch.tensor(scored[i][len(p) - 1:], dtype=out.dtype)
        return out

    def _localise(self, rollout) -> tuple[str, str]:
        """vLLM re-scores the first probe sequence with its groups hooked; compared with what the
        trainer's groups produced for the same tokens (the first sequence of its packed row)."""
        b = self.batch
        seq = b.prompt_ids[0] + b.response_ids[0]
        with capture_groups(rollout.probe_module()) as engine_groups:
            rollout.score([seq])
        rtol = GROUP_RTOL.get(self.dtype, 2e-2)
        return first_differing_group(self._trainer_groups, dict(engine_groups), rtol, tokens=len(seq))

    def pop_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
