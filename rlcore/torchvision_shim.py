"""Make the public torchvision wheel importable beside a CPU-only torch.

vLLM's Qwen-VL processors (vllm/model_executor/models/qwen3_vl.py:37-48, qwen2_vl.py:38-43) import
transformers' Qwen2-VL image processor and the Qwen3-VL video processor, which import
``torchvision.transforms.v2`` at module level. The torchvision build that matches torch 2.13.0+cpu
is not on the public index; the public ``torchvision==0.28.0`` wheel installs (``--no-deps``,
scripts/setup_env.sh) but its compiled ops (``torchvision/_C.so``) link CUDA libraries and do not
load. ``import torchvision`` then fails in ``torchvision/_meta_registrations.py:163-189``, which
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` whatever
``extension._has_ops()`` says: "operator torchvision::nms does not exist".

``install()`` defines those two operator schemas (no kernels: nothing here calls NMS) when, and
only when, torchvision is installed, its ``_C`` cannot be loaded and nothing defined them yet;
with a working torchvision (CUDA, Ascend) it changes nothing. The image transforms the processors
use (resize, rescale, normalize) are plain torch code and work.

Two ways in, both idempotent:
* ``rlcore/__init__.py`` calls ``install()``: every process that imports rlcore first.
* ``scripts/setup_env.sh`` copies this file into the CPU venv's site-packages with a ``.pth``
  line that calls ``install_import_hook()``: any Python process of that venv (a user's
  ``python -c "from vllm import LLM"``, which reaches the processors through vLLM's model
  registry) runs ``install()`` right before its first torchvision import. The hook imports
  nothing at interpreter start-up; this file must therefore need nothing but the standard library
  and torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# torchvision/csrc/ops/nms.cpp and ops/quantized/cpu/qnms_kernel.cpp (v0.28.0): the schemas that
# _meta_registrations.py:163 and :177 register fakes for.
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY: list = []  # the torch.library.Library must stay alive for its definitions to stay
stubbed = False  # True once this copy defined the schemas (install() is then a no-op)


def install() -> bool:
    """Define the missing schemas if this process needs them; True when this copy did (now or before)."""
    global stubbed
    if stubbed or "torchvision" in sys.modules:
        return stubbed
    spec = importlib.util.find_spec("torchvision")  # finds without importing
    if spec is None or spec.origin is None:
        return False
    import torch

    if _defined(torch):  # the real ops, or the other copy of this module (the venv's hook) did it
        return False
    try:
        # What torchvision/extension.py:8-22 does first; a success here means the real ops exist.
        torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
        return False
    except (OSError, ImportError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS.values():
        lib.define(schema)
    _LIBRARY.append(lib)
    stubbed = True
    return True


def _defined(torch) -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018 (a lookup: raises when no schema exists)
        return True
    except (AttributeError, RuntimeError):
        return False


class _TorchvisionHook:
    """A ``sys.meta_path`` entry that runs ``install()`` once, when ``torchvision`` is first
    imported, and then steps aside (it finds nothing itself)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            install()
        return None


def install_import_hook() -> None:
    """Run ``install()`` lazily, right before the process's first torchvision import."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionHook())
