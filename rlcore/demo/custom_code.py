"""A tiny model folder with its own modeling code (``auto_map`` in config.json), for the tests of
``model.trust_remote_code`` (rlcore/engine/remote_code.py).

The code subclasses transformers' Qwen3 classes (so VeOmni's FSDP2 wrapping, and vLLM's Transformers
backend, can run it) with one twist only this code knows: the base model multiplies the input
embeddings by ``config.embedding_multiplier``. A loader that fell back to plain Qwen3 would ignore it,
so log-probs that match transformers' forward with ``trust_remote_code=True`` prove the folder's own
code ran. The twist sits in the base model (``AutoModel``), the part every engine runs: vLLM's
Transformers backend builds the base model from ``auto_map["AutoModel"]`` and its own LM head.
"""

from __future__ import annotations

import json
import os

ARCH = "TinyCustomForCausalLM"
MODEL_TYPE = "tiny_custom"
AUTO_MAP = {
    "AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
    "AutoModel": "modeling_tiny_custom.TinyCustomModel",
    "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
}

CONFIGURATION = '''\
from transformers import Qwen3Config


class TinyCustomConfig(Qwen3Config):
    model_type = "tiny_custom"

    def __init__(self, embedding_multiplier=1.0, **kwargs):
        self.embedding_multiplier = embedding_multiplier
        super().__init__(**kwargs)
'''

MODELING = '''\
from transformers import Qwen3ForCausalLM, Qwen3Model

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomModel(Qwen3Model):
    config_class = TinyCustomConfig

    # Named arguments, as Qwen3Model's: vLLM's compile decorator looks them up by name
    # (vllm/compilation/decorators.py: "Argument position_ids not found in the forward method").
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # the twist: only this code knows the multiplier
        inputs_embeds = inputs_embeds * self.config.embedding_multiplier
        return super().forward(input_ids=None, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                               use_cache=use_cache, **kwargs)


class TinyCustomForCausalLM(Qwen3ForCausalLM):
    config_class = TinyCustomConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyCustomModel(config)
        self.post_init()
'''


def make_tiny_custom_model(out_dir: str, embedding_multiplier: float = 4.0, **tiny_kwargs) -> str:
    """The tiny Qwen3 of ``rlcore.demo.toy.make_tiny_model`` (same weights and tokenizer) re-labelled as
    ``tiny_custom`` with its configuration and modeling files beside config.json."""
    from rlcore.demo.toy import make_tiny_model

    make_tiny_model(out_dir, **tiny_kwargs)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(architectures=[ARCH], model_type=MODEL_TYPE, auto_map=AUTO_MAP,
                  embedding_multiplier=embedding_multiplier)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    for name, text in (("configuration_tiny_custom.py", CONFIGURATION), ("modeling_tiny_custom.py", MODELING)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    return out_dir
