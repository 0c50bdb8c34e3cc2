"""MoE routing replay for the policy engine, keyed by token identity so the forwards may pack the
samples differently. R2: record the routing of the step's first training forward, replay it in
the later ones. R3: replay the experts vLLM routed each token to while sampling (``load``; the
rows come from rlcore.rollout.routing and packing.rollout_routing). An engine module: it talks to
VeOmni's own hook.

VeOmni's hook (veomni/utils/moe_router_replay.py): a manager installed with
``set_active_replay`` gets ``on_router_forward(router, scores, top_k_indices)`` from every wired
``SparseMoeBlock.forward`` and returns the indices to use; the block then recomputes only the
gate weights from the router's own scores at those indices (softmax, gather, renorm, cast:
patched_modeling_qwen3_moe_gpu.py:356-368). The families wired are VeOmni's
``SUPPORTED_MOE_MODEL_TYPES`` (qwen3_moe, qwen3_5_moe, deepseek_v4 in veomni 0.1.12);
``validate_model_for_replay`` refuses the others. Qwen3-VL-MoE has no hook in veomni 0.1.12
(its block, patched_modeling_qwen3_vl_moe_{gpu,npu}.py:482-493, calls the experts with the
router's choice directly): the engine installs the same call at the same point on each of its
blocks, once (``OWN_HOOKS``). The hook sits in the block, before the experts call, so every
experts implementation (fused GPU/NPU kernels, rlcore.engine.moe's CPU EP path) gets the
replayed indices.

Token keys: the trainer packs samples into one (1, L) row per micro-batch (rlcore.algo.packing.pack) and
passes a key per position: a response token is (its sample, its position), a prompt token (its
group, its position), since every sample of a group sees the same prompt (shared or copied). The
router sees the row's tokens in order (hidden_states.view(-1, H)), on this rank only (expert
parallelism exchanges tokens after routing), so the keys line up with the hook's rows.

Under Ulysses sequence parallelism (``group`` set) a rank routes only its slice of each row, and
which slice holds a token depends on how the row was packed: an R2 recording is gathered over the
group before its first replay, so every rank replays any of the group's tokens. R3's rows are the
group's already (the group's samples are gathered before packing, ``grpo.sp_group_batch``). The
slices' padding has negative keys: recorded, never counted.
"""

from __future__ import annotations

import contextlib
import re
import types
from typing import Iterator

import torch

MODES = ("record", "replay")


def _qwen3_vl_moe_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL-MoE's SparseMoeBlock.forward with VeOmni's replay call, as VeOmni wires it into
    Qwen3-MoE's block (patched_modeling_qwen3_moe_gpu.py:345-370): only the indices may change,
    the gate weights are recomputed from the router's own scores with its own math (Qwen3-VL-MoE's
    router, patched_modeling_qwen3_vl_moe_gpu.py:471-479: fp32 softmax, top-k, renorm, cast), so
    a replay of the native choice is bit-identical to the native forward."""
    from veomni.utils.moe_router_replay import get_active_replay, maybe_replay_indices

    batch, seq, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    router_logits, routing_weights, selected = self.gate(x)
    if get_active_replay() is not None:
        scores = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        selected = maybe_replay_indices(self.gate, scores, selected)
        weights = scores.gather(1, selected)
        routing_weights = (weights / weights.sum(dim=-1, keepdim=True)).to(router_logits.dtype)
    return self.experts(x, selected, routing_weights).reshape(batch, seq, hidden)


# model_type -> the block forward installed where VeOmni has no replay hook for the family
OWN_HOOKS = {"qwen3_vl_moe": _qwen3_vl_moe_block_forward}


def supported_model_types() -> frozenset[str]:
    """The families replay works for: VeOmni's own list, and the ones the engine wires itself."""
    from veomni.utils.moe_router_replay import SUPPORTED_MOE_MODEL_TYPES

    return SUPPORTED_MOE_MODEL_TYPES | frozenset(OWN_HOOKS)


def install_hook(model) -> None:
    """VeOmni's own check for the families it wires; the engine's block forward for OWN_HOOKS."""
    from veomni.utils.moe_router_replay import SUPPORTED_MOE_MODEL_TYPES, validate_model_for_replay

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in SUPPORTED_MOE_MODEL_TYPES or model_type not in OWN_HOOKS:
        validate_model_for_replay(model)  # a RuntimeError naming the wired families
        return
    for module in model.modules():
        if type(module).__name__.endswith("SparseMoeBlock") and not getattr(module, "_rlcore_replay", False):
            module.forward = types.MethodType(OWN_HOOKS[model_type], module)
            module._rlcore_replay = True


class RoutingReplay:
    """A VeOmni router-replay manager. ``record`` stores each token's top-k per layer; ``replay``
    returns the stored top-k for every token it has (the native choice otherwise, counted as
    missing) and counts, per layer, the tokens whose native top-k (as a set) already agreed."""

    def __init__(self, model):
        install_hook(model)
        routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        self.layer_of = {id(m): i for i, (_, m) in enumerate(routers)}
        # each router's decoder layer (vLLM's routed-experts rows index layers so: dense ones stay empty)
        self.decoder_layer = [int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, _ in routers]
        self.mode: str | None = None
        self.keys: torch.Tensor | None = None  # (L,) int64 keys of the forward in flight
        self._chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._free = torch.zeros(0, dtype=torch.long)  # sorted keys whose native choice is fine (R3)
        self.group = None  # the Ulysses group whose recordings are pooled (rlcore.engine.ulysses)
        self.reset_counts()

    def reset(self) -> None:
        """Forget the step's routing (a new step routes anew)."""
        self._chunks, self._tables, self._free = {}, {}, torch.zeros(0, dtype=torch.long)
        self.reset_counts()

    def load(self, keys: torch.Tensor, experts: torch.Tensor, free: torch.Tensor) -> None:
        """R3: replace the step's routing with given rows: ``keys`` (M,), ``experts`` (M, layers, K)
        indexed by decoder layer (vLLM's layout, packing.rollout_routing), ``free`` the keys that
        may route natively without counting as missing."""
        self.reset()
        if len(keys) and experts.shape[1] <= max(self.decoder_layer, default=-1):
            raise RuntimeError(f"routing replay r3: vLLM returned {experts.shape[1]} layers of routed experts, "
                               f"the policy routes in decoder layer {max(self.decoder_layer)}: not the same model")
        order = torch.argsort(keys, stable=True)
        for layer, d in enumerate(self.decoder_layer):
            self._tables[layer] = (keys[order], experts[order, d])
        self._free = free.sort().values

    def reset_counts(self) -> None:
        n = len(self.layer_of)
        self.agree, self.seen, self.missing = torch.zeros(n), torch.zeros(n), 0

    @contextlib.contextmanager
    def active(self, mode: str) -> Iterator["RoutingReplay"]:
        from veomni.utils.moe_router_replay import set_active_replay

        if mode not in MODES:
            raise ValueError(f"unknown routing replay mode {mode!r}; valid: {', '.join(MODES)}")
        self.mode = mode
        set_active_replay(self)
        try:
            yield self
        finally:
            set_active_replay(None)
            self.mode, self.keys = None, None

    def on_router_forward(self, module, routing_scores: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        layer = self.layer_of[id(module)]
        keys = self.keys
        if keys is None or keys.numel() != top.shape[0]:
            raise RuntimeError(f"routing replay: the router saw {top.shape[0]} tokens but the forward was given "
                               f"{None if keys is None else keys.numel()} token keys (forward_logprobs(token_keys=))")
        keys = keys.to(top.device)
        if self.mode == "record":
            self._chunks.setdefault(layer, []).append((keys, top.detach().clone()))
            self._tables.pop(layer, None)
            return top
        sorted_keys, table = self._table(layer, top)
        at = torch.searchsorted(sorted_keys, keys).clamp(max=max(len(sorted_keys) - 1, 0))
        found = sorted_keys[at] == keys if len(sorted_keys) else torch.zeros_like(keys, dtype=torch.bool)
        given = table[at].to(device=top.device, dtype=top.dtype) if len(table) else top
        target = torch.where(found.unsqueeze(-1), given, top)  # (L, K)
        real = keys >= 0  # not a Ulysses slice's padding
        same = (target.sort(-1).values == top.sort(-1).values).all(-1) & found & real
        self.agree[layer] += same.sum().item()
        self.seen[layer] += (found & real).sum().item()
        self.missing += int((~found & real & ~torch.isin(keys, self._free.to(keys.device))).sum())
        return target

    def _table(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._tables:
            chunks = self._chunks.get(layer, [])
            if not chunks:
                self._tables[layer] = (torch.zeros(0, dtype=torch.long, device=like.device), like[:0])
            else:
                keys = torch.cat([k for k, _ in chunks])
                top = torch.cat([t for _, t in chunks])
                if self.group is not None:  # every rank of the group builds its table in the same forward
                    keys, top = _gather_rows(self.group, keys, top)
                order = torch.argsort(keys, stable=True)
                self._tables[layer] = (keys[order], top[order])
        keys, top = self._tables[layer]
        if keys.device != like.device:  # R3's rows arrive on the host: moved once per step and layer
            self._tables[layer] = keys, top = keys.to(like.device), top.to(like.device)
        return keys, top

    def indices(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """The recorded top-k of ``keys`` at ``layer`` (for tests and debugging)."""
        sorted_keys, table = self._table(layer, torch.zeros(0, 1, dtype=torch.long))
        return table[torch.searchsorted(sorted_keys, keys.to(sorted_keys.device))].long()

    def counts(self) -> dict[str, float]:
        """This rank's sums since the last reset_counts: agreeing and replayed tokens over all
        layers, per-layer agreement, and tokens that had no recording."""
        out = {"agree": self.agree.sum().item(), "seen": self.seen.sum().item(), "missing": float(self.missing)}
        out.update({f"agree_layer{i}": self.agree[i].item() for i in range(len(self.agree))})
        out.update({f"seen_layer{i}": self.seen[i].item() for i in range(len(self.seen))})
        return out


def _gather_rows(group, keys: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's recorded ``keys`` (n,) and ``top`` (n, K) over ``group``, concatenated (collective
    over the group; each rank's n may differ: padded to the largest, as NCCL and gloo want)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    n = torch.tensor([keys.numel()], device=keys.device)
    counts = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    width = int(max(c.item() for c in counts))
    pad_k = torch.cat([keys, keys.new_full((width - keys.numel(),), -1)])
    pad_t = torch.cat([top, top.new_zeros((width - top.shape[0], *top.shape[1:]))])
    all_k, all_t = [torch.empty_like(pad_k) for _ in range(size)], [torch.empty_like(pad_t) for _ in range(size)]
    dist.all_gather(all_k, pad_k, group=group)
    dist.all_gather(all_t, pad_t, group=group)
    kept = [slice(0, int(c.item())) for c in counts]
    return torch.cat([k[s] for k, s in zip(all_k, kept)]), torch.cat([t[s] for t, s in zip(all_t, kept)])


def metrics(replay: RoutingReplay) -> dict[str, float]:
    """Global over ranks (collective), then reset: ``actor/router_agreement`` (replayed tokens
    whose native top-k already was the recorded set, over all MoE layers), ``actor/router_replay_missing``
    (tokens that had no recording: 0 unless the packing lost track of a token), and per layer
    ``debug/router_agreement_layer{i}``."""
    from rlcore.dist import all_rank_sums

    total = all_rank_sums(replay.counts())
    replay.reset_counts()
    out = {"actor/router_agreement": total["agree"] / max(total["seen"], 1.0),
           "actor/router_replay_missing": total["missing"]}
    for i in range(len(replay.layer_of)):
        out[f"debug/router_agreement_layer{i}"] = total[f"agree_layer{i}"] / max(total[f"seen_layer{i}"], 1.0)
    return out
