"""model.trust_remote_code: a model folder with its own modeling code (``auto_map`` in config.json).

Off (the default), such a folder stops the run at preflight: VeOmni would run the folder's
configuration code anyway (veomni 0.1.12 models/auto.py:127, ``build_config`` defaults
``trust_remote_code`` to True) and transformers would prompt on stdin for the tokenizer. On, the
folder's code runs in each engine:

* the trainer (VeOmni): VeOmni builds models by ``model_type`` from its own registry
  (models/loader.py:143, ``MODELING_REGISTRY[model_type](arch_name)``; an unknown type raises
  "Unknown Modeling name", utils/registry.py:31-32), with no transformers ``AutoModel`` fallback unless
  ``MODELING_BACKEND=hf`` (loader.py:144-170), and that fallback pops ``trust_remote_code``
  (loader.py:189). So ``register_veomni`` registers the folder's ``AutoModelForCausalLM`` class under
  its ``model_type``, with the log-prob forward VeOmni's own classes have (``veomni_forward``). A
  ``model_type`` VeOmni knows (e.g. deepseek_v3) keeps VeOmni's class.
* vLLM: ``trust_remote_code=True`` (rollout.settings.llm_kwargs). An architecture vLLM does not register
  runs on its Transformers backend, which builds the base model from ``auto_map["AutoModel"]`` with
  vLLM's attention and its own LM head (vllm 0.32.0 model_executor/models/registry.py:1222-1295,
  models/transformers/base.py:179, causal.py:45-66): code after the decoder (in the causal-LM head)
  runs in neither engine.
* the tokenizer: ``trust_remote_code`` to transformers' AutoTokenizer (not yet the image processor of a
  vision-language model: untested).

vLLM's Transformers backend edits the decoder class in place (vllm/compilation/decorators.py:353-378,
756: new base, ``__init__`` needing a vLLM config, ``__call__``), so the trainer imports its own copy
of the folder's code (``private_code_dir``): the two engines never share a class object.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from rlcore.hf_folder import read_config

POLICY_CLASS = "AutoModelForCausalLM"


def auto_map(path: str) -> dict:
    """The folder's ``auto_map`` (custom code entries), {} when it has none or no readable config."""
    try:
        config = read_config(path)
    except (OSError, ValueError):
        return {}
    value = config.get("auto_map") if isinstance(config, dict) else None
    return dict(value) if isinstance(value, dict) else {}


def refusal(path: str, key: str, trusted: bool, policy: bool) -> str | None:
    """Why the folder at ``path`` (the value of config key ``key``) cannot load, or None. ``policy``:
    the trained model (needs a causal-LM class); judges and the teacher load no custom code."""
    entries = auto_map(path)
    if not entries:
        return None
    listed = ", ".join(f"{k}: {v}" for k, v in entries.items())
    if not policy:
        return (f"{key}={path!r} carries its own modeling code (config.json auto_map: {listed}); custom code "
                f"runs for the policy only (model.trust_remote_code); use a model transformers and vLLM know")
    if not trusted:
        return (f"{key}={path!r} carries its own modeling code (config.json auto_map: {listed}) and "
                f"model.trust_remote_code is false; read the code in that folder, then set "
                f"model.trust_remote_code: true to run it (or use a model without auto_map)")
    missing = [c for c in (POLICY_CLASS, "AutoModel") if c not in entries]
    if missing:
        return (f"{key}={path!r}: its config.json auto_map ({listed}) lacks {', '.join(missing)}; the trainer "
                f"builds {POLICY_CLASS}, vLLM's Transformers backend builds AutoModel (the decoder); add both")
    return None


def private_code_dir(path: str) -> str:
    """A copy of the folder's *.py files under a name of its own (transformers names the dynamic
    module after the folder's base name), so the trainer's classes are not vLLM's."""
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    out = os.path.join(tempfile.gettempdir(), f"rlcore_trainer_code_{os.getpid()}", f"trainer_{digest}")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".py") or name == "config.json":
            shutil.copy2(os.path.join(path, name), os.path.join(out, name))
    return out


def trainer_classes(path: str):
    """(config class, causal-LM class) from the trainer's private copy of the folder's code."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    entries, code = auto_map(path), private_code_dir(path)
    config_cls = get_class_from_dynamic_module(entries["AutoConfig"], code) if "AutoConfig" in entries else None
    return config_cls, get_class_from_dynamic_module(entries[POLICY_CLASS], code)


def veomni_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """The causal-LM forward of VeOmni's patched classes (veomni/models/transformers/qwen3/
    qwen3_gpu_patch_gen_config.py:126-195, eager branch): the folder's decoder, then
    ``self.loss_function`` with the hidden states and LM-head weight, which VeOmni's LOSS_MAPPING
    routes to its chunked log-prob kernel on ``return_log_probs=True`` (ops/kernels/cross_entropy/
    __init__.py:107-160)."""
    from veomni.utils.model_outputs import CausalLMOutputWithLogProbs

    outputs = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                 use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    head = self.get_output_embeddings()
    loss = logits = aux = None
    if labels is not None:
        loss, _, aux = self.loss_function(logits=head(hidden) if "return_log_probs" not in kwargs else None,
                                          labels=labels, vocab_size=self.config.vocab_size, hidden_states=hidden,
                                          weights=head.weight, **kwargs)
    else:
        cut = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = head(hidden[:, cut, :])
    return CausalLMOutputWithLogProbs(loss=loss, logits=logits, fused_linear_aux=aux,
                                      past_key_values=outputs.past_key_values)


def register_veomni(path: str):
    """Register the folder's causal-LM class (the trainer's copy, with ``veomni_forward``) under its
    model_type in VeOmni's registry; return the config object to build it from (None: VeOmni
    already knows this model_type and builds its own class)."""
    from veomni.models.loader import MODELING_REGISTRY

    model_type = read_config(path).get("model_type")
    if model_type in MODELING_REGISTRY.valid_keys() and not getattr(MODELING_REGISTRY, "_rlcore", set()) >= {model_type}:
        return None
    config_cls, model_cls = trainer_classes(path)
    adapted = type(model_cls.__name__, (model_cls,), {"forward": veomni_forward, "__module__": model_cls.__module__})
    MODELING_REGISTRY.register(model_type, lambda _arch: adapted)
    MODELING_REGISTRY._rlcore = getattr(MODELING_REGISTRY, "_rlcore", set()) | {model_type}
    if config_cls is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=True)
    return config_cls.from_pretrained(path)
