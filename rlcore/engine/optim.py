"""The policy's optimizer, built by VeOmni's own ``build_optimizer`` (veomni 0.1.12
veomni/optim/optimizer.py:459-551): ``adamw`` (torch AdamW, foreach, fp32 state) or
``anyprecision_adamw`` (VeOmni's ``AnyPrecisionAdamW``, the llama-recipes optimizer, :184-286:
momentum, variance and a Kahan compensation buffer in a dtype of their own, bf16 by default).

VeOmni's builder hands AnyPrecisionAdamW only lr, betas, eps and weight decay (:543-544, and
:917-918 for each sub-optimizer of the expert-parallel ``MultiOptimizer``), so its state dtypes and
Kahan switch are the class defaults there. ``step()`` reads them from each param group
(:227-231: ``group["use_kahan_summation"]``, ``group["momentum_dtype"]``, ``group["variance_dtype"]``,
``group["compensation_buffer_dtype"]``), so ``build`` sets the chosen ones on every group of every
inner optimizer after VeOmni built it, and on its ``defaults`` (what VeOmni's
``restore_optimizer_param_group_defaults`` puts back into groups after a DCP load, :153-180).

Resume: ``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor to its
parameter's dtype (torch 2.13 torch/optim/optimizer.py:774-803), which a DCP load goes through
(torch/distributed/checkpoint/state_dict.py ``set_optimizer_state_dict``): the bf16 state of a
resumed run would come back as fp32 (twice the memory, different steps from the run that was never
stopped). A load post-hook casts it back to the group's dtypes (bf16 -> fp32 -> bf16 is exact).
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "anyprecision_adamw")
STATE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# AnyPrecisionAdamW's state key -> the param-group key holding its dtype
_STATE_DTYPE_KEYS = {"exp_avg": "momentum_dtype", "exp_avg_sq": "variance_dtype",
                     "compensation": "compensation_buffer_dtype"}


def inner_optimizers(optimizer) -> list:
    """The torch optimizers behind ``optimizer`` (VeOmni's MultiOptimizer under EP holds several)."""
    return list(getattr(optimizer, "optimizers_dict", {"all": optimizer}).values())


def anyprecision_overrides(state_dtype: str | None, kahan_summation: bool | None) -> dict:
    """The param-group keys to set over AnyPrecisionAdamW's defaults (None: keep VeOmni's default,
    bf16 state and Kahan summation on)."""
    out = {}
    if state_dtype is not None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
        out.update(dict.fromkeys(_STATE_DTYPE_KEYS.values(), STATE_DTYPES[state_dtype]))
    if kahan_summation is not None:
        out["use_kahan_summation"] = bool(kahan_summation)
    return out


def build(model, optimizer: str, lr: float, betas, eps: float, weight_decay: float,
          state_dtype: str | None = None, kahan_summation: bool | None = None):
    """VeOmni's optimizer over the sharded parameters: one group, weight decay on every parameter
    (empty no-decay lists); ``state_dtype`` / ``kahan_summation`` for anyprecision_adamw only."""
    from veomni.optim import build_optimizer

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer != "anyprecision_adamw" and (state_dtype is not None or kahan_summation is not None):
        raise ValueError(f"state_dtype / kahan_summation are anyprecision_adamw options, not {optimizer}'s")
    built = build_optimizer(model, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=False,
                            optimizer_type=optimizer, no_decay_modules=[], no_decay_params=[])
    if optimizer == "anyprecision_adamw":
        overrides = anyprecision_overrides(state_dtype, kahan_summation)
        for opt in inner_optimizers(built):
            _apply(opt, overrides)
            opt.register_load_state_dict_post_hook(lambda o, ov=overrides: _after_load(o, ov))
    return built


def _apply(opt, overrides: dict) -> None:
    from veomni.optim.optimizer import AnyPrecisionAdamW

    if not isinstance(opt, AnyPrecisionAdamW):
        raise TypeError(f"VeOmni built {type(opt).__name__} for optimizer_type='anyprecision_adamw'")
    # A load adds "differentiable" to the defaults (torch 2.13 Optimizer.__setstate__, optimizer.py:434,
    # run by load_state_dict :1018) and VeOmni's restore copies the defaults into the groups
    # (optimizer.py:153-180): set it from the start, so a resumed run's groups equal a straight one's.
    opt.defaults.setdefault("differentiable", False)
    opt.defaults.update(overrides)
    for group in opt.param_groups:
        group.setdefault("differentiable", False)
        group.update(overrides)


@torch.no_grad()
def _after_load(opt, overrides: dict) -> None:
    """After ``load_state_dict``: the configured options over the checkpoint's groups, and the
    state in its dtypes again (a Kahan buffer added when the config turned Kahan on)."""
    for group in opt.param_groups:
        for key in ("use_kahan_summation", *_STATE_DTYPE_KEYS.values()):  # what step() reads (:227-231); only
            group.setdefault(key, opt.defaults[key])  # those: a group of the run never stopped has no others
        group.update(overrides)
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            if group["use_kahan_summation"] and "compensation" not in state:
                state["compensation"] = torch.zeros_like(p, dtype=group["compensation_buffer_dtype"])
            for key, dtype_key in _STATE_DTYPE_KEYS.items():
                if key in state and state[key].dtype != group[dtype_key]:
                    state[key] = state[key].to(group[dtype_key])


def state_bytes(optimizer) -> tuple[int, int]:
    """(bytes of this rank's optimizer state tensors, elements of its trainable parameter shards):
    their ratio is the state's bytes per trainable parameter (what the memory plan counts)."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = numel = 0
    for opt in inner_optimizers(optimizer):
        for group in opt.param_groups:
            numel += sum(local(p).numel() for p in group["params"] if p.requires_grad)
        for state in opt.state.values():
            nbytes += sum(local(v).nbytes for v in state.values() if torch.is_tensor(v))
    return nbytes, numel
