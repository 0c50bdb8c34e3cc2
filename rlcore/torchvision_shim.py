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
only when, torchvision is installed and its ``_C`` cannot be loaded; with a working torchvision
(CUDA, Ascend) it changes nothing. The image transforms the processors use (resize, rescale,
normalize) are plain torch code and work. It runs from ``rlcore/__init__.py``, so it precedes
any torchvision import in every process that imports rlcore (trainer ranks, their in-process
vLLM engines, tests and scripts).
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
stubbed = False  # True when install() defined the schemas (for describe() lines and tests)


def install() -> bool:
    """Define the missing schemas if this process needs them; True when it did (now or before)."""
    global stubbed
    if stubbed or "torchvision" in sys.modules:
        return stubbed
    spec = importlib.util.find_spec("torchvision")  # finds without importing
    if spec is None or spec.origin is None:
        return False
    import torch

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
