"""The policy engine (the design card's ``rlcore/engine_veomni.py``): a VeOmni-built HF causal LM
sharded with FSDP2 over every rank. ``VeOmniPolicy`` trains it; ``LoraPolicy`` is the same engine
with LoRA adapters; ``AdapterOffReference`` is a LoRA policy's KL reference.

This module and its parts in ``rlcore/engine/`` (the wing it heads: build, kernels, MoE, vision,
Ulysses, routing replay, LoRA layers, offload) are the only ones in the project that touch
VeOmni, FSDP2 or DTensor. Its other helpers get plain tensors and files only:
``rlcore.engine.bucket_gather`` gathers the local shards it is handed, ``rlcore.hf_folder`` writes the
HF folder, ``rlcore.engine.attention`` picks the attention kernel. Everything else sees plain tensors:
packed ``(1, L)`` token batches in, per-token log-probs out, and full HF-named weight tensors
streamed out for vLLM and for export. Vision-language models (Qwen3-VL) take their images with
the packed row (``forward_logprobs(mm=...)``, ``rlcore.engine.vl``).

Layout: one FSDP2 mesh over all ranks (``dp_shard = world_size``), each decoder layer its own
FSDP unit, weights loaded from an HF safetensors folder straight into the shards (meta init).
Sequences are packed without padding: ``position_ids`` restart at 0 for each sequence and the
attention mask is left as ``None``, which makes transformers build a block-causal mask
(an all-ones mask would let the packed sequences attend to each other).

Gradient averaging: FSDP2 averages gradients over ranks, so a caller that wants the global
token-mean gradient makes each rank's loss ``local_token_sum / global_token_count * world_size``.
Every method that runs a forward, gathers weights or touches the checkpoint is collective:
all ranks must call it the same number of times, in the same order.

Offload: ``offloaded`` says where parameters and optimizer state are. Checkpoint save/load and
weight export load what they need and offload it again afterwards, so the caller's phase does not
matter; forward with grad, backward and step refuse offloaded state, a no-grad forward loads the
parameters for itself (or once around a block: ``with ref.on_device():``). On CPU offloading moves
nothing, except under ``RLCORE_TEST_REAL_OFFLOAD=1`` (``rlcore.engine.offload``, for tests).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcore import hf_folder
from rlcore.dist import DistInfo
from rlcore.errors import writing
from rlcore.engine import lora as engine_lora, moe as engine_moe, optim as engine_optim, replay as engine_replay
from rlcore.engine import ulysses as engine_ulysses, vl as engine_vl
from rlcore.engine.attention import pick_attn_implementation
from rlcore.engine.bucket_gather import ShardSpec, SyncBuffers, SyncPlan
from rlcore.engine.build import build_sharded_model, ensure_parallel_state, install_cpu_shims
from rlcore.engine.kernels import describe_kernels, kernel_fields
from rlcore.engine.offload import HostCopies, OffloadState
from rlcore.engine.parts import (LrLambda, dim0_shard_group, eager_attention_mask, full_tensor, hf_name, hidden_rows,
                                 resume_lr_schedule)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _to_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class VeOmniPolicy(OffloadState):
    """A causal LM policy trained with FSDP2 (or a frozen reference policy).

    Args:
        model_path: local HF folder (config.json, safetensors, tokenizer files).
        info: from ``rlcore.dist.init_distributed()``; its device is used on cuda/npu.
        dtype: compute dtype. Trainable policies keep fp32 master weights and optimizer state
            and run forward/backward in ``dtype`` (FSDP2 mixed precision); a frozen policy keeps
            its weights in ``dtype``.
        trainable: False builds a reference policy: no optimizer, no gradients, forward only.
        gradient_checkpointing: recompute each decoder layer in backward.
        attn_implementation: "auto" or a name ``rlcore.engine.attention.pick_attn_implementation`` accepts
            for this device and dtype (sdpa, eager, flash_attention_2, _3, _4).
        offload_outside_forward: frozen policies only: keep the parameters on the host except
            around forwards (each forward, or a ``with on_device():`` block of them).
        lr, weight_decay, betas, adam_eps: the optimizer's (one group, decay on every parameter).
        optimizer, optimizer_state_dtype, kahan_summation: VeOmni's adamw or anyprecision_adamw, and the
            latter's state dtype and Kahan switch (None: VeOmni's defaults), ``rlcore.engine.optim``.
        lr_schedule, warmup_steps, min_lr_ratio, total_steps: see ``rlcore.engine.parts.LrLambda``.
        grad_clip: max global grad norm; ``None`` or <= 0 only measures the norm.
        ep_size: expert-parallel size for a mixture-of-experts model (divides the world size
            and the expert count); 1 = experts sharded by FSDP2 like any other weight.
        moe_implementation: the experts kernel, ``rlcore.engine.moe.pick_moe_implementation``.
        ops_overrides: VeOmni ``OpsImplementationConfig`` fields to set over the device's choice
            (``rlcore.engine.kernels.fused_kernels``).
        freeze_vision_tower: vision-language models: the whole vision tower (``model.visual.*``:
            patch/position embeddings, ViT blocks, merger and deepstack mergers) gets no gradient
            and no optimizer state; the language model trains (``rlcore.engine.vl``).
        routing_replay: install a MoE routing-replay manager (``rlcore.engine.replay``), driven
            by ``routing(mode)`` and the token keys of ``forward_logprobs``.
        ulysses_size: Ulysses sequence parallelism (``rlcore.engine.ulysses``): each group of this
            many consecutive ranks runs one packed row, 1/U of its positions each; the caller
            hands every rank of a group the same rows (``rlcore.algo.grpo``). 1 = off.
        fsdp_size: HSDP, shard over blocks of this many ranks, replicate across them (None = all).
    """

    _wrap = adapter_path = None  # LoRA (LoraPolicy below) sets both
    trainable_only = False  # checkpoints hold every parameter (LoRA: only the adapters; the base reloads)

    def __init__(self, model_path: str, info: DistInfo, *, dtype: str | torch.dtype = "float32", trainable: bool = True,
                 gradient_checkpointing: bool = False, attn_implementation: str = "auto",
                 offload_outside_forward: bool = False,
                 lr: float = 1e-6, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8, optimizer: str = "adamw", optimizer_state_dtype: str | None = None,
                 kahan_summation: bool | None = None, lr_schedule: str = "constant", warmup_steps: int = 0,
                 min_lr_ratio: float = 0.0, total_steps: int = 1, grad_clip: float | None = 1.0,
                 ops_overrides: dict | None = None, ep_size: int = 1, moe_implementation: str = "auto",
                 freeze_vision_tower: bool = False, routing_replay: bool = False, ulysses_size: int = 1,
                 fsdp_size: int | None = None, trust_remote_code: bool = False):
        dtype = str(_to_dtype(dtype)).removeprefix("torch.")  # validate; VeOmni wants the name
        if offload_outside_forward and trainable:
            raise ValueError("offload_outside_forward is for frozen (trainable=False) policies; the phase switch "
                             "offloads a trainable one")
        attn_implementation, self.attn_reason = pick_attn_implementation(attn_implementation, info.device_type,
                                                                         dtype=dtype)
        if ulysses_size > 1:  # VeOmni's Ulysses flash path for a flash kernel, else the project's sdpa one
            attn_implementation, self.attn_reason = engine_ulysses.attention_for(attn_implementation, self.attn_reason,
                                                                                 ulysses_size)
        install_cpu_shims()
        self.model_path, self.info, self.trainable = model_path, info, trainable
        self.device = info.device
        self.grad_clip = grad_clip
        self.dtype, self.attn_implementation = dtype, attn_implementation
        self.gradient_checkpointing = gradient_checkpointing and trainable
        self.offload_outside_forward = offload_outside_forward
        self.offloaded = {"params": False, "optimizer": False}  # where the state is now (see offload)
        self._host_copies = HostCopies.from_env(info.device_type)
        state = ensure_parallel_state(info, ep_size, ulysses_size, fsdp_size)
        self.ep_size, self.ulysses_size = ep_size, ulysses_size
        self.moe_implementation = engine_moe.pick_moe_implementation(moe_implementation, info.device_type, ep_size)
        self.expert_layout = engine_moe.checkpoint_expert_layout(model_path)  # how experts go out again
        self.kernels = kernel_fields(info.device_type, ops_overrides)
        self.model = build_sharded_model(
            model_path, info,
            master_dtype="float32" if trainable else dtype,
            compute_dtype=dtype,
            gradient_checkpointing=self.gradient_checkpointing,
            attn_implementation=attn_implementation,
            ops_overrides=ops_overrides,
            moe_implementation=self.moe_implementation,
            wrap=self._wrap, adapter_path=self.adapter_path, trust_remote_code=trust_remote_code,
        )
        self.sp = None  # rlcore.engine.ulysses.Context when ulysses_size > 1
        if ulysses_size > 1:
            self.sp = engine_ulysses.Context(state.ulysses_group, ulysses_size, state.ulysses_rank,
                                             flash=attn_implementation in engine_ulysses.FLASH)
            tower = engine_vl.vision_tower(self.model)
            family = getattr(getattr(self.model, "config", None), "model_type", None)
            if tower is not None and family not in engine_ulysses.VL_FAMILIES:
                raise ValueError(f"ulysses_size {ulysses_size}: a {family} vision tower has no Ulysses path "
                                 f"(only {', '.join(engine_ulysses.VL_FAMILIES)})")
            if not engine_ulysses.install(self.model, self.sp, tower):
                raise ValueError(f"ulysses_size {ulysses_size}: no attention layer with q_proj/k_proj in {model_path}")
        self.freeze_vision_tower = freeze_vision_tower and trainable
        if self.freeze_vision_tower:  # before the optimizer, which then leaves the tower out
            engine_vl.freeze_vision_tower(self.model)
        self.router_stats = engine_moe.RouterStats(self.model) if trainable else None
        self.replay = engine_replay.RoutingReplay(self.model) if routing_replay and trainable else None
        if self.replay is not None and self.sp is not None:  # a token's slice (rank) changes with the packing
            self.replay.group = self.sp.group
        self.optimizer = self.lr_scheduler = None
        self.lr_schedule_changes: list[str] = []  # config vs the resumed checkpoint's schedule
        if trainable:
            self.model.train()
            self._build_optimizer(dict(optimizer=optimizer, lr=lr, betas=betas, eps=adam_eps, weight_decay=weight_decay,
                                       state_dtype=optimizer_state_dtype, kahan_summation=kahan_summation),
                                  lr_schedule, warmup_steps, min_lr_ratio, total_steps)
        else:
            self.model.requires_grad_(False)
            self.model.eval()
        if offload_outside_forward:
            self.offload(params=True, optimizer=False)

    def describe(self) -> str:
        """One line for the start-up log: where and how this engine runs."""
        offload = ("as the phase switch is configured" if self.trainable else
                   "params on host outside forwards" if self.offload_outside_forward else "never")
        offload += " [RLCORE_TEST_REAL_OFFLOAD]" if self._host_copies is not None else ""
        return (f"{'policy' if self.trainable else 'reference'}: VeOmni FSDP2 over {self.info.world_size} x "
                f"{self.info.device_type}, master {'float32' if self.trainable else self.dtype} / compute "
                f"{self.dtype}, attention {self.attn_implementation} ({self.attn_reason}), "
                f"{describe_kernels(self.kernels)}, gradient checkpointing "
                f"{'on' if self.gradient_checkpointing else 'off'}, offload: {offload}"
                f"{engine_vl.describe(self.model, self.freeze_vision_tower or not self.trainable or self._wrap is not None)}"
                f"{engine_moe.describe(self.model, self.moe_implementation, self.ep_size)}"
                f"{f', Ulysses sequence parallel {self.ulysses_size}' if self.sp is not None else ''}")

    def _build_optimizer(self, optim_kw: dict, schedule, warmup_steps, min_lr_ratio, total_steps):
        # VeOmni's builder: torch AdamW (foreach) or AnyPrecisionAdamW over the sharded DTensor
        # parameters, one group with weight decay on every parameter (rlcore.engine.optim).
        self.optimizer = engine_optim.build(self.model, **optim_kw)
        # Under EP VeOmni builds one optimizer per mesh (experts, the rest) in a MultiOptimizer
        # (veomni/optim/optimizer.py:930-958), which is no torch Optimizer: one schedule each.
        lam = LrLambda(schedule, warmup_steps, total_steps, min_lr_ratio)
        self._lr_schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in self._inner_optimizers()]
        self.lr_scheduler = self._lr_schedulers[0]

    def _inner_optimizers(self) -> list:
        return list(getattr(self.optimizer, "optimizers_dict", {"all": self.optimizer}).values())

    @property
    def num_params(self) -> int:
        """Total (unsharded) parameter count; DTensor.numel() is the global size (of this rank's
        experts only, under EP)."""
        return sum(p.numel() * (self.ep_size if engine_moe.ep_dim(self.model, n) is not None else 1)
                   for n, p in self.model.named_parameters())

    # -----------------------------------------------------------------------------------------
    # forward / backward / step
    # -----------------------------------------------------------------------------------------

    def forward_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = False, grad: bool = True,
                         select: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                         mm: dict | None = None, token_keys: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of a packed batch.

        Args:
            input_ids, position_ids: ``(1, L)`` LongTensors. Several sequences packed without
                padding, ``position_ids`` restarting at 0 per sequence. With ``mm`` (images),
                ``position_ids`` is ``(4, 1, L)``: row 0 the text positions as above (they
                delimit the packed sequences when ``attention_mask`` is None), rows 1-3 the
                M-RoPE temporal/height/width positions of each sequence as transformers'
                ``Qwen3VLModel.get_rope_index`` computes them for that sequence alone.
            labels: without ``select``, ``(1, L)``: ``labels[t]`` is the token scored at ``t``
                (``input_ids[t + 1]`` inside a sequence) or -100. With ``select``, ``(1, K)``:
                the token scored at position ``select[k]``.
            select: ``(K,)`` positions whose hidden states go through the LM head (positions may
                repeat); the others never meet the vocabulary. None = all ``L``.
            attention_mask: None for block-causal attention derived from ``position_ids`` (row 0),
                or a ``(1, 1, L, L)`` bool mask, True where a query may attend to a key (sdpa/eager
                only; see ``rlcore.algo.packing.pack``; eager gets it as an additive float mask).
            mm: None, or for a vision-language model the row's images: ``pixel_values`` (P, C)
                float (the processor's patches, any float dtype) and ``image_grid_thw`` (I, 3)
                int of every image, in order of appearance of their ``<|image_pad|>`` runs in
                ``input_ids``; checked against the image-token count (``rlcore.engine.vl``).
            temperature: logits are divided by it before the softmax.
            grad: False runs under ``no_grad`` (always so for a frozen policy).
            token_keys: ``(1, L)`` int64 name of each position (``packing.pack``), for ``routing(mode)``.

        Offloaded parameters are loaded for a no-grad forward and offloaded again after it (wrap
        several in ``on_device()`` to move them once); a forward with grad raises instead.

        Returns:
            ``(logp, entropy)``, both float32 shaped like ``labels``, on the engine device, 0 where
            labels == -100; entropy is None unless ``with_entropy``.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"expected packed (1, L) inputs, got {tuple(input_ids.shape)}")
        grad = grad and self.trainable
        if grad:  # its backward would gather the parameters again, after an automatic re-offload
            self._require_resident("forward_logprobs(grad=True)", params=True)
        if self.sp is not None:  # the images are checked against the whole row, their patches sliced
            images = engine_vl.forward_kwargs(self.model, input_ids, position_ids, mm, self.device, self.sp)

            def sliced(ids, pos, lab, sel, keys):
                self._set_replay_keys(keys)
                extra = {**(images or {}), **self.sp.flash_kwargs(self.device)}  # flash: the whole row's cu_seq_lens
                return self._forward(ids, pos, lab, temperature, with_entropy, grad, sel, None, extra)

            out = engine_ulysses.run_sliced(self.sp, sliced, input_ids, position_ids, labels, select, attention_mask,
                                            token_keys)
            if not grad:  # no backward will re-run the attention (gradient checkpointing): drop the mask now
                self.sp.set_mask(None)
            return out
        if attention_mask is not None and self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"a custom attention mask needs sdpa or eager attention, not {self.attn_implementation}")
        if attention_mask is not None and self.attn_implementation == "eager":
            attention_mask = eager_attention_mask(attention_mask, _to_dtype(self.dtype))
        images = engine_vl.forward_kwargs(self.model, input_ids, position_ids, mm, self.device)
        self._set_replay_keys(token_keys)
        return self._forward(input_ids, position_ids, labels, temperature, with_entropy, grad, select, attention_mask,
                             images)

    def _set_replay_keys(self, token_keys: torch.Tensor | None) -> None:
        if self.replay is not None and self.replay.mode is not None:
            self.replay.keys = None if token_keys is None else token_keys.reshape(-1)

    def _forward(self, input_ids, position_ids, labels, temperature, with_entropy, grad, select, attention_mask,
                 images: dict | None = None):
        """The model's log-probs (and entropy) of one packed row as ``forward_logprobs`` describes."""
        with self._resident(params=True), torch.set_grad_enabled(grad), warnings.catch_warnings(), \
                hidden_rows(self.model, select):
            # FSDP2 warns that the (reshaped) log-prob output is a view; only an in-place op on it
            # would matter, and callers get it for arithmetic.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            out = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=position_ids.to(self.device),
                # None: transformers derives the block-causal mask from position_ids; a 4D mask
                # is used as is (transformers/masking_utils.py:813-815)
                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                labels=labels.to(self.device),
                # labels are already aligned with the positions that predict them, so hand them
                # over as shift_labels: VeOmni's log-prob kernel then skips its causal shift.
                shift_labels=labels.to(self.device),
                return_log_probs=True,  # chunked lm_head + log_softmax: no (L, V) logits kept
                temperature=float(temperature),
                use_cache=False,
                **(images or {}),
            )
        logp, entropy = out.fused_linear_aux.log_probs, out.fused_linear_aux.entropy  # (1, L), (1, L)
        if not grad:
            # VeOmni's kernel marks its outputs requires_grad whenever the lm_head weight does,
            # even under no_grad; detach so callers never build graphs on old/ref log-probs.
            logp, entropy = logp.detach(), entropy.detach()
        return logp, (entropy if with_entropy else None)

    def routing(self, mode: str | None, rows: tuple | None = None):
        """Context: the MoE routers record or replay each token's experts (rlcore.engine.replay);
        ``rows`` (R3: packing.rollout_routing) replace the step's routing before a replay."""
        if mode is None or self.replay is None:
            return contextlib.nullcontext()
        if mode == "record":
            self.replay.reset()
        elif rows is not None:
            self.replay.load(*rows)
        return self.replay.active(mode)

    def routing_metrics(self) -> dict[str, float]:
        """Replay agreement since the last call (collective); {} without a replay manager."""
        return {} if self.replay is None else engine_replay.metrics(self.replay)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients (FSDP2 reduce-scatters and averages them over ranks)."""
        if not self.trainable:
            raise RuntimeError("backward() on a frozen (trainable=False) policy")
        self._require_resident("backward()", params=True)
        loss.backward()

    def step(self) -> dict:
        """Clip, step AdamW (unless the grad norm is not finite), zero grads, advance the lr."""
        if not self.trainable:
            raise RuntimeError("step() on a frozen (trainable=False) policy")
        self._require_resident("step()", params=True, optimizer=True)
        lr = self.lr_scheduler.optimizer.param_groups[0]["lr"]
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        # VeOmni's FSDP2 clip: local shard norms all-reduced to the global norm, the same on every
        # rank, so the skip decision below is identical everywhere.
        grad_norm = self.model.clip_grad_norm_(max_norm)
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        for opt in self._inner_optimizers():
            opt.zero_grad(set_to_none=True)
        for sched in self._lr_schedulers:
            sched.step()
        if self.sp is not None:  # every backward of the mini-batch has run: the last row's mask goes
            self.sp.set_mask(None)
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped": int(skipped),
                **self.router_stats.metrics(), **(self.sp.pop_metrics() if self.sp is not None else {})}

    # -----------------------------------------------------------------------------------------
    # weights out, memory
    # -----------------------------------------------------------------------------------------

    def _reshard(self) -> None:
        """FSDP2 keeps the root's parameters (embeddings, norm, lm_head) unsharded after a forward
        that has no backward; put everything back into sharded DTensors before anything that
        reads parameters by name (state dicts, weight export, offload)."""
        self.model.reshard()

    @torch.no_grad()
    def named_hf_weights(self, dtype: str | torch.dtype | None = None, fused_experts: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one parameter at a time, on every rank (collective).

        Names are the HF checkpoint's (FSDP2 shards in place, VeOmni keeps HF module names);
        tied weights come once, under the name that owns them. Tensors stay on the engine
        device; casting happens on the local shard before the all-gather, so a bf16 export
        moves half the bytes. Peak extra memory: one full tensor (plus the parameter shards, for
        the duration, when they were offloaded). ``fused_experts``: routed experts as one fused
        tensor per layer and kind (the weight sync, ``engine_moe.sync_layout``), else in the
        checkpoint's layout (exports).
        """
        dtype = _to_dtype(dtype)
        layout = engine_moe.sync_layout(self.expert_layout) if fused_experts else self.expert_layout
        with self._resident(params=True):
            self._reshard()
            for name, param in self.model.named_parameters():
                yield from engine_moe.split_experts(hf_name(name), self._whole(name, param, dtype), layout)

    @torch.no_grad()
    def named_hf_weights_bucketed(self, dtype: str | torch.dtype | None = None, bucket_mb: float = 64.0,
                                  fused_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``named_hf_weights``, but many parameters per collective (collective).

        Parameters are packed into flat buckets of about ``bucket_mb`` MiB (gathered size) and
        each bucket is one gather over the FSDP2 shard group (``all_gather_into_tensor``; one
        broadcast per rank on gloo); see ``rlcore.engine.bucket_gather`` for the layout. The local shards
        are cast to ``dtype`` while being packed, so the gather moves rollout-dtype bytes.
        Bucket ``i + 1`` is gathered in the background while the caller consumes bucket ``i``:
        peak extra memory is about two buckets (the consumed bucket's full tensors, the next
        bucket's gather buffer; three buckets kept between syncs on CPU). On CPU the yielded
        tensors are views of reused buffers: one the caller keeps alive is never overwritten
        (a fresh buffer is taken then).
        A bucket never splits a "sync unit" (all parameters under one
        grandparent module, e.g. ``model.layers.3.self_attn``: q/k/v together, gate/up
        together), so a consumer that loads per bucket still sees vLLM's fused groups whole;
        a unit bigger than ``bucket_mb`` gets a bucket of its own.
        """
        dtype = _to_dtype(dtype)
        layout = engine_moe.sync_layout(self.expert_layout) if fused_experts else self.expert_layout
        with self._resident(params=True):
            self._reshard()
            plan = self._sync_plan(dtype, bucket_mb)
            params = dict(self.model.named_parameters())
            # Scratch buffers: kept between syncs on CPU, where fresh pages cost more than the
            # copies (three buckets, see SyncBuffers); freed after each sync on accelerators (about
            # two buckets), where the memory belongs to training in between and the caching
            # allocator makes the next allocation cheap.
            buffers = plan.kept_buffers if self.info.device_type == "cpu" else SyncBuffers(keep=False)
            for name, tensor in plan.run(lambda n: params[n].to_local(), lambda n: self._whole(n, params[n], dtype),
                                         self.device, buffers):
                yield from engine_moe.split_experts(name, tensor, layout)

    def _whole(self, name: str, param, dtype: torch.dtype | None) -> torch.Tensor:
        """One parameter whole (collective): gathered over FSDP2, and over EP for experts."""
        full = full_tensor(param, dtype, self.device)
        dim = engine_moe.ep_dim(self.model, name)
        return full if dim is None else engine_moe.gather_ep(full, dim)

    def _sync_plan(self, dtype: torch.dtype | None, bucket_mb: float) -> SyncPlan:
        """The bucket layout depends only on names, shapes, meshes and the two arguments: build
        it once per (dtype, bucket size) and reuse it every step."""
        key = (dtype, float(bucket_mb))
        cache = self.__dict__.setdefault("_sync_plans", {})
        if key not in cache:
            specs = [ShardSpec(name, hf_name(name), tuple(p.shape), p.dtype, dim0_shard_group(p))
                     for name, p in self.model.named_parameters()]
            cache[key] = SyncPlan.build(specs, dtype, int(bucket_mb * 2**20))
        return cache[key]

    def sync_plan_summary(self, dtype: str | torch.dtype | None = None, bucket_mb: float = 64.0) -> dict:
        """Buckets and collectives one bucketed export costs (for logs, tests, benchmarks)."""
        plan = self._sync_plan(_to_dtype(dtype), bucket_mb)
        return plan.summary()

    # -----------------------------------------------------------------------------------------
    # checkpoints
    # -----------------------------------------------------------------------------------------

    def _dcp_state(self, extra_state: dict) -> dict:
        state = {"model": self.model, "extra_state": extra_state}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        return state

    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None:
        """Collective DCP save of sharded model + optimizer, plus lr scheduler and ``extra_state``
        (any picklable dict, e.g. the trainer's step) in VeOmni's per-rank extra-state files.
        Offloaded state is loaded for the save and offloaded again: the save then runs exactly
        the path of a resident engine, at the cost of the trainer's sharded state on the device
        for its duration."""
        from veomni.checkpoint import build_checkpointer

        with self._resident(params=True, optimizer=True):
            self._reshard()
            engine = {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None}
            extra = {"engine": engine, "user": dict(extra_state or {})}
            build_checkpointer("dcp", "fsdp2").save(path, self._dcp_state(extra), trainable_only=self.trainable_only)

    def load_checkpoint(self, path: str) -> dict:
        """Collective DCP load into this (already built) engine; returns the saved extra_state.
        Loads into resident state, then restores the offload state: ``Optimizer.load_state_dict``
        moves optimizer state to its parameter's device (torch 2.13 torch/optim/optimizer.py:774-800),
        and a fresh optimizer's state comes from a step over the parameters (torch/distributed/
        checkpoint/state_dict.py:629-660), so neither may run on offloaded state."""
        from veomni.checkpoint import build_checkpointer

        with self._resident(params=True, optimizer=True):
            self._reshard()
            state = self._dcp_state({})
            build_checkpointer("dcp", "fsdp2").load(path, state, trainable_only=self.trainable_only)
        extra = state["extra_state"]
        if self.lr_scheduler is not None and extra["engine"]["lr_scheduler"] is not None:
            for sched in self._lr_schedulers:  # the same schedule on every sub-optimizer
                self.lr_schedule_changes = resume_lr_schedule(sched, extra["engine"]["lr_scheduler"])
        return extra["user"]

    def save_hf(self, path: str, dtype: str = "float32", max_shard_bytes: int = 4 * 2**30) -> None:
        """Write an HF safetensors folder (collective; rank 0 writes) that transformers and vLLM
        load: weights streamed from ``named_hf_weights`` into shards of at most
        ``max_shard_bytes``, config.json with the export dtype, and every other non-weight file
        of ``model_path`` (tokenizer, generation config, chat template) copied."""
        # named_hf_weights loads offloaded parameters for the export
        hf_folder.write_folder(self.named_hf_weights(dtype), path, self.model_path, dtype, self.info.is_main,
                               max_shard_bytes)
        dist.barrier()


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
        return engine_lora.wrap(model, self.lora)

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
                    yield engine_lora.peft_name(name), self._whole(name, param, dtype)

    def named_hf_weights(self, dtype=None, fused_experts: bool = False):
        return engine_lora.merged(super().named_hf_weights(dtype, fused_experts), self.scaling)

    def named_hf_weights_bucketed(self, dtype=None, bucket_mb: float = 64.0, fused_experts: bool = False):
        return engine_lora.merged(super().named_hf_weights_bucketed(dtype, bucket_mb, fused_experts), self.scaling)

    @contextlib.contextmanager
    def adapter_off(self):
        """Every LoRA layer computes its base layer only (VeOmni's LoraLinear skips an active
        adapter it does not hold, veomni/lora/layers.py:146-148)."""
        from veomni.lora import is_lora_linear

        layers = [m for m in self.model.modules() if is_lora_linear(m)]
        saved = [m.active_adapter for m in layers]
        for m in layers:
            m.active_adapter = engine_lora.OFF
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
        tensors = list(self.adapter_weights(dtype))  # collective: every rank gathers
        if self.info.is_main:
            with writing("the LoRA adapter export", path):  # a failure inside the run's export: recorded, barrier kept
                hf_folder.write_adapter(tensors, self.adapter_config(), path)
                hf_folder.copy_aux_files(self.model_path, path, dtype)
                os.remove(os.path.join(path, "config.json"))  # the base's: an adapter folder is not a model
        dist.barrier()


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
