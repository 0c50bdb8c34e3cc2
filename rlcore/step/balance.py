"""The samples' way from the rollout to the train phase: each TP rank's slice of its replica's
samples (``shard_for_training``), then with ``trainer.balance_batch`` a redistribution among the
train phase's data-parallel parts so each trains about as many tokens (the plan is
``rlcore.algo.balance``; the move is one all-to-all of pickled samples here).

Advantages are computed before, over each group where it was generated, and travel with their
samples (as do vLLM's log-probs, R3's routed experts, image inputs with their pixels, multi-turn
masks, the teacher's top k and partial rollouts' staleness). The loss normalisers are global
counts (``grpo.accumulate_gradients``), and each mini-batch is balanced on its own, so the update's
gradient does not depend on where a sample trains.
"""

from __future__ import annotations

import dataclasses
import pickle
import time

import torch
import torch.distributed as dist

from rlcore.algo import balance as partition
from rlcore.algo.batch import RolloutBatch
from rlcore.dist import _comm_device, all_gather_objects
from rlcore.step import segments
from rlcore.step.sampling import shard_for_training

# Every per-sample field the train phase and the step's metrics read moves; uids and gids (indices
# within a rank's batch) are renumbered. Left behind (None after the move; only scoring reads them,
# before): multi-turn conversations, whose environment instances need not pickle, the data rows and
# the decoded images (the policy's pixels travel in ``vision``).
_STAY = ("group_size", "uids", "gids", "conversations", "images", "rows")
_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutBatch) if f.name not in _STAY)


def for_training(rollout, batch: RolloutBatch, adv: torch.Tensor, scores: torch.Tensor, cfg, metrics: dict):
    """This rank's training samples, advantages (N, T) and scores (N,): its TP slice, agent episodes'
    segments as rows (rlcore.step.segments), balanced over the data-parallel parts when
    ``cfg.trainer.balance_batch``; ``metrics`` gets perf/rank_tokens_* and agent/train_rows."""
    batch, adv, scores = shard_for_training(rollout, batch, adv, scores)
    if batch.segments is not None:
        batch, adv, scores, rows = segments.expand(batch, adv, scores, cfg.rollout.agent.segment_advantage,
                                                   cfg.algorithm.mini_batches)
        metrics.update(rows)
    if not cfg.trainer.balance_batch:
        return batch, adv, scores
    batch, adv, scores, stats = balance(batch, adv, scores, cfg.algorithm.mini_batches, cfg.parallel.ulysses_size)
    metrics.update(stats)
    return batch, adv, scores


def sample_tokens(batch: RolloutBatch) -> list[int]:
    """What a sample costs the train phase: its prompt and response tokens (one forward row each)."""
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]


def balance(batch: RolloutBatch, adv: torch.Tensor, scores: torch.Tensor, mini_batches: int = 1, group: int = 1):
    """Collective over the world: ``(batch, adv, scores, metrics)`` after the move. ``group``: the
    Ulysses size (consecutive ranks that train their samples together count as one part)."""
    start = time.perf_counter()
    everyone = all_gather_objects(sample_tokens(batch))
    ranks, n = len(everyone), len(batch)
    before = _part_totals([sum(x) for x in everyone], group)
    stats = {"perf/rank_tokens_max_over_mean_before": partition.max_over_mean(before)}
    # Ranks hold as many samples (each replica trains its target groups); should one fall short
    # (partial rollouts without enough filtered groups to pad), this step stays as it is.
    if ranks == 1 or any(len(x) != n for x in everyone):
        return batch, adv, scores, {**stats, "perf/rank_tokens_max_over_mean": stats[
            "perf/rank_tokens_max_over_mean_before"]}
    wants = partition.plan(everyone, mini_batches, group)
    after = _part_totals([sum(everyone[r][i] for r, i in w) for w in wants], group)
    stats["perf/rank_tokens_max_over_mean"] = partition.max_over_mean(after)
    me = dist.get_rank()
    sends = [[_sample(batch, adv, scores, i) for r, i in wants[dst] if r == me] for dst in range(ranks)]
    got = [iter(x) for x in all_to_all_objects(sends)]
    rows = [next(got[r]) for r, _ in wants[me]]  # each source's samples arrive in the order wanted
    stats["timing/balance_s"] = time.perf_counter() - start
    return _assemble(rows, batch.group_size, adv.dtype) + (stats,)


def _part_totals(per_rank: list[float], group: int) -> list[float]:
    return [sum(per_rank[g: g + group]) for g in range(0, len(per_rank), group)]


def _sample(batch: RolloutBatch, adv: torch.Tensor, scores: torch.Tensor, i: int) -> tuple:
    fields = {f: None if getattr(batch, f) is None else getattr(batch, f)[i] for f in _FIELDS}
    present = {f for f in _FIELDS if getattr(batch, f) is not None}
    return fields, present, adv[i, : len(batch.response_ids[i])].cpu(), scores[i].item()


def _assemble(rows: list[tuple], group_size: int, dtype: torch.dtype):
    fields, present = {}, set().union(*(p for _, p, _, _ in rows))
    for f in _FIELDS:
        fields[f] = [r[0][f] for r in rows] if f in present else None
    batch = RolloutBatch(group_size=group_size, **fields)
    adv = torch.zeros(len(rows), batch.response_mask().shape[1], dtype=dtype)  # (N, T)
    for k, (_, _, a, _) in enumerate(rows):
        adv[k, : len(a)] = a
    return batch, adv, torch.tensor([s for _, _, _, s in rows], dtype=torch.float32)


def all_to_all_objects(sends: list) -> list:
    """``sends[d]`` (picklable) to rank d; returns what each rank sent here, in rank order. Two
    all_to_all_single calls (sizes, then bytes) on the backend's device: each object crosses the
    network once, where an all_gather would send every rank everything. One pickle per
    destination keeps objects shared within it shared (a group's image inputs). On NCCL/HCCL the
    bytes go through the current device (torch 2.13 distributed_c10d.py:4996, all_to_all_single:
    uneven splits on gloo, NCCL and HCCL alike); tested here on gloo only."""
    device = _comm_device() if dist.get_backend() != "gloo" else torch.device("cpu")
    blobs = [torch.frombuffer(bytearray(pickle.dumps(x)), dtype=torch.uint8) for x in sends]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes, sizes)
    sizes, recv_sizes = sizes.cpu(), recv_sizes.cpu()
    received = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, torch.cat(blobs).to(device), output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=sizes.tolist())
    parts = torch.split(received.cpu(), recv_sizes.tolist())
    return [pickle.loads(p.numpy().tobytes()) for p in parts]
