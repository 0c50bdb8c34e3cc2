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
"""

from __future__ import annotations

from contextlib import contextmanager


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
    build bound (the new engine's; the previous one where the build bound none)."""
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
    try:
        yield owned
    finally:
        owned["workspace"] = ws._manager if ws is not None else None
        if ws is not None and before is not None:
            ws._manager = before  # the previous engine's stays bound; the new one binds its own per call
        if ropes is not None:
            ropes.clear()
            ropes.update(saved_ropes)
