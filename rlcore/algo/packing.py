"""Packing without padding: a rank's samples into (1, L) rows with per-sample positions (a
group's shared prompt once), the token keys that carry MoE routing (R3 replay rows), and the
split into micro-batches by count or by token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcore.algo.batch import RolloutBatch, prompt_runs
from rlcore.dist import all_reduce_max

if TYPE_CHECKING:  # annotations only
    from rlcore.algo.config import AlgorithmConfig


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], device, *, share_prompt: bool = False,
         response_only: bool = True, vision: list | None = None) -> dict[str, torch.Tensor | None]:
    """Concatenate sequences without padding into one ``(1, L)`` row for ``forward_logprobs``.

    Unshared, each sequence is ``prompt + response`` with positions restarting at 0. With
    ``share_prompt``, each prompt run (``prompt_runs``) is ``[prompt, r1, ..., rn]``: every
    response's positions continue from the prompt's length and ``attention_mask`` (1, 1, L, L)
    lets a token see its run's prompt and its own response only, so the prompt is computed once
    and its gradient is the sum over the run's samples, as if each sample had its own copy.

    ``select`` (K,) lists the packed positions whose hidden states predict a response token, one
    per response token in order (the prompt's last position once per sample of a shared run);
    ``labels`` (1, K) are those tokens, and ``gather`` (N, T) indexes each response token's
    log-prob in the (1, K) result. ``response_only=False`` (benchmarks only) projects every
    position instead: ``select`` None, ``labels`` (1, L) with -100 off the responses.

    ``vision`` (per sequence ``rlcore.task.images.VisionInputs`` or None): ``position_ids`` becomes
    (4, 1, L), the text positions above on row 0 (what the attention mask is derived from) and the
    M-RoPE (t, h, w) positions on rows 1-3 (a response continues at its prompt's next position);
    ``mm`` holds the ``pixel_values`` and ``image_grid_thw`` of every prompt copy in the row, in
    order (a shared prompt's images once).
    """
    ids, pos, seg, run_of, select, labels = [], [], [], [], [], []
    rope, pixels, grids = [], [], []  # image prompts: (3, len) position blocks, per-copy pixels and grids
    t_max = max(1, max(len(r) for r in response_ids))
    gather = torch.zeros(len(response_ids), t_max, dtype=torch.long)  # (N, T)
    runs = prompt_runs(prompt_ids, vision) if share_prompt else [(i, i + 1) for i in range(len(prompt_ids))]
    for k, (a, b) in enumerate(runs):
        p = prompt_ids[a]
        base = len(ids)
        ids += p
        pos += range(len(p))
        seg += [0] * len(p)
        if vision is not None:
            v = vision[a]
            rope.append(torch.arange(len(p)).expand(3, -1) if v is None else v.positions)
            if v is not None:
                pixels.append(v.pixel_values)
                grids.append(v.image_grid_thw)
        for i in range(a, b):
            r = response_ids[i]
            start = len(ids)
            # A response's last token is only a label (nothing predicts from it). Image rows write
            # the prompt's last token there instead: a sample that stopped at a vision slot token
            # (rlcore.rollout.checks.slot_token_ids) would otherwise read as an image slot.
            ids += r if vision is None or not r else r[:-1] + [p[-1]]
            pos += range(len(p), len(p) + len(r))
            seg += [i + 1] * len(r)
            if vision is not None:
                nxt = len(p) if vision[a] is None else vision[a].next_position
                rope.append(torch.arange(nxt, nxt + len(r)).expand(3, -1))
            # r[0] is predicted at the prompt's last position, r[j] at r[j-1]'s
            here = [base + len(p) - 1] + list(range(start, start + len(r) - 1))
            gather[i, : len(r)] = torch.arange(len(select), len(select) + len(r))
            select += here[: len(r)]
            labels += r
        run_of += [k] * (len(ids) - base)
    as_row = lambda xs: torch.tensor(xs, dtype=torch.long, device=device).unsqueeze(0)  # noqa: E731
    out = {"input_ids": as_row(ids), "position_ids": as_row(pos), "attention_mask": None,
           "select": torch.tensor(select, dtype=torch.long, device=device), "labels": as_row(labels),
           "gather": gather.to(device), "mm": None}
    if vision is not None:
        rows = torch.cat([torch.tensor(pos).unsqueeze(0), torch.cat(rope, dim=1)])  # (4, L)
        out["position_ids"] = rows.unsqueeze(1).to(device)  # (4, 1, L)
        if pixels:
            out["mm"] = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
    if share_prompt:
        out["attention_mask"] = shared_prompt_mask(torch.tensor(run_of), torch.tensor(seg)).to(device)
    if not response_only:  # the full-row form: labels at the selected positions, -100 elsewhere
        if share_prompt:
            raise ValueError("share_prompt needs response_only: the prompt's last position predicts n tokens")
        full = torch.full((len(ids),), -100, dtype=torch.long)
        full[out["select"].cpu()] = out["labels"][0].cpu()
        out["gather"] = out["select"][out["gather"]]
        out.update(select=None, labels=full.to(device).unsqueeze(0))
    return out


def token_key(owner: int, position: int, prompt: bool = False) -> int:
    """One int64 per (owner, position): owner a sample uid (response) or a group (prompt)."""
    return ((2 * owner + int(prompt)) << 24) + position


def token_keys(batch: RolloutBatch, device, share_prompt: bool = False) -> torch.Tensor:
    """(1, L) int64 name of each position of ``pack``'s row, for routing replay: the same however
    the samples are packed, (sample uid, position) for a response token and (group gid, position)
    for a prompt token, which every sample of the group sees alike. Built only when replay is on."""
    runs = prompt_runs(batch.prompt_ids, batch.vision) if share_prompt else [(i, i + 1) for i in range(len(batch))]
    keys = []
    for a, b in runs:
        n = len(batch.prompt_ids[a])
        keys += [token_key(batch.gids[a], j, prompt=True) for j in range(n)]
        for i in range(a, b):
            keys += [token_key(batch.uids[i], j) for j in range(n, n + len(batch.response_ids[i]))]
    return torch.tensor(keys, dtype=torch.long, device=device).unsqueeze(0)


def rollout_routing(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R3's replay rows from vLLM's routed experts: keys (M,) as ``token_keys`` names the tokens,
    experts (M, layers, K) in vLLM's dtype (its layer index is the decoder layer's), and the keys
    of the tokens vLLM ran no forward for (each response's last token: nothing is predicted from
    it, so its routing changes no log-prob), which keep their native choice. A group's prompt
    rows come from its first sample (vLLM routes a shared prompt once; prefix-cached blocks keep
    their routing)."""
    keys, rows, free, groups = [], [], [], set()
    for i, (p, r, experts) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.routed_experts)):
        total = len(p) + len(r)
        if experts is None or len(experts) != total - 1:
            raise RuntimeError(f"routing replay r3: sample {i} has {None if experts is None else len(experts)} rows "
                               f"of routed experts from vLLM for {total} tokens (expected {total - 1}: the prompt "
                               f"and every sampled token but the last)")
        gid, uid = batch.gids[i], batch.uids[i]
        start = len(p) if gid in groups else 0
        groups.add(gid)
        keys += [token_key(gid, j, prompt=True) for j in range(start, len(p))]
        keys += [token_key(uid, j) for j in range(max(start, len(p)), total - 1)]
        part = torch.as_tensor(np.asarray(experts[start:]))
        rows.append(part if part.dtype == torch.uint8 else part.to(torch.int32))  # torch indexes no uint16
        free.append(token_key(uid, total - 1))
    return torch.tensor(keys, dtype=torch.long), torch.cat(rows), torch.tensor(free, dtype=torch.long)


def shared_prompt_mask(run: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """(1, 1, L, L) bool, True where query q may attend to key k: same run, k not after q, and k
    in the prompt (segment 0) or in q's own response. Dense, as sdpa and eager take it."""
    q, k = torch.arange(len(run)).unsqueeze(1), torch.arange(len(run)).unsqueeze(0)  # (L, 1), (1, L)
    same_run = run.unsqueeze(1) == run.unsqueeze(0)
    visible = (seg.unsqueeze(0) == 0) | (seg.unsqueeze(1) == seg.unsqueeze(0))
    return (same_run & visible & (k <= q))[None, None]


def micro_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 split into micro-batches of about ``budget`` tokens (collective).

    Every rank must run the same number of forwards (FSDP2 gathers each layer in every forward),
    so the count is the largest any rank needs, ceil(tokens / budget), at most the number of
    items the emptiest rank holds. Items (sequences, or prompt runs) go longest first to the lightest micro-batch,
    which keeps the token counts within one sequence of each other; within a micro-batch they keep
    their order.
    """
    need = max(1, -(-sum(lengths) // budget))
    # at most the fewest items a rank holds (ranks hold as many sequences, not as many prompt runs)
    most, fewest = all_reduce_max([float(need), -float(len(lengths))])
    count = int(min(most, -fewest))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = loads.index(min(loads))
        bins[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def split_micro(batch: RolloutBatch, idx: list[int], cfg: AlgorithmConfig) -> list[list[int]]:
    """``idx`` (a mini-batch's sequences) as micro-batches: by token budget or by count. With a
    token budget and a shared prompt, a prompt run is packed whole (its tokens: the prompt once
    plus its responses), so a split never costs a second copy of the prompt."""
    if not cfg.micro_batch_tokens:
        return [idx[i: i + cfg.micro_batch_size] for i in range(0, len(idx), cfg.micro_batch_size)]
    prompts = [batch.prompt_ids[i] for i in idx]
    vision = None if batch.vision is None else [batch.vision[i] for i in idx]
    units = prompt_runs(prompts, vision) if cfg.share_prompt else [(k, k + 1) for k in range(len(idx))]
    lengths = [len(prompts[a]) * (1 if cfg.share_prompt else b - a)
               + sum(len(batch.response_ids[idx[k]]) for k in range(a, b)) for a, b in units]
    parts = token_budget_batches(lengths, cfg.micro_batch_tokens)
    return [[idx[k] for u in part for k in range(*units[u])] for part in parts]
