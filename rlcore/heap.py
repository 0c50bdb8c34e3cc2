"""The cyclic garbage collector during start-up.

A rank imports torch, transformers, vLLM and VeOmni: some 650k container objects that live for the
whole run. Python's collector walks all of them, which costs twice (2-core CPU machine, measured by
``scripts/bench_startup.py``):

- while importing: the automatic collections that a growing heap triggers: importing the stack
  took 6.1 s of CPU with the collector on, 4.9 s with it off;
- at every full ``gc.collect()``: 0.3-0.8 s per call and rank (654,528 objects; 6 us once frozen).
  The engines call it while they build: vLLM twice in its model loader (vllm 0.32.0
  model_executor/model_loader/base_loader.py:92 and :112), once before it freezes its heap
  (utils/gc_utils.py:129, ``freeze_gc_heap``) and after its profiling run
  (v1/worker/gpu_model_runner.py:6291, ``_cleanup_profiling_kv_cache``); VeOmni after loading the
  weights (veomni 0.1.12 utils/helper.py:568, ``empty_cache``). vLLM's worker shutdown unfreezes
  the heap and walks it twice more (gpu_worker.py:1607): a run's end skips that
  (``ColocateRollout.shutdown(exiting=True)``).

``gc.freeze()`` moves every object alive now into a permanent generation that collections skip
(reference counting still frees them): the same ``gc.collect()`` then takes microseconds. vLLM
freezes the whole process itself at the end of its engine's start-up (``freeze_gc_heap``), so
freezing earlier changes no run's lifetime rules, only what the collections before it cost.

An entry point turns the collector off on its first lines, before ``import rlcore`` (which imports
torch), with ``gc.disable()`` (train_grpo.py, tests/workers/*.py); explicit ``gc.collect()`` calls
still run, so the libraries free what they mean to. ``settle`` turns it back on once the engines
are built.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Everything alive now out of the collector's walk: call after a library's import and before its
    loader, whose ``gc.collect()`` calls then cost microseconds, not a walk of the imports' heap."""
    gc.freeze()


def settle() -> None:
    """The engines are built: what exists now lives for the run; collect from here on as usual."""
    gc.freeze()
    gc.enable()
