"""trainer.balance_batch as pure math: which data-parallel part trains which sample, so that every
part runs about the same number of tokens (verl's ``_balance_batch``; the move itself is
``rlcore.step.balance``).

Parts hold equal numbers of samples (every rank must run as many mini-batches). Two partitions are
computed and the one with the smaller spread (largest minus smallest part total) is used:

- Karmarkar-Karp's largest differencing method with equal-size sets, as verl's
  ``verl/utils/seqlen_balancing.py`` ``karmarkar_karp(equal_size=True)`` does it: usually the tightest;
- sorted rounds: lengths sorted longest first, taken k at a time, each round's longest to the
  lightest part. Its spread is at most ``max(lengths) - min(lengths)``: by induction, if the loads
  before a round are l_1 <= ... <= l_k (spread D) and the round's items a_1 >= ... >= a_k go to
  them in that order, any two new loads differ by (l_i - l_j) + (a_i - a_j), one term in [-D, 0]
  and the other in [0, a_1 - a_k], so the new spread is at most max(D, a_1 - a_k).

So the spread of the partition used is at most ``max(lengths) - min(lengths)``: the stated bound
(``spread_bound``), which the tests check. ``plan`` keeps the samples where they are when the
current placement is already as balanced (nothing then moves).
"""

from __future__ import annotations

import heapq


def karmarkar_karp(lengths: list[int], k: int) -> list[list[int]]:
    """k equal-size parts (indices) of ``lengths`` (len divisible by k) by largest differencing:
    start from one state per k consecutive sorted lengths (one item per part), then repeatedly
    merge the two states of largest spread, the heaviest part of one with the lightest of the other."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    heap, tie = [], 0
    for off in range(0, len(order), k):
        parts = sorted(([lengths[i], [i]] for i in order[off: off + k]), key=lambda p: -p[0])
        heap.append((-(parts[0][0] - parts[-1][0]), tie, parts))
        tie += 1
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(([a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]] for j in range(k)),
                        key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(p[1]) for p in heap[0][2]]


def sorted_rounds(lengths: list[int], k: int) -> list[list[int]]:
    """k equal-size parts: rounds of k lengths, longest first, each round's longest to the
    lightest part (spread <= max - min, the module docstring's induction)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts, loads = [[] for _ in range(k)], [0] * k
    for off in range(0, len(order), k):
        by_load = sorted(range(k), key=lambda j: (loads[j], j))
        for j, i in zip(by_load, order[off: off + k]):
            parts[j].append(i)
            loads[j] += lengths[i]
    return [sorted(p) for p in parts]


def spread(lengths: list[int], parts: list[list[int]]) -> int:
    totals = [sum(lengths[i] for i in p) for p in parts]
    return max(totals) - min(totals)


def spread_bound(lengths: list[int]) -> int:
    """What ``balanced_parts`` guarantees: its spread is at most the longest minus the shortest."""
    return max(lengths) - min(lengths) if lengths else 0


def balanced_parts(lengths: list[int], k: int) -> list[list[int]]:
    """k parts of len(lengths) / k indices each, every index once, spread <= ``spread_bound``."""
    if len(lengths) % k:
        raise ValueError(f"{len(lengths)} samples do not split into {k} equal parts")
    if k == 1 or not lengths:
        return [list(range(len(lengths)))] + [[] for _ in range(k - 1)]
    candidates = [karmarkar_karp(lengths, k), sorted_rounds(lengths, k)]
    return min(candidates, key=lambda p: spread(lengths, p))  # ties: Karmarkar-Karp's


def plan(lengths_by_rank: list[list[int]], mini_batches: int = 1, group: int = 1) -> list[list[tuple[int, int]]]:
    """Where each rank's training samples come from: per rank, ``(source rank, source index)`` in
    the order it will train them.

    ``lengths_by_rank``: every rank's samples' token counts (all ranks hold as many, n). ``group``
    ranks in a row form one part (a Ulysses group trains its ranks' samples together, concatenated
    in rank order: the part's batch). The update splits a part's batch into ``mini_batches``
    consecutive mini-batches (``grpo.ppo_update``); each mini-batch slot is balanced on its own,
    its samples refilling the same positions, so every global mini-batch keeps its samples and the
    update its gradient. Within a slot a part's samples keep the order (source rank, index): a
    group's samples that land together stay adjacent (one shared prompt)."""
    ranks, n = len(lengths_by_rank), len(lengths_by_rank[0])
    parts, size = ranks // group, n * group

    def where(part: int, pos: int) -> tuple[int, int]:  # a position of a part's batch -> (rank, local index)
        return part * group + pos // n, pos % n

    out: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    step = max(1, size // mini_batches)  # grpo.ppo_update's micro_batches(len, len // mini_batches)
    for lo in range(0, size, step):
        positions = range(lo, min(lo + step, size))
        items = [where(p, pos) for p in range(parts) for pos in positions]
        lengths = [lengths_by_rank[r][i] for r, i in items]
        split = balanced_parts(lengths, parts)
        as_is = [list(range(p * len(positions), (p + 1) * len(positions))) for p in range(parts)]
        if spread(lengths, as_is) <= spread(lengths, split):  # already as good: nothing moves
            split = as_is
        for p, part in enumerate(split):
            for pos, item in zip(positions, sorted(items[j] for j in part)):
                out[where(p, pos)[0]].append(item)
    return out


def max_over_mean(totals: list[float]) -> float:
    """The busiest rank's tokens over the mean (1.0 = perfectly balanced)."""
    mean = sum(totals) / max(len(totals), 1)
    return max(totals) / mean if mean > 0 else 1.0
