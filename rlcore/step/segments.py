"""Agent episodes to training rows: each episode's segments become rows of their own, sharing the
episode's advantage (rollout.agent.segment_advantage: shared), or only its last segment trains (last).

Until here an episode is one sample: scored, filtered by dynamic sampling and given its advantage as
one member of its GRPO group, with its last segment as its row. An episode whose history was not
append-only holds several token-exact segments (rlcore.agent.episode): each is a sequence of its
own (its prompt ids as the engine saw them, its sampled tokens at mask 1, the context the agent added
between its requests at mask 0) and takes the episode's advantage: the value the estimator gave the
episode's row (one value per sequence for every outcome estimator; reinforce_pp with gamma != 1 is
refused by the config check). Its keep weight and finish reason go with it; ``seg_index`` tells the
step's metrics which row is the episode's own (rlcore.algo.batch.rollout_metrics).

Every rank then holds as many rows (padded with masked copies: keep 0, seg_index -1), a multiple
of algorithm.mini_batches: the train phase runs the same number of micro-batches and optimizer steps
on every rank (FSDP2 gathers layers in every forward).
"""

from __future__ import annotations

import math

import torch

from rlcore.algo.batch import RolloutBatch
from rlcore.dist import all_reduce_max, all_reduce_sum

_COPIED = ("answers", "finish_reasons", "keep", "rows", "env_rewards", "final_ids")  # per episode, to each row


def episode_value(adv_row: torch.Tensor, mask_row: torch.Tensor) -> float:
    """The episode's advantage: its row's value at the last trained token (0 with none)."""
    values = adv_row[mask_row > 0]
    return float(values[-1]) if values.numel() else 0.0


def expand(batch: RolloutBatch, adv: torch.Tensor, scores: torch.Tensor, mode: str, multiple: int = 1):
    """``(batch, adv (N', T'), scores (N',), metrics)`` with each episode's segments as rows (collective:
    the row counts are padded to the largest rank's, rounded up to ``multiple``)."""
    if batch.segments is None:
        return batch, adv, scores, {}
    mask = batch.response_mask()  # (N, T) of the episode rows
    owner, segs, place = [], [], []
    for i, episode_segments in enumerate(batch.segments):
        chosen = episode_segments if mode == "shared" else episode_segments[-1:]
        for k, seg in enumerate(chosen):
            owner.append(i)
            segs.append(seg)
            place.append(len(chosen) - 1 - k)
    values = [episode_value(adv[i], mask[i]) for i in range(len(batch))]
    rows = len(owner)
    if rows == 0:
        raise ValueError("an agent batch without episodes")
    target = math.ceil(all_reduce_max([float(rows)])[0] / multiple) * multiple
    pad = target - rows
    owner, segs, place = owner + [owner[-1]] * pad, segs + [segs[-1]] * pad, place + [-1] * pad
    fields = {f: None if getattr(batch, f) is None else [getattr(batch, f)[i] for i in owner] for f in _COPIED}
    fields["keep"] = [k if p >= 0 else 0.0 for k, p in zip(fields["keep"], place)]
    out = RolloutBatch(prompt_ids=[list(s.prompt_ids) for s in segs], response_ids=[list(s.response_ids) for s in segs],
                       rollout_logp=[list(s.logprobs) for s in segs], env_mask=[list(s.env_mask) for s in segs],
                       group_size=batch.group_size, seg_index=place, **fields)
    new_mask = out.response_mask()  # (N', T')
    new_adv = torch.tensor([values[i] for i in owner], dtype=adv.dtype)[:, None] * new_mask  # (N', T')
    total_rows, total_pad = all_reduce_sum([float(rows), float(pad)])
    metrics = {"agent/train_rows": total_rows, "agent/pad_rows": total_pad}  # all ranks (TP ranks each a slice)
    return out, new_adv, scores[torch.tensor(owner)], metrics
