"""vLLM's process-global state that two engines in one process (the policy's and a judge's or a
teacher's) would otherwise share, kept apart per engine. Used by ``rlcore.colocate_rollout`` only.

- **Rotary embeddings.** ``get_rope`` caches each rotary module in the process-global
  ``_ROPE_DICT`` by its shape key (vllm 0.32.0 model_executor/layers/rotary_embedding/__init__.py:29
  and :74-85), emptied only when an engine shuts down (v1/worker/gpu_model_runner.py:6241-6254,
  v1/worker/gpu/shutdown.py:10-19). A judge with the policy's head size, context and RoPE settings
  (any Qwen3 beside a Qwen3) would get the policy's module, whose ``cos_sin_cache`` buffer
  (rotary_embedding/base.py:58-63) was allocated in the policy's sleep-mode weights pool
  (v1/worker/gpu_worker.py:587-593): the judge's profile run then reads unmapped memory while the
  policy sleeps, and the judge's own storage sleep (rlcore.rollout.judge) frees the policy's buffer.
  ``engine_build`` gives each engine build an empty cache and puts the previous one back.
- **Workspace manager.** Every GPU worker's ``init_device`` re-binds the process-global
  ``workspace._manager`` (v1/worker/workspace.py:33 and :307-333, called from
  v1/worker/gpu_worker.py:547-558); the fused-MoE kernel takes its scratch from whatever is bound
  on every call (model_executor/layers/fused_moe/modular_kernel.py:1141-1144). Building a judge
  would leave the policy's MoE layers, and the CUDA graphs captured with them, on the judge's
  scratch. ``bind_workspace`` keeps the manager an engine's build created as that engine's own and
  binds it around the engine's calls; a build leaves the previous engine's manager bound. The CPU
  worker creates none (v1/worker/cpu_worker.py:107-175), so there both are None.
- **vllm-ascend's module globals** (``ASCEND_GLOBALS``, vllm-ascend 0.23.0): the rotary cos/sin state
  of ops/rotary_embedding.py:51-59. ``_record_cos_sin_cache`` (:104-108) keeps the first rotary
  module's ``cos_sin_cache`` (from ``AscendRotaryEmbedding.__init__`` :230-231, YaRN :285, DeepSeek
  :449-450), built in the policy's sleep-mode weights pool (worker/worker.py:681-692; unmapped at
  sleep, device_allocator/camem.py:204-217); ``set_cos_and_sin`` (:62-86) sizes ``_cos``/``_sin``
  once, by the first engine's ``max_num_batched_tokens`` and head size (model_runner_v1.py:500). Every
  forward of every engine fills them from that cache (``update_cos_sin`` :129-146, from
  worker/model_runner_v1.py:2266, :3580 in ``_dummy_run``; V2 runner v2/model_runner.py:364,
  v2/input_batch.py:105): a teacher would index the sleeping policy's buffer. The MC2 sizes
  (ascend_forward_context.py:198-199, set once at model_runner_v1.py:501-502, read per forward at
  :186, :333). The model-class flags of utils.py:70-75, computed once per process from the first
  config (``is_moe_model`` :937-943, ``is_drafter_moe_model`` :946-965, ``is_vl_model`` :1001-1029,
  ``has_rope`` :1032-1038, ``has_layer_idx`` :1281-1285; ``enable_sp`` :903-929, which vllm-ascend
  clears at every config init, ascend_config.py:933-937) and read per forward
  (ascend_forward_context.py:125-152): a teacher unlike the policy would be misclassified.
  ``_potential_max_tokens`` (utils.py:1213-1221: computed once, by the first engine's runner,
  model_runner_v1.py:505; read per forward, vocab_parallel_embedding.py:176, utils.py:1270). The
  ``AscendConfig`` of ``_ASCEND_CONFIG`` (ascend_config.py:897, rebuilt from the engine's
  ``additional_config`` whenever another engine's config is initialised, :913-929, platform.py:475,
  worker/worker.py:120) and read per forward (``get_ascend_config()`` :940-944, e.g.
  model_runner_v1.py:2623 enable_reduce_sample, ascend_forward_context.py:206 enable_prefill_mc2, :351
  enable_fused_mc2): without it the keys a user sets in rollout.engine_kwargs.additional_config would
  revert to the judge's or teacher's (vllm-ascend's defaults) once that engine is built.
  ``engine_build`` clears them before a build (so vllm-ascend computes the new engine's) and keeps
  what the build left as that engine's; ``bind`` binds an engine's own around its calls. The modules
  are looked up in ``sys.modules``, never imported here (NPUWorker.__init__ imports them,
  worker/worker.py:108-113, ops/__init__.py:33): without vllm-ascend (CPU, CUDA) all of it is a no-op.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

ASCEND_GLOBALS = {
    "vllm_ascend.ops.rotary_embedding": ("_cos_mla", "_sin_mla", "_cos_cache", "_sin_cache", "_cos_sin_cache",
                                         "_cos", "_sin", "_cos_slice", "_sin_slice"),
    "vllm_ascend.ascend_forward_context": ("_mc2_tokens_capacity", "_reserved_mc2_mask"),
    "vllm_ascend.utils": ("_IS_MOE_MODEL", "_IS_DRAFTER_MOE_MODEL", "_IS_VL_MODEL", "_ENABLE_SP", "_HAS_LAYER_IDX",
                          "_HAS_ROPE", "_potential_max_tokens"),
    "vllm_ascend.ascend_config": ("_ASCEND_CONFIG",),
}


def ascend_state() -> dict:
    """{module: {global: value}} of the vllm-ascend modules imported so far ({} without vllm-ascend)."""
    return {name: {k: getattr(sys.modules[name], k, None) for k in keys}
            for name, keys in ASCEND_GLOBALS.items() if sys.modules.get(name) is not None}


def _set_ascend(state: dict) -> None:
    for name, values in state.items():
        module = sys.modules.get(name)
        if module is not None:
            for k, v in values.items():
                setattr(module, k, v)


def _holds_any(state: dict) -> bool:
    return any(v is not None for values in state.values() for v in values.values())


@contextmanager
def bind_ascend(state: dict | None):
    """Bind an engine's own vllm-ascend globals for the duration (its calls), then the ones bound
    before; what the calls computed lazily (a flag's first read, the cos/sin slices) stays the engine's."""
    if not state:
        yield
        return
    previous = ascend_state()
    _set_ascend(state)
    try:
        yield
    finally:
        state.update(ascend_state())
        _set_ascend(previous)


@contextmanager
def bind(owned: dict):
    """Around an engine's calls: its own workspace manager and vllm-ascend globals (what its
    ``engine_build`` recorded in ``owned``)."""
    with bind_workspace(owned.get("workspace")), bind_ascend(owned.get("ascend")):
        yield


def _workspace_module():
    try:
        from vllm.v1.worker import workspace
    except ImportError:  # a vLLM without it (the NPU pin, vllm 0.23): nothing is shared
        return None
    return workspace


def bound_workspace():
    """The workspace manager bound now (None where there is none)."""
    ws = _workspace_module()
    return getattr(ws, "_manager", None) if ws is not None else None


@contextmanager
def bind_workspace(manager):
    """Bind ``manager`` for the duration (an engine's calls), then the one bound before."""
    ws = _workspace_module()
    if ws is None or ws._manager is manager:
        yield
        return
    previous, ws._manager = ws._manager, manager
    try:
        yield
    finally:
        ws._manager = previous


@contextmanager
def engine_build(owned: dict):
    """Around one engine's construction: an empty rotary cache of its own, and the workspace
    manager bound before it kept bound after it. ``owned["workspace"]`` receives the manager the
    build bound (the new engine's; the previous one where the build bound none); ``owned["ascend"]``
    the vllm-ascend globals the build computed from cleared ones (the previous engine's are bound
    again after it, where there were any)."""
    try:
        from vllm.model_executor.layers import rotary_embedding
    except ImportError:
        rotary_embedding = None
    ropes = getattr(rotary_embedding, "_ROPE_DICT", None)
    saved_ropes = dict(ropes) if ropes is not None else None
    if ropes is not None:
        ropes.clear()
    ws = _workspace_module()
    before = ws._manager if ws is not None else None
    saved_ascend = ascend_state()
    _set_ascend({name: dict.fromkeys(values) for name, values in saved_ascend.items()})
    try:
        yield owned
    finally:
        owned["ascend"] = ascend_state()
        if _holds_any(saved_ascend):
            _set_ascend(saved_ascend)
        owned["workspace"] = ws._manager if ws is not None else None
        if ws is not None and before is not None:
            ws._manager = before  # the previous engine's stays bound; the new one binds its own per call
        if ropes is not None:
            ropes.clear()
            ropes.update(saved_ropes)
