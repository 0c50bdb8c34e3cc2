"""LoRA for the policy engine: VeOmni's own LoRA stack (``veomni.lora``: PEFT-format adapters,
``LoraLinear`` = base(x) + B(A(dropout(x))) * alpha / r) on the FSDP2-sharded model. The parts of
``rlcore.engine_veomni.LoraPolicy`` (which is defined there, beside the engine it extends).

``LoraPolicy`` is ``VeOmniPolicy`` with the decoder's linear layers wrapped before sharding
(VeOmni loads the base weights under their PEFT names and initialises the adapters: A
Kaiming-uniform, B zero, so step 0 is the base model). Only adapter parameters require grad, so
the optimizer holds only them, and the checkpoint's optimizer state is the adapter's. What leaves
the engine:
    adapter_weights()   the adapter's tensors under PEFT's names (``base_model.model.<module>.
                        lora_A.weight``), whole on every rank: the weight sync writes them where
                        vLLM's LoRA loading reads them (rlcore.rollout.lora)
    named_hf_weights()  the HF checkpoint's names with the adapter merged in (W + scale * B @ A):
                        exports, and the full-weight path
    adapter_off()       a context in which every LoRA layer computes its base layer only: the KL
                        reference is the same model, no second copy
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlcore.engine.parts import hf_name

VISION_EXCLUDE = r".*\bvisual\b.*"  # regex over module names (VeOmni's mapping.py: full match)
PREFIX = "base_model.model."  # VeOmniLoraModel -> LoraModel -> the HF model, as PEFT names them
OFF = "__rlcore_adapter_off__"  # an adapter name no layer holds: adapter_off()


def veomni_config(lora):
    """``rlcore.config.lora.LoraConfig`` as VeOmni's ``VeOmniLoraConfig``."""
    from veomni.lora import VeOmniLoraConfig

    # Never the vision tower: Qwen2.5-VL's ViT MLP has gate/up/down_proj too; vLLM serves LoRA on the
    # language model only (its vision layers get no LoRA wrapper).
    return VeOmniLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.targets(),
                            lora_dropout=lora.dropout, exclude_modules=VISION_EXCLUDE)


def wrap(model, lora):
    """The meta-initialised model with LoRA layers (before FSDP2 shards it)."""
    from veomni.lora import VeOmniLoraModel

    if lora.path is not None:  # the adapter's own config; its weights load with the base (adapter_path)
        return VeOmniLoraModel.from_pretrained(model, lora.path, is_trainable=True)
    return VeOmniLoraModel(model, veomni_config(lora))


def peft_name(name: str) -> str:
    """A LoRA parameter's PEFT name: VeOmni's adds the adapter ("default") before ``.weight``."""
    return hf_name(name).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def merged(weights: Iterator[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the wrapped model as the HF checkpoint's names, each LoRA layer's
    base weight with ``scaling * B @ A`` added (in fp32, cast back); other tensors as they come.
    A layer's base weight and its two adapters arrive one after another (parameter order)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        name = hf_name(name).removeprefix(PREFIX)
        if ".lora_A." in name or ".lora_B." in name:
            module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]
        elif ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf != "weight":  # a bias: the base layer's, unchanged
                yield f"{module}.{leaf}", tensor
                continue
            kind = "W"
        else:
            yield name, tensor
            continue
        slot = pending.setdefault(module, {})
        slot[kind] = tensor
        if len(slot) == 3:
            parts = pending.pop(module)
            w = parts["W"].float() + scaling * (parts["B"].float() @ parts["A"].float())
            yield f"{module}.weight", w.to(parts["W"].dtype)
    if pending:
        raise RuntimeError(f"LoRA layers without their base weight or adapters: {sorted(pending)}")
