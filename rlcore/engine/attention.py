"""Which attention kernel the policy runs on packed micro-batches, and why.

The trainer packs several sequences into one ``(1, L)`` row with ``position_ids`` restarting at 0
per sequence and ``attention_mask=None``. What each choice does with that (transformers 5.19,
VeOmni 0.1.12):

* ``flash_attention_2`` / ``_3`` / ``_4``: VeOmni renames them to its own
  ``veomni_flash_attention_{2,3,4}_with_sp`` (veomni/arguments/arguments_types.py:1239-1251, with
  ``MODELING_BACKEND=veomni``, the default of veomni/utils/env.py:24). Those names are not in
  transformers' mask table (transformers/masking_utils.py:714-724), so no mask is built at all
  (masking_utils.py:822-823), and VeOmni's forward (veomni/ops/kernels/attention/flash.py:153-301)
  calls transformers' ``_flash_attention_forward``, which detects the packing from
  ``position_ids`` and runs the varlen kernel (transformers/modeling_flash_attention_utils.py:
  838-850): no (L x L) tensor. On Ascend, the same call resolves to
  ``torch_npu.npu_fusion_attention`` with per-sequence lengths (modeling_flash_attention_utils.py:
  185-190, integrations/npu_flash_attention.py:86-130); flash-attn itself does not exist there.
  Each needs one entry point, which VeOmni imports when the first attention runs
  (veomni/ops/kernels/attention/flash.py:61-83): ``flash_attn.flash_attn_varlen_func`` (FA2),
  ``flash_attn_interface.flash_attn_varlen_func`` (FA3), ``flash_attn.cute.flash_attn_varlen_func``
  (FA4, the ``flash-attn-4`` wheel of requirements-cuda.txt; Hopper/Blackwell only). ``auto``
  probes exactly those: flash-attn-4 ships ``flash_attn/cute/`` and no ``flash_attn/__init__.py``,
  so a bare ``import flash_attn`` succeeds as an empty namespace package beside it and would
  wrongly select FA2, whose first forward then fails (transformers falls back to fetching a kernel
  from the Hub, modeling_flash_attention_utils.py:204-209).
* ``sdpa``: transformers finds the packing from ``position_ids``
  (masking_utils.py:731-760, 856-862) and, because a packed mask cannot use ``is_causal``
  (masking_utils.py:974-976), materialises a dense (1, 1, L, L) bool block-causal mask
  (masking_utils.py:470-540): L*L bytes per micro-batch, kept for the forward; each SDPA call
  also turns it into an additive mask of the query dtype (PyTorch
  aten/src/ATen/native/transformers/attention.cpp, ``convert_boolean_attn_mask``), and SDPA's
  own flash kernel refuses masks. Correct everywhere, and the only choice on CPU.
* PyTorch's own varlen kernel (``torch.nn.attention.varlen.varlen_attn``, torch 2.13, CUDA
  only) is not an attention implementation transformers 5.19 knows (no reference to it in
  transformers), so it is not offered here.

Plain Python: no VeOmni, FSDP2 or DTensor here (``rlcore.engine_veomni`` owns those), so the
config can resolve ``model.attn_implementation`` before any model is built.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

# The entry point each flash implementation calls on CUDA (module, attribute), in auto's order.
_FLASH_ENTRY = {"flash_attention_2": ("flash_attn", "flash_attn_varlen_func"),
                "flash_attention_3": ("flash_attn_interface", "flash_attn_varlen_func"),
                "flash_attention_4": ("flash_attn.cute", "flash_attn_varlen_func")}
_FLASH_PACKAGE = {"flash_attention_2": "flash-attn (built for this torch)", "flash_attention_3": "flash-attn-3",
                  "flash_attention_4": "flash-attn-4 with nvidia-cutlass-dsl (requirements-cuda.txt)"}
KNOWN = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# The flash kernels (and npu_fusion_attention) take fp16/bf16 only; VeOmni casts fp32 queries to
# the Linear weight dtype (flash.py:219-227), which is fp32 again in an fp32 run.
_FLASH_DTYPES = ("bfloat16", "float16")


# What ``auto`` and an explicit flash name assume about the GPU where a dry run (scripts/check_config.py
# --device cuda) has none to probe: None probes this machine; "fa4" an SM90+ GPU with the pinned
# flash-attn-4 of requirements-cuda.txt (the default of check_config.py); "older" a GPU before Hopper.
_ASSUMED_GPU: str | None = None


@contextlib.contextmanager
def assume_gpu(kind: str | None):
    """Resolve cuda attention for the GPU node a dry run targets (``_ASSUMED_GPU``), not this machine."""
    global _ASSUMED_GPU
    if kind not in (None, "fa4", "older"):
        raise ValueError(f"assume_gpu({kind!r}): use 'fa4' (SM90+ with flash-attn-4) or 'older'")
    before, _ASSUMED_GPU = _ASSUMED_GPU, kind
    try:
        yield
    finally:
        _ASSUMED_GPU = before


def flash_entry_available(impl: str) -> bool:
    """The implementation's entry point imports: a real import of the module (a flash-attn wheel
    built for another torch fails here) and the function on it (an empty namespace package, which
    flash-attn-4 leaves at ``flash_attn``, has none)."""
    module, attr = _FLASH_ENTRY[impl]
    try:
        return callable(getattr(importlib.import_module(module), attr, None))
    except Exception:  # ImportError, or an undefined-symbol OSError from a mismatched build
        return False


def _fa4_capable_gpu() -> bool | None:
    """FA4 runs on SM90 (Hopper) and SM100 (Blackwell); None when no GPU is visible (a dry run)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0] >= 9


def dense_mask_note(device_type: str, name: str = "sdpa") -> str:
    if name == "eager":  # transformers' eager_mask: an additive float mask, and full score matrices
        return (f"eager on {device_type} builds a dense (L x L) block-causal mask in the compute dtype per "
                f"packed micro-batch (L*L*itemsize bytes) and materialises the (L x L) scores of every head")
    return (f"sdpa on {device_type} builds a dense (L x L) block-causal bool mask per packed micro-batch "
            f"(L*L bytes: 1 GiB at L=32768, plus an L*L additive copy in the compute dtype inside each "
            f"attention call) and cannot use SDPA's flash kernel")


def pick_attn_implementation(requested: str, device_type: str, *, dtype: str | None = None) -> tuple[str, str]:
    """``(implementation, reason)`` for ``model.attn_implementation=requested`` on ``device_type``
    (cuda, npu or cpu) with compute ``dtype`` (None: not checked). ``auto`` picks the best kernel
    that works there; an explicit name is checked against the device. Raises ValueError with the
    fix when the name cannot run; warns when ``auto`` falls back to the dense-mask sdpa on an accelerator."""
    if requested not in KNOWN:
        raise ValueError(f"unknown attention implementation {requested!r}; use one of {', '.join(KNOWN)}")
    if requested == "auto":
        impl, reason = _auto(device_type, dtype)
    else:
        impl, reason = requested, _check_explicit(requested, device_type, dtype)
    if requested == "auto" and impl == "sdpa" and device_type != "cpu":  # an explicit sdpa says so itself
        warnings.warn(f"attention: {reason}", stacklevel=2)
    return impl, reason


def _auto(device_type: str, dtype: str | None) -> tuple[str, str]:
    if device_type == "cpu":
        return "sdpa", "auto on cpu: sdpa with the block-causal mask (no flash kernels on CPU)"
    if dtype is not None and dtype not in _FLASH_DTYPES:
        return "sdpa", f"auto: compute dtype {dtype} rules out the flash kernels; {dense_mask_note(device_type)}"
    if device_type == "npu":
        return "flash_attention_2", ("auto on npu: VeOmni's flash path runs torch_npu.npu_fusion_attention "
                                     "varlen over the packed sequences (no L x L mask)")
    if device_type == "cuda":
        if _ASSUMED_GPU == "fa4":
            return "flash_attention_4", ("auto on cuda, assumed for the dry run: an SM90+ GPU (Hopper/Blackwell) with "
                                         "the pinned flash-attn-4 (flash_attn.cute.flash_attn_varlen_func) over the "
                                         "packed sequences, no L x L mask; pass --pre-hopper for older GPUs")
        for impl, (module, attr) in _FLASH_ENTRY.items():
            if impl == "flash_attention_4" and (_ASSUMED_GPU == "older" or _fa4_capable_gpu() is False):
                continue
            if flash_entry_available(impl):
                return impl, f"auto on cuda: {module}.{attr} over the packed sequences (no L x L mask)"
        return "sdpa", (f"auto on cuda: no flash-attention entry point imports (flash_attn, flash_attn_interface, "
                        f"flash_attn.cute); {dense_mask_note(device_type)}; install flash-attn-4 (Hopper/Blackwell, "
                        f"requirements-cuda.txt) or build flash-attn to avoid it")
    raise ValueError(f"unknown device type {device_type!r} (expected cuda, npu or cpu)")


def _check_explicit(name: str, device_type: str, dtype: str | None) -> str:
    """The reason line for a valid explicit choice; ValueError with the fix for an invalid one."""
    if name in ("sdpa", "eager"):
        if device_type == "cpu":
            return f"{name} with the block-causal mask"
        return dense_mask_note(device_type, name)
    if device_type == "cpu":
        raise ValueError(f"{name} needs a CUDA GPU (or an Ascend NPU for flash_attention_2); on cpu set "
                         f"model.attn_implementation to auto or sdpa")
    if dtype is not None and dtype not in _FLASH_DTYPES:
        raise ValueError(f"{name} runs in bfloat16/float16 only, but the compute dtype is {dtype}; set "
                         f"model.dtype=bfloat16, or model.attn_implementation=sdpa")
    if device_type == "npu":
        if name != "flash_attention_2":
            raise ValueError(f"{name} is not available on Ascend NPUs; use flash_attention_2 "
                             f"(torch_npu.npu_fusion_attention) or auto")
        return "torch_npu.npu_fusion_attention varlen over the packed sequences (no L x L mask)"
    module, attr = _FLASH_ENTRY[name]
    if name == "flash_attention_4" and _ASSUMED_GPU is not None:
        if _ASSUMED_GPU == "older":
            raise ValueError("flash_attention_4 runs on Hopper/Blackwell (SM90+) only, and the dry run was told the "
                             "GPUs are older (--pre-hopper); set model.attn_implementation to auto or sdpa")
        return f"{module}.{attr} over the packed sequences (assumed for the dry run: SM90+ with the pinned flash-attn-4)"
    if not flash_entry_available(name):
        raise ValueError(f"{name} needs {module}.{attr}, which does not import here; install "
                         f"{_FLASH_PACKAGE[name]}, or set model.attn_implementation to auto or sdpa")
    return f"{module}.{attr} over the packed sequences (no L x L mask)"
