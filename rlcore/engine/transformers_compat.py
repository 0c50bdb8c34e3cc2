"""What VeOmni 0.1.12's vision-language modeling imports from transformers and the NPU pin's
transformers 5.5.4 lacks, put back before VeOmni builds a model.

VeOmni 0.1.12's generated modeling files for Qwen3-VL, Qwen3-VL-MoE (the seed run's model), Qwen2-VL,
Qwen2.5-VL, Qwen2.5-Omni, Qwen3-Omni-MoE, Qwen3.5 and Qwen3.5-MoE import
``transformers.utils.generic.accepts_precomputed_kwargs`` (e.g. veomni/models/transformers/qwen3_vl_moe/
generated/patched_modeling_qwen3_vl_moe_npu.py:89, decorating ``get_video_features`` :1868 and
``get_image_features`` :1893), and VeOmni imports that file when it builds the model
(qwen3_vl_moe/__init__.py:50-61). transformers 5.19 (the CUDA/CPU pin) has it (utils/generic.py:951-1010);
5.5.4 (vllm-ascend 0.23.0's pin, requirements-npu-base.txt) does not, so on Ascend the build raised
``ImportError: cannot import name 'accepts_precomputed_kwargs'`` before the first step (found by the NPU
twin, requirements-npu-twin.txt; VeOmni's wheel declares no transformers requirement).

``install`` defines it there, as transformers 5.19 writes it (the decorator only renames
modality-prefixed keyword arguments of ``get_<modality>_features``), where it is missing.

The same generated files leave ``get_input_embeddings`` of the multimodal model (``Qwen3VLMoeModel``)
to transformers' ``EmbeddingAccessMixin``, which 5.19 resolves through ``self.language_model``
(modeling_utils.py:992-999, its rule 4); 5.5.4's mixin has no such rule (modeling_utils.py:1006-1033) and
raises ``NotImplementedError`` in the first forward (where transformers 5.5.4's own Qwen3-VL-MoE defines
it as ``self.language_model.get_input_embeddings()``, models/qwen3_vl_moe/modeling_qwen3_vl_moe.py:1098-1099).
``install`` adds that rule where the mixin raises: the rules before it are 5.5.4's, unchanged.

VeOmni's Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni and Qwen3-Omni-MoE modeling imports the module
``transformers.vision_utils``, which 5.5.4 has none of (F8): ``install`` registers
``rlcore.engine.transformers_vision`` (5.19's helpers that VeOmni imports, copied line for line) under that
name where it is missing. With a transformers that has all of these, nothing changes.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from functools import wraps

# transformers 5.19.0 utils/generic.py:951-956
_KNOWN_MODALITIES = ("image", "video", "audio")
_FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def accepts_precomputed_kwargs(modality: str):
    """transformers 5.19.0's (utils/generic.py:959-1010): strips the modality prefix from keyword
    arguments that do not name a parameter, drops another modality's and the text model's flash varlen
    ones, and passes the rest."""
    prefix = f"{modality}_"
    other_prefixes = tuple(f"{m}_" for m in _KNOWN_MODALITIES if m != modality)

    def decorator(func):
        existing_params = set(inspect.signature(func).parameters)

        @wraps(func)
        def wrapper(*args, **kwargs):
            translated = {}
            for k, v in kwargs.items():
                if k.startswith(other_prefixes):
                    continue
                if k.startswith(prefix) and k not in existing_params:
                    translated[k.removeprefix(prefix)] = v
                elif k in _FLASH_VARLEN_KWARGS and k not in existing_params:
                    continue
                else:
                    translated[k] = v
            return func(*args, **translated)

        return wrapper

    return decorator


def _language_model_rule(resolve):
    """``EmbeddingAccessMixin.get_input_embeddings`` with transformers 5.19's rule 4 after ``resolve``'s."""

    @wraps(resolve)
    def get_input_embeddings(self):
        try:
            return resolve(self)
        except NotImplementedError:
            language_model = getattr(self, "language_model", None)
            if language_model is None or language_model is self or not hasattr(language_model, "get_input_embeddings"):
                raise
            return language_model.get_input_embeddings()

    get_input_embeddings.rlcore_language_model_rule = True
    return get_input_embeddings


def install() -> list[str]:
    """Define what transformers lacks of the above in its modules; the names it added."""
    import transformers.utils.generic as generic
    from transformers.modeling_utils import EmbeddingAccessMixin

    added = []
    if not hasattr(generic, "accepts_precomputed_kwargs"):
        generic.accepts_precomputed_kwargs = accepts_precomputed_kwargs
        added.append("transformers.utils.generic.accepts_precomputed_kwargs")
    resolve = EmbeddingAccessMixin.get_input_embeddings
    if "language_model" not in inspect.getsource(resolve) and not getattr(resolve, "rlcore_language_model_rule", 0):
        EmbeddingAccessMixin.get_input_embeddings = _language_model_rule(resolve)
        added.append("EmbeddingAccessMixin.get_input_embeddings: self.language_model")
    if _install_vision_utils():
        added.append("transformers.vision_utils")
    return added


def _install_vision_utils() -> bool:
    """``transformers.vision_utils`` from 5.19's helpers where transformers has no such module."""
    import transformers

    if "transformers.vision_utils" in sys.modules or importlib.util.find_spec("transformers.vision_utils"):
        return False
    from rlcore.engine import transformers_vision

    module = types.ModuleType("transformers.vision_utils", transformers_vision.__doc__)
    module.__dict__.update({name: getattr(transformers_vision, name) for name in transformers_vision.__all__})
    sys.modules[module.__name__] = module
    transformers.vision_utils = module  # `import transformers.vision_utils` binds it on the package too
    return True
