"""Pieces of the policy engine that need no VeOmni: the LR schedule (and how a resumed run
continues it), the response-only hook on the decoder, the eager form of a bool attention mask,
and the per-parameter helpers of the weight export (HF names, whole tensors from FSDP2's DTensor
shards). Used by ``rlcore.engine_veomni`` only."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.distributed.tensor import DTensor


class LrLambda:
    """Multiplier of the base lr after ``step`` optimizer steps (a class, so it pickles).

    Linear warm-up ``(step + 1) / warmup_steps`` (the first step already trains), then constant,
    or cosine from 1 to ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps``.
    """

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {schedule!r}")
        self.schedule, self.warmup, self.total, self.min_ratio = schedule, warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resume_lr_schedule(sched, saved: dict) -> list[str]:
    """Continue ``sched`` at the saved step count under the schedule built from the current
    config (lr, warm-up, total steps, min ratio), so that a resumed run can be extended or
    re-shaped; returns what differs from the checkpoint's schedule, for the log."""
    current = {"base lr": list(sched.base_lrs), **vars(sched.lr_lambdas[0])}
    sched.load_state_dict(saved)  # the step count, and the checkpoint's lambda settings and base lrs
    before = {"base lr": list(sched.base_lrs), **vars(sched.lr_lambdas[0])}
    sched.base_lrs = current.pop("base lr")
    vars(sched.lr_lambdas[0]).update(current)
    lrs = [base * lam(sched.last_epoch) for base, lam in zip(sched.base_lrs, sched.lr_lambdas)]
    # The optimizer's lr also comes back from the DCP param groups; set it here, so that the next
    # step's lr never depends on what DCP chose to restore.
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs
    now = {"base lr": sched.base_lrs, **current}
    names = {"base lr": "lr", "schedule": "lr_schedule", "warmup": "warmup_steps", "total": "total optimizer steps",
             "min_ratio": "min_lr_ratio"}
    return [f"{names.get(k, k)} {before.get(k)} -> {now[k]}" for k in now if before.get(k) != now[k]]


@contextlib.contextmanager
def hidden_rows(model, select: torch.Tensor | None):
    """Within the block, the decoder's last hidden states are cut to the rows ``select`` before
    the causal-LM head sees them: VeOmni's log-prob kernel projects every row it gets to the
    vocabulary (veomni/ops/kernels/cross_entropy/chunk_logprobs.py:162-176, and again in its
    backward :215-225) and only masks the -100 rows afterwards, and the causal-LM forward hands
    it ``outputs.last_hidden_state`` whole (veomni/models/transformers/llama/
    llama_gpu_patch_gen_config.py:156-195). A forward hook on the decoder is the one place between
    the two; the backward of ``index_select`` scatters (and sums, for repeated rows) the
    gradient back, so the parameter gradient is unchanged."""
    if select is None:
        yield
        return
    decoder = model.get_decoder()

    def cut(_module, _args, output):
        output.last_hidden_state = output.last_hidden_state.index_select(1, select.to(output.last_hidden_state.device))
        return output

    handle = decoder.register_forward_hook(cut)
    try:
        yield
    finally:
        handle.remove()


def eager_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool ``(1, 1, L, L)`` mask (True = may attend) as the additive float mask that eager
    attention needs: transformers' ``eager_attention_forward`` adds the mask to the scores
    (e.g. veomni/models/transformers/qwen3_vl/generated/patched_modeling_qwen3_vl_gpu.py:466-467)
    and a 4D mask reaches it unchanged (transformers/masking_utils.py:813-815), so a bool mask
    would add 1 or 0 and mask nothing. sdpa takes the bool mask as is. 0 where allowed, the
    dtype's minimum elsewhere, as transformers' own eager mask (masking_utils.py ``eager_mask``)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def hf_name(name: str) -> str:
    """Strip wrapper prefixes that activation checkpointing or torch.compile may insert."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def full_tensor(param, dtype: torch.dtype | None, device) -> torch.Tensor:
    """One parameter, whole, on ``device``: cast on the local shard first (a bf16 export moves
    half the bytes), moved to the device the group talks on (offloaded shards live on CPU)."""
    t = param.detach()
    if dtype is not None:
        t = t.to(dtype)
    if t.device != device:
        t = t.to(device)
    return t.full_tensor() if isinstance(t, DTensor) else t


def dim0_shard_group(param):
    """The process group to gather ``param`` over when it is a plain dim-0 FSDP2 shard (one
    ``Shard(0)`` mesh dim, the others ``Replicate``, as with FSDP and HSDP); None otherwise
    (not a DTensor, a scalar, or a layout the bucketed gather does not handle: it exports
    those alone through ``full_tensor``)."""
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(param, DTensor) or param.dim() == 0:
        return None
    shard_dims = [i for i, p in enumerate(param.placements) if type(p) is Shard]
    others_replicated = all(isinstance(p, Replicate) for i, p in enumerate(param.placements) if i not in shard_dims)
    if len(shard_dims) != 1 or param.placements[shard_dims[0]].dim != 0 or not others_replicated:
        return None
    return param.device_mesh.get_group(shard_dims[0])
