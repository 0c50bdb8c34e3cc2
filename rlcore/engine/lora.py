"""LoRA for the policy engine: VeOmni's own LoRA stack (``veomni.lora``: PEFT-format adapters,
``LoraLinear`` = base(x) + B(A(dropout(x))) * alpha / r) on the FSDP2-sharded model. An engine
module: the only LoRA code that touches VeOmni, FSDP2 or DTensors.

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

import contextlib
import os
from typing import Iterator

import torch

from rlcore.engine.parts import hf_name
from rlcore.engine.policy import VeOmniPolicy, _to_dtype

VISION_EXCLUDE = r".*\bvisual\b.*"  # regex over module names (VeOmni's mapping.py: full match)
PREFIX = "base_model.model."  # VeOmniLoraModel -> LoraModel -> the HF model, as PEFT names them
_OFF = "__rlcore_adapter_off__"


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


class LoraPolicy(VeOmniPolicy):
    """``VeOmniPolicy`` with LoRA (see the module docstring); ``lora`` is the config section.
    Checkpoints hold the adapters and their optimizer state only (VeOmni's DCP ``trainable_only``,
    dcp_checkpointer.py:198-242); the frozen base reloads from ``model.path`` at resume."""

    trainable_only = True

    def __init__(self, model_path: str, info, *, lora, merge_export: bool = False, **kwargs):
        self.lora, self.merge_export = lora, merge_export
        super().__init__(model_path, info, **kwargs)
        self.scaling = self.model.get_lora_config().scaling

    def _wrap(self, model):
        return wrap(model, self.lora)

    @property
    def adapter_path(self) -> str | None:
        return self.lora.path

    def adapter_config(self) -> dict:
        """PEFT's adapter_config.json for the adapter (what vLLM and PEFT read)."""
        cfg = self.model.get_lora_config()
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.r, "lora_alpha": cfg.lora_alpha,
                "target_modules": cfg.target_modules, "lora_dropout": cfg.lora_dropout, "bias": "none",
                "use_rslora": cfg.use_rslora, "base_model_name_or_path": os.path.abspath(self.model_path),
                "fan_in_fan_out": False, "modules_to_save": None}

    @torch.no_grad()
    def adapter_weights(self, dtype: str | torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter's tensors, whole, under PEFT names, on every rank (collective)."""
        dtype = _to_dtype(dtype)
        with self._resident(params=True):
            self._reshard()
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    yield peft_name(name), self._whole(name, param, dtype)

    def named_hf_weights(self, dtype=None, fused_experts: bool = False):
        return merged(super().named_hf_weights(dtype, fused_experts), self.scaling)

    def named_hf_weights_bucketed(self, dtype=None, bucket_mb: float = 64.0, fused_experts: bool = False):
        return merged(super().named_hf_weights_bucketed(dtype, bucket_mb, fused_experts), self.scaling)

    @contextlib.contextmanager
    def adapter_off(self):
        """Every LoRA layer computes its base layer only (VeOmni's LoraLinear skips an active
        adapter it does not hold, veomni/lora/layers.py:146-148)."""
        from veomni.lora import is_lora_linear

        layers = [m for m in self.model.modules() if is_lora_linear(m)]
        saved = [m.active_adapter for m in layers]
        for m in layers:
            m.active_adapter = _OFF
        try:
            yield
        finally:
            for m, active in zip(layers, saved):
                m.active_adapter = active

    def save_hf(self, path: str, dtype: str = "float32", max_shard_bytes: int = 4 * 2**30) -> None:
        """The PEFT adapter in ``path`` (with the base's tokenizer files) and, with
        ``merge_export`` (checkpoint.merge_lora), the merged model in ``path/merged``, a plain
        checkpoint transformers and vLLM load alone (collective)."""
        self.save_adapter(path, dtype)
        if self.merge_export:
            super().save_hf(os.path.join(path, "merged"), dtype, max_shard_bytes)

    def save_adapter(self, path: str, dtype: str = "float32") -> None:
        """PEFT adapter folder (collective; rank 0 writes): what PEFT, vLLM and ``lora.path`` load,
        with the base model's tokenizer files."""
        from rlcore import hf_folder

        tensors = list(self.adapter_weights(dtype))  # collective: every rank gathers
        if self.info.is_main:
            hf_folder.write_adapter(tensors, self.adapter_config(), path)
            hf_folder.copy_aux_files(self.model_path, path, dtype)
            os.remove(os.path.join(path, "config.json"))  # the base's: an adapter folder is not a model
        torch.distributed.barrier()


class AdapterOffReference:
    """The KL reference of a LoRA policy: the policy's own forward with the adapter off."""

    def __init__(self, policy: LoraPolicy):
        self.policy = policy

    def on_device(self):
        return contextlib.nullcontext()  # the policy's own parameters: resident while training

    def forward_logprobs(self, *args, **kwargs):
        with self.policy.adapter_off():
            return self.policy.forward_logprobs(*args, **kwargs)

    def describe(self) -> str:
        return "reference: the policy with its LoRA adapter off (no second copy of the base model)"
