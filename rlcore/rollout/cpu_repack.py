"""vLLM on CPU keeps packed copies of some weights; an in-place reload must re-pack them.

vllm 0.32.0 on CPU does not run linear layers on their ``weight`` parameter: after loading, each
unquantized linear-like layer gets ``layer.cpu_linear``, a closure over a packed copy of the
weight (a oneDNN matmul handle or an sgl-kernel packed tensor; model_executor/layers/utils.py:
470-607, ``dispatch_cpu_unquantized_gemm``), and fused-MoE layers pre-pack their experts. The
layer-wise in-place reload (``reload_weights``, model_executor/model_loader/reload/layerwise.py)
re-runs that processing only for layers whose weights arrived in the call. Two cases escape it,
both silently (same shapes, no error, wrong log-probs), and both are fixed here:

- **Tied LM head.** With ``tie_word_embeddings`` the LM head is a module of its own sharing the
  embedding's Parameter (``ParallelLMHead.tie_weights``, vocab_parallel_embedding.py:88-92 and
  634-636), and the checkpoint (and the trainer's export) names only ``embed_tokens``. The reload
  writes the new matrix into that shared Parameter through the embedding layer; the LM head loads
  nothing, so it gets its old kernel tensors back without processing (layerwise.py:255-267) and
  keeps the packed copy built from the *first* checkpoint (``UnquantizedEmbeddingMethod.
  process_weights_after_loading``, vocab_parallel_embedding.py:67-71, packs on CPU only; logits go
  through ``apply`` -> ``cpu_linear``, :73-83). The engine then samples from the new body with the
  old head: SmolLM2-135M drifted to a max log-prob error of 0.625 after one lr-1e-2 step.
- **MoE experts.** See ``_cpu_moe_methods``.

On CUDA and Ascend neither applies: no layer has ``cpu_linear`` (vLLM's unquantized GEMM reads
``layer.weight`` directly there: utils.py ``dispatch_unquantized_gemm``; vllm-ascend 0.23 uses
vLLM's ``UnquantizedEmbeddingMethod`` for the LM head, ops/vocab_parallel_embedding.py:98, whose
``apply`` reads the shared weight), and MoE methods are not the CPU backend: both lists are empty.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def cpu_tied_linears(model) -> list:
    """Modules of ``model`` that compute through a CPU packed copy (``cpu_linear``) of a weight
    Parameter that another module also holds (a tied LM head and its embedding)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in getattr(module, "_parameters", {}).values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    out = []
    for module in model.modules():
        weight = getattr(module, "_parameters", {}).get("weight")
        method = getattr(module, "quant_method", None)
        if (weight is not None and hasattr(module, "cpu_linear") and holders.get(id(weight), 0) > 1
                and hasattr(method, "process_weights_after_loading")):
            out.append(module)
    return out


def _cpu_moe_methods(model) -> list:
    """The unquantized fused-MoE methods of ``model`` that run vLLM's CPU experts kernel.

    vllm 0.32.0: the first load pre-packs w13/w2 into the CPU kernel's layout
    (fused_moe/unquantized_fused_moe_method.py:166-205 -> fused_moe/experts/cpu_moe.py:208-218,
    ``cpu_prepack_moe_weight``), but a reload finds ``moe_kernel`` set, takes the weight-update
    branch (unquantized_fused_moe_method.py:187) and skips the pre-pack, and the layer-wise reload
    then copies checkpoint-layout tensors into the pre-packed storage (model_loader/reload/
    layerwise.py:417-433): same shapes, no error, wrong experts (log-probs off by 0.02-0.5 on a tiny
    Qwen3-MoE; a padded intermediate size crashes instead)."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # another vLLM layout (the NPU pin): nothing to do there
        return []
    seen, out = set(), []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if (isinstance(qm, UnquantizedFusedMoEMethod) and getattr(qm, "moe_kernel", None) is not None
                and getattr(qm, "unquantized_backend", None) == UnquantizedMoeBackend.CPU and id(qm) not in seen):
            seen.add(id(qm))
            out.append(qm)
    return out


@contextmanager
def cpu_repack_on_reload(model):
    """Wrap an in-place reload (``reload_weights``) of ``model`` so that every CPU packed copy
    matches the new weights afterwards. MoE: the kernel is cleared for the reload, so vLLM runs
    its first-load path (pad, pre-pack) on the new tensors; layers the reload did not touch get
    their kernel back. Tied heads: re-processed after the reload from the shared Parameter, which
    now holds the new values (a few ms: one pack of a vocab x hidden matrix). A no-op where no
    layer has a CPU packed copy (every accelerator)."""
    tied = cpu_tied_linears(model)
    saved = [(qm, qm.moe_kernel) for qm in _cpu_moe_methods(model)]
    for qm, _ in saved:
        qm.moe_kernel = None
    try:
        yield
    finally:
        for qm, old in saved:
            if qm.moe_kernel is None:
                qm.moe_kernel = old
    with torch.no_grad():
        for module in tied:
            module.quant_method.process_weights_after_loading(module)
