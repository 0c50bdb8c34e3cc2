"""Mixture-of-experts support for the policy engine: VeOmni expert parallelism (EP), a pure-torch
EP experts kernel for CPU, expert weights out under the names vLLM and transformers load, and
router statistics. Owned by ``rlcore.engine_veomni`` (the only caller); like it, the only other
module that touches VeOmni, FSDP2 or DTensor.

Layout (veomni 0.1.12): ``init_parallel_state(..., extra_parallel_sizes=(ep,),
extra_parallel_names=("ep",))`` adds a second mesh ``("ep_fsdp", "ep")`` of shape
``(W / ep, ep)`` (veomni/distributed/parallel_state.py:456-472, 618-647). The Qwen3-MoE parallel
plan cuts ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``
on dim 0 over ``ep`` (veomni/models/transformers/qwen3_moe/parallel_plan.py:6-16; rank r owns
experts ``[r E/ep, (r+1) E/ep)``), then FSDP2 shards each rank's ``[E/ep, ...]`` block on dim 1
over ``ep_fsdp`` (veomni/distributed/torch_parallelize.py:523-562, 590-617); the rest of the
model is FSDP2 over all ranks as for a dense model.

Qwen3-VL-MoE (veomni/models/transformers/qwen3_vl_moe/, transformers 5.19) is the same inside:
its plan cuts ``model.language_model.layers.*.mlp.experts.{gate_up_proj,down_proj}`` on dim 0
(qwen3_vl_moe/parallel_plan.py:8-9); the patched experts hold ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]`` and call the same ``moe_experts``/``standard`` OpSlot with the
same arguments (generated/patched_modeling_qwen3_vl_moe_gpu.py:133, 427-428, 439-440); its
router returns ``(logits, scores, indices)`` (:471-479) as RouterStats reads them. What differs
is the checkpoint: fused expert tensors, transposed, instead of per-expert ones (``ExpertLayout``).

Experts kernel: VeOmni's EP dispatch exists only inside its fused kernels (Triton / NPU), and
``veomni.distributed.moe`` does not even import on a CPU-only torch (moe_layer.py:28 imports the
Triton group GEMM, which queries CUDA at import). Its eager experts index the expert tensors with
global ids (patched_modeling_qwen3_moe_gpu.py:273-297), which is wrong once EP has cut them. So
on CPU the experts OpSlot is bound to ``torch_ep_experts``, registered in VeOmni's
``KERNEL_REGISTRY`` (veomni/ops/kernel_registry.py:112-180): an all-to-all dispatch/combine over
the EP group with one SwiGLU per local expert. It cannot be named in ``OpsImplementationConfig``
(veomni/models/auto.py:164-171 passes the name to ``apply_veomni_fused_moe_patch``, which refuses
names it does not know), so the engine builds with ``eager`` and binds the slot afterwards.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

TORCH_EP = "torch_ep"
# model.moe_implementation values: what VeOmni's fused-MoE patch accepts (ops/kernels/moe/__init__.py:213-305)
FUSED = ("triton", "quack", "npu")
MOE_IMPLEMENTATIONS = ("auto", "eager", TORCH_EP, *FUSED)


def veomni_moe_implementation(impl: str, experts: int) -> str:
    """The value for VeOmni's ``OpsImplementationConfig.moe_implementation``: ``fused_<kernel>`` for
    a fused kernel, ``eager`` for a dense model, eager experts and the torch EP kernel (bound after
    the build). VeOmni 0.1.12 validates the name against the device at construction
    (veomni/arguments/arguments_types.py:1028-1036 ``_NPU_ALLOWED``, raised in
    ``_validate_implementations`` :1331-1372): on Ascend only ``fused_npu`` or ``eager`` pass, so the
    bare ``npu`` refused every NPU run, dense ones included; it strips the prefix to pick the kernel
    (veomni/models/auto.py:150-171)."""
    if experts == 0 or impl in ("eager", TORCH_EP):
        return "eager"
    if impl not in FUSED:
        raise ValueError(f"unknown MoE implementation {impl!r}: choose one of {', '.join(MOE_IMPLEMENTATIONS)}")
    return f"fused_{impl}"


def pick_moe_implementation(name: str, device_type: str, ep_size: int) -> str:
    """``auto``: VeOmni's fused kernel on accelerators (Triton on CUDA, its NPU kernel on Ascend),
    the pure-torch EP kernel on CPU. A fused kernel on CPU, or eager experts with EP, is refused."""
    if name not in MOE_IMPLEMENTATIONS:
        raise ValueError(f"unknown MoE implementation {name!r}: choose one of {', '.join(MOE_IMPLEMENTATIONS)}")
    if name == "auto":
        return {"cuda": "triton", "npu": "npu"}.get(device_type, TORCH_EP)
    if device_type == "cpu" and name in FUSED:
        raise ValueError(f"{name} is a fused {'NPU' if name == 'npu' else 'GPU'} kernel and does not run on cpu: "
                         f"use {TORCH_EP} (or auto)")
    if name == "eager" and ep_size > 1:
        raise ValueError(f"VeOmni's eager experts index the experts globally and are wrong with ep_size "
                         f"{ep_size} > 1: use {TORCH_EP} (or auto)")
    return name


# ---------------------------------------------------------------------------------------------
# the pure-torch EP experts
# ---------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with explicit splits; its backward is the reverse exchange (as
    veomni/distributed/moe/comm.py:20-54, which cannot be imported on CPU)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _ep_group():
    from veomni.distributed.parallel_state import get_parallel_state

    ps = get_parallel_state()
    return ps.ep_group if ps.ep_enabled else None


def _exchange(x: torch.Tensor, counts: torch.Tensor, e_local: int, group) -> tuple[torch.Tensor, list, list, list]:
    """Rows sorted by global expert -> this rank's experts' rows from every rank, grouped by
    local expert (expert j: rows from rank 0, 1, ...). Returns the rows, the per-local-expert
    counts and what ``_unexchange`` needs."""
    ep = dist.get_world_size(group)
    recv = torch.empty_like(counts)  # (ep * e_local,): per source rank, my experts' counts
    dist.all_to_all_single(recv, counts, group=group)
    send_splits = counts.view(ep, e_local).sum(1).tolist()
    recv_cnt = recv.view(ep, e_local)  # (src, local expert)
    recv_splits = recv_cnt.sum(1).tolist()
    x = _AllToAll.apply(x, recv_splits, send_splits, group)
    blocks = x.split(recv_cnt.reshape(-1).tolist())  # src-major
    perm = [s * e_local + j for j in range(e_local) for s in range(ep)]  # -> expert-major
    sizes = [int(recv_cnt[s, j]) for j in range(e_local) for s in range(ep)]
    return torch.cat([blocks[i] for i in perm]), recv_cnt.sum(0).tolist(), [perm, sizes, send_splits, recv_splits]


def _unexchange(y: torch.Tensor, group, perm, sizes, send_splits, recv_splits) -> torch.Tensor:
    blocks = y.split(sizes)
    where = {i: pos for pos, i in enumerate(perm)}
    y = torch.cat([blocks[where[i]] for i in range(len(perm))])  # back to src-major
    return _AllToAll.apply(y, send_splits, recv_splits, group)


def torch_ep_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts OpSlot ``(experts module, hidden (T, H), top_k_index (T, K), top_k_weights
    (T, K)) -> (T, H)``. Every local expert's weights enter the graph (an expert without tokens
    gets a zero gradient, not None, which FSDP2's reduce-scatter needs on every rank)."""
    k, e_total, e_local = top_k_index.shape[1], self.num_experts, self.gate_up_proj.shape[0]
    group = _ep_group()
    ep = 1 if group is None else dist.get_world_size(group)
    if e_local * ep != e_total:
        raise RuntimeError(f"experts: {e_local} local x ep {ep} != {e_total} experts (EP plan not applied?)")
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T*K,) (token, slot) pairs sorted by expert
    token_of = order // k
    x = hidden_states.index_select(0, token_of)  # (T*K, H)
    counts = torch.bincount(flat, minlength=e_total)  # (E,)
    if ep > 1:
        x, local_counts, back = _exchange(x, counts, e_local, group)
    else:
        local_counts = counts.tolist()
    outs = []
    for j, xj in enumerate(x.split(local_counts)):
        gate, up = F.linear(xj, self.gate_up_proj[j]).chunk(2, dim=-1)
        outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[j]))
    y = torch.cat(outs)
    if ep > 1:
        y = _unexchange(y, group, *back)
    y = y * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token_of, y.to(hidden_states.dtype))


def bind_experts(model, impl: str) -> list[str]:
    """Bind the ``moe_experts`` OpSlots of the model's modeling modules to ``impl`` (after
    ``build_foundation_model``, which binds every slot from the ops config on each call, so the
    reference model's build would otherwise reset the policy's choice: slots are module-wide)."""
    from veomni.ops.dispatch import OpSlot
    from veomni.ops.kernel_registry import KERNEL_REGISTRY, HardwareRequirement, KernelSpec

    if impl == TORCH_EP and TORCH_EP not in KERNEL_REGISTRY.list_available("moe_experts", "standard"):
        KERNEL_REGISTRY.register(KernelSpec(
            name=TORCH_EP, op_name="moe_experts", variant="standard", factory=lambda: torch_ep_experts,
            hardware=HardwareRequirement(device_type="any"),
            description="pure-PyTorch experts with all-to-all expert parallelism (rlcore)"))
    bound = []
    for mod_name in sorted({c.__module__ for m in model.modules() for c in type(m).__mro__}):
        module = sys.modules.get(mod_name)
        for attr in dir(module) if module is not None else ():
            slot = getattr(module, attr, None)
            if isinstance(slot, OpSlot) and slot.op_name == "moe_experts" and slot.variant == "standard":
                slot.bind(impl)
                bound.append(f"{mod_name}.{attr}")
    return bound


def gloo_sum_reduction(model) -> None:
    """VeOmni divides expert gradients by the world size (torch_parallelize.py:609-617); with
    ep < world the ``ep_fsdp`` group is smaller than that, so FSDP2 reduce-scatters with
    PREMUL_SUM (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:849-851), which gloo
    does not implement. Forcing SUM divides afterwards instead (same result). Not with a
    one-rank ``ep_fsdp`` group: torch 2.13 then divides twice (:629 and :686). The group's size is
    the ``ep_fsdp`` mesh dim: fsdp_size / ep under HSDP (veomni parallel_state.py:625-644), where
    VeOmni's ``ep_fsdp_size`` (:325, world / ep) would count the replicas too."""
    from torch.distributed.fsdp import FSDPModule
    from veomni.distributed.parallel_state import get_parallel_state

    ps = get_parallel_state()
    if dist.get_backend() != "gloo" or not ps.ep_enabled:
        return
    if ps.extra_parallel_fsdp_device_mesh["ep"]["ep_fsdp"].size() == 1:
        return
    for m in model.modules():
        meshes = [getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
                  for p in m.parameters(recurse=False)]
        if isinstance(m, FSDPModule) and any("ep_fsdp" in names for names in meshes):
            m.set_force_sum_reduction_for_comms(True)


def describe(model, impl: str, ep_size: int) -> str:
    """The start-up line's MoE part ("" for a dense model)."""
    if not any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters()):
        return ""
    return f", experts: {impl} kernel, expert parallel {ep_size}"


# ---------------------------------------------------------------------------------------------
# weights out
# ---------------------------------------------------------------------------------------------


def ep_dim(model, name: str) -> int | None:
    """The dim the EP plan cuts parameter ``name`` on, or None (not expert-parallel)."""
    from torch.distributed.tensor import Shard

    info = (getattr(model, "_fqn2spec_info", None) or {}).get(name)
    return info.placement.dim if info is not None and isinstance(info.placement, Shard) else None


def gather_ep(full_local: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's whole ``[E/ep, ...]`` expert block -> all ``[E, ...]`` experts (collective
    over the EP group; ``full_tensor()`` of an expert DTensor only gathers ``ep_fsdp``)."""
    from torch.distributed.tensor import DTensor, Shard
    from veomni.distributed.parallel_state import get_parallel_state

    ps = get_parallel_state()
    if not ps.ep_enabled:
        return full_local
    return DTensor.from_local(full_local, ps.ep_mesh, [Shard(dim)], run_check=False).full_tensor()


@dataclass(frozen=True)
class ExpertLayout:
    """How the model folder's checkpoint stores the routed experts, which is how they go out again
    (weight sync, HF export): vLLM reloads them with the loader that read that folder at start-up.

    * ``per_expert`` (Qwen3-MoE): ``...mlp.experts.{e}.{gate,up,down}_proj.weight``, as
      transformers 5.19 saves Qwen3-MoE and VeOmni stacks at load (qwen3_moe/
      checkpoint_tensor_converter.py:21-28, 86-104: gate rows first in ``gate_up_proj``).
    * fused (Qwen3-VL-MoE): ``...mlp.experts.gate_up_proj`` and ``...mlp.experts.down_proj``, one
      tensor each per layer; ``transposed``: ``[E, H, 2I]`` / ``[E, I, H]``, the released
      checkpoints' layout (qwen3_vl_moe/checkpoint_tensor_converter.py:23-29), which VeOmni
      transposes at load (:86-96) into the modeling's ``[E, 2I, H]`` / ``[E, H, I]``
      (generated/patched_modeling_qwen3_vl_moe_gpu.py:427-428) and vLLM 0.32 transposes back at
      load (``is_fused_checkpoint_transposed=True``, vllm/model_executor/models/qwen3_vl_moe.py:76;
      fused_moe/routed_experts.py:478-486, 1040-1053). Not transposed: transformers 5.19's own
      ``save_pretrained`` (its ``Transpose(1, 2, check_dims=True)``, conversion_mapping.py:1110-1120,
      is skipped when the shape already fits, core_model_loading.py:333-340), which vLLM 0.32
      cannot load (it always transposes a fused tensor).
    """
    per_expert: bool = True
    transposed: bool = False

    def describe(self) -> str:
        if self.per_expert:
            return "per-expert tensors"
        return "fused " + ("[E, H, 2I] / [E, I, H]" if self.transposed else "[E, 2I, H] / [E, H, I]")


PER_EXPERT = ExpertLayout()
FUSED_LAYOUT = ExpertLayout(per_expert=False, transposed=False)  # VeOmni's own [E, 2I, H] / [E, H, I]


def sync_layout(checkpoint: ExpertLayout) -> ExpertLayout:
    """How the experts go into vLLM at a weight sync where its loader takes them fused (the rollout
    asks the engine's own model: rollout.expert_layout.loader_takes; vllm 0.23's Qwen3-MoE does not):
    fused, whatever the checkpoint. vllm 0.32.0 loads a fused tensor under
    ``...mlp.experts.gate_up_proj`` / ``down_proj`` for every MoE model
    (``RoutedExperts.load_weights`` with ``get_expert_mapping(include_fused=True)``,
    model_executor/layers/fused_moe/routed_experts.py:981-1060: a 3-D tensor without an expert
    index is fused; w1/w3 are ``chunk(2, dim=1)`` of gate_up, gate first, as VeOmni stacks them;
    models/qwen3_moe.py:442 leaves ``.experts.gate_up_proj`` to it), transposed only where the
    model says its checkpoints are (Qwen3-VL-MoE, whose checkpoint layout is kept). Two tensors a
    layer instead of 3E (18,432 for Qwen3-30B-A3B instead of 96), each one weight-loader call."""
    return FUSED_LAYOUT if checkpoint.per_expert else checkpoint


def checkpoint_expert_layout(model_path: str) -> ExpertLayout:
    """The ``ExpertLayout`` of the checkpoint in ``model_path`` (PER_EXPERT for a dense model or
    a folder without safetensors). A fused layer's orientation comes from the pair of its tensors:
    one of them is square only when H = I or H = 2I, never both. Raises ValueError for a fused
    checkpoint VeOmni would load wrong: in the modeling's own layout with a square tensor, which
    VeOmni's Qwen3-VL-MoE converter takes for the released layout and transposes
    (qwen3_vl_moe/checkpoint_tensor_converter.py:91-92 test the released shape first)."""
    from rlcore.hf_folder import checkpoint_shapes, config_or_empty, num_experts

    config = config_or_empty(model_path)
    if not num_experts(config):
        return PER_EXPERT
    shapes = checkpoint_shapes(model_path)
    if not any(k.endswith(".mlp.experts.gate_up_proj") for k in shapes):
        return PER_EXPERT  # per-expert names (or none: VeOmni's loader then reports what is missing)
    text = config.get("text_config", config)
    h, i = int(text["hidden_size"]), int(text["moe_intermediate_size"])
    layouts = set()
    for name, gate_up in shapes.items():
        if not name.endswith(".mlp.experts.gate_up_proj"):
            continue
        down = shapes.get(name[: -len("gate_up_proj")] + "down_proj")
        plain = gate_up[1:] == (2 * i, h) and down is not None and down[1:] == (h, i)
        flipped = gate_up[1:] == (h, 2 * i) and down is not None and down[1:] == (i, h)
        if plain == flipped:
            raise ValueError(f"{model_path}: {name} {gate_up} and its down_proj {down} fit neither expert layout "
                             f"for hidden_size {h}, moe_intermediate_size {i}")
        layouts.add(flipped)
    if len(layouts) != 1:
        raise ValueError(f"{model_path}: the layers' fused experts are stored in different layouts")
    transposed = layouts.pop()
    if not transposed and h in (i, 2 * i):
        raise ValueError(f"{model_path}: fused experts stored as [E, 2I, H] / [E, H, I] (transformers' "
                         f"save_pretrained) with hidden_size {h} and moe_intermediate_size {i}: a square expert "
                         f"tensor, which VeOmni's loader transposes by mistake. Store them as released, "
                         f"[E, H, 2I] / [E, I, H], which vLLM needs anyway")
    return ExpertLayout(per_expert=False, transposed=transposed)


def split_experts(name: str, full: torch.Tensor, layout: ExpertLayout = PER_EXPERT
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """VeOmni's fused expert tensors (``[E, 2I, H]`` / ``[E, H, I]``) in the checkpoint's
    ``layout``: per-expert names (gate rows first in gate_up_proj), or the fused tensor under its
    own name, transposed when the checkpoint is; any other parameter unchanged."""
    is_gate_up, is_down = name.endswith(".mlp.experts.gate_up_proj"), name.endswith(".mlp.experts.down_proj")
    if not (is_gate_up or is_down):
        yield name, full
    elif not layout.per_expert:
        yield name, full.transpose(1, 2).contiguous() if layout.transposed else full
    elif is_gate_up:
        prefix, inter = name[: -len("gate_up_proj")], full.shape[1] // 2
        for e in range(full.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", full[e, :inter]
            yield f"{prefix}{e}.up_proj.weight", full[e, inter:]
    else:
        prefix = name[: -len("down_proj")]
        for e in range(full.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", full[e]


# ---------------------------------------------------------------------------------------------
# router statistics
# ---------------------------------------------------------------------------------------------


class RouterStats:
    """Forward hooks on the routers: per-layer token counts per expert and mean router
    probabilities over the train forwards since the last ``metrics()``. ``output_router_logits``
    cannot be used instead: with the log-prob path the model's own aux-loss line fails (its
    ``loss`` is None, patched_modeling_qwen3_moe_gpu.py:843)."""

    def __init__(self, model):
        self.counts: dict[str, torch.Tensor] = {}  # layer -> (E,) routed (token, slot) pairs
        self.probs: dict[str, torch.Tensor] = {}  # layer -> (E,) summed router probabilities
        self.tokens: dict[str, float] = {}
        self.routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        for name, module in self.routers:
            module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def record(module, _args, output):
            if not torch.is_grad_enabled():  # old/ref log-probs: not the update's routing
                return
            logits, _, index = output  # (T, E), (T, K), (T, K)
            with torch.no_grad():
                e = logits.shape[-1]
                self.counts[name] = self.counts.get(name, 0) + torch.bincount(index.reshape(-1), minlength=e).float()
                self.probs[name] = self.probs.get(name, 0) + logits.float().softmax(-1).sum(0)
                self.tokens[name] = self.tokens.get(name, 0.0) + logits.shape[0]
        return record

    def metrics(self) -> dict[str, float]:
        """Global over ranks (collective): ``actor/moe_aux_loss`` (Switch/Qwen load-balancing
        loss E * sum_e f_e P_e, 1.0 when balanced), ``actor/moe_load_max`` and
        ``actor/moe_load_mean`` (the busiest expert's token share x E: max and mean over layers;
        1.0 = balanced, E = one expert takes everything)."""
        if not self.routers:
            return {}
        names = [n for n, _ in self.routers]
        e = next(iter(self.counts.values())).numel() if self.counts else 1
        from rlcore.dist import all_reduce_sum  # moves the numbers to the communication device (NCCL/HCCL)

        flat = torch.cat([torch.cat([self.counts.get(n, torch.zeros(e)).cpu(), self.probs.get(n, torch.zeros(e)).cpu(),
                                     torch.tensor([self.tokens.get(n, 0.0)])]) for n in names])
        flat = torch.tensor(all_reduce_sum(flat.tolist()))
        self.counts, self.probs, self.tokens = {}, {}, {}
        aux, load = [], []
        for row in flat.view(len(names), 2 * e + 1):
            counts, probs, tokens = row[:e], row[e: 2 * e], max(row[-1].item(), 1.0)
            share = counts / counts.sum().clamp(min=1)
            aux.append(e * (share * probs / tokens).sum().item())
            load.append(e * share.max().item())
        return {"actor/moe_aux_loss": sum(aux) / len(aux), "actor/moe_load_max": max(load),
                "actor/moe_load_mean": sum(load) / len(load)}
