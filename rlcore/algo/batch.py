"""One rank's share of a step's samples (``RolloutBatch``, groups of ``group_size`` consecutive
sequences) and what is computed on it before the update: DAPO reward shaping, advantages, the
informative groups of dynamic sampling, the rollout metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcore import advantage
from rlcore.dist import all_rank_means, all_rank_sums, all_reduce_sum

if TYPE_CHECKING:  # annotations only
    from rlcore.algo.config import AlgorithmConfig


def prompt_runs(prompt_ids: list[list[int]], vision: list | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive sequences with the same prompt: a group, or
    the part of one this rank or micro-batch holds (TP sharding and micro-batch splits may cut a
    group; dynamic sampling keeps groups together). With images the prompt must also be the same
    object (two prompts with the same text and differently drawn images expand to equal ids)."""
    runs: list[tuple[int, int]] = []
    same_images = (lambda i, j: True) if vision is None else (lambda i, j: vision[i] is vision[j])  # noqa: E731
    for i, p in enumerate(prompt_ids):
        if runs and prompt_ids[runs[-1][0]] == p and same_images(runs[-1][0], i):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@dataclass
class RolloutBatch:
    """One rank's share of a step's samples, groups of ``group_size`` consecutive sequences."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logp: list[list[float]]  # vLLM's log-probs of the sampled tokens
    answers: list[str]
    finish_reasons: list[str]
    group_size: int
    keep: list[float] | None = None  # per-sequence loss weight (0 masks a sequence out); None = all 1
    # Image prompts: each sample's rlcore.task.images.VisionInputs (or None), one object per prompt shared
    # by its group; prompt_ids are then the expanded ids. None: a text-only batch.
    vision: list | None = None
    # Routing replay's token keys: each sample's index in the step's batch, and the index of the
    # run of equal prompts it belongs to (its group); both carried through select().
    uids: list[int] | None = None
    gids: list[int] | None = None
    # Multi-turn (rlcore.agent): per response token 1 = sampled by the policy (trained), 0 = a tool's
    # or environment's token (context only); the ids of each sample's final model turn (what the
    # rule rewards read); the environment's reward. None: single-turn.
    env_mask: list[list[int]] | None = None
    final_ids: list[list[int]] | None = None
    env_rewards: list[float | None] | None = None
    conversations: list | None = None  # each sample's rlcore.agent.loop.Conversation (metrics, val samples)
    # R3 (algorithm.routing_replay: r3): per sample vLLM's routed experts, (P + R - 1, layers, K)
    # uint8/uint16 rows for every token it ran a forward for (rlcore.rollout.routing). None: off.
    routed_experts: list | None = None
    rows: list[dict] | None = None  # each sample's data row (model-based rewards read its fields)
    # distill.mode topk: per sample the teacher's k best tokens at each response position, (ids (R, k)
    # int64, log-probs (R, k) float32) (rlcore.distill.teacher). None: off.
    teacher_topk: list | None = None
    # Image prompts: each sample's prompt as vLLM got it (ids before the image-token expansion) and its
    # decoded images (one list object per prompt, shared by its group), for a distillation teacher
    # that reads them as the policy's engine did. None: a text-only batch.
    engine_prompt_ids: list[list[int]] | None = None
    images: list | None = None
    # Partial rollouts (rlcore.step.partial): per response token, how many policy updates separate the
    # policy that sampled it from the one training on it (0: sampled this step). None: all 0.
    staleness: list[list[int]] | None = None
    # Agent episodes (rlcore.agent.serve): each sample's token-exact segments (rlcore.agent.episode.Segment;
    # the row itself is the last one) until rlcore.step.segments makes them rows; then, per row, its
    # segment's place counted from its episode's last (0: the last, which counts for the episode's
    # reward and length metrics; -1: a padding row). None: not an agent batch.
    segments: list[list] | None = None
    seg_index: list[int] | None = None

    def __post_init__(self):
        if self.keep is None:
            self.keep = [1.0] * len(self.response_ids)
        if self.uids is None:
            self.uids = list(range(len(self.response_ids)))
        if self.gids is None:
            self.gids = [k for k, (a, b) in enumerate(prompt_runs(self.prompt_ids, self.vision)) for _ in range(a, b)]

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, idx: list[int]) -> "RolloutBatch":
        values = {f: getattr(self, f) for f in _PER_SAMPLE}
        return RolloutBatch(group_size=self.group_size,
                            **{f: None if v is None else [v[i] for i in idx] for f, v in values.items()})

    def response_mask(self) -> torch.Tensor:
        """(N, T) 1 on response tokens of kept sequences: the loss mask."""
        n, t = len(self), max(1, max(len(r) for r in self.response_ids))
        mask = torch.zeros(n, t)  # (N, T)
        for i, r in enumerate(self.response_ids):
            mask[i, : len(r)] = self.keep[i]
            if self.env_mask is not None:  # tool/environment tokens: context, never trained
                mask[i, : len(r)] *= torch.tensor(self.env_mask[i], dtype=mask.dtype)
        return mask

    def rollout_logp_matrix(self) -> torch.Tensor:
        mask = self.response_mask()
        out = torch.zeros_like(mask)  # (N, T)
        for i, lp in enumerate(self.rollout_logp):
            out[i, : len(lp)] = torch.tensor(lp, dtype=out.dtype)
        return out


def overlong_penalties(batch: RolloutBatch, cfg: AlgorithmConfig, max_response_length: int) -> torch.Tensor | None:
    """(N,) DAPO's overlong penalty of each response, or None when shaping is off."""
    if cfg.overlong_buffer_len <= 0:
        return None
    lengths = torch.tensor([len(r) for r in batch.response_ids], dtype=torch.float32)
    return advantage.overlong_penalty(lengths, max_response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)


def shape_rewards(scores: torch.Tensor, batch: RolloutBatch, cfg: AlgorithmConfig,
                  max_response_length: int) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO overlong shaping and truncation masking; returns the shaped scores (N,)."""
    metrics = {}
    penalty = overlong_penalties(batch, cfg, max_response_length)
    if penalty is not None:
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    if cfg.mask_truncated:
        batch.keep = [0.0 if f == "length" else k for f, k in zip(batch.finish_reasons, batch.keep)]
    return scores, metrics


def advantages_for(batch: RolloutBatch, scores: torch.Tensor, cfg: AlgorithmConfig, tp_size: int = 1) -> torch.Tensor:
    """(N, T) advantages of the configured estimator, zero off the loss mask. Batch-level
    statistics (REINFORCE++ whitening) are those of the global batch: summed over all ranks, each
    replica counted once (the ``tp_size`` ranks of a replica hold the same samples here)."""
    def sum_fn(values: list[float]) -> list[float]:
        return [v / tp_size for v in all_reduce_sum(values)]

    return advantage.compute_advantages(cfg.adv_estimator, scores, batch.response_mask(), batch.group_size,
                                        norm_by_std=cfg.norm_by_std, gamma=cfg.gamma, sum_fn=sum_fn)


def informative_groups(scores: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    degenerate = advantage.group_is_degenerate(scores, group_size)
    return [g for g in range(len(degenerate)) if not degenerate[g]]


# RolloutBatch's per-sample lists, carried by select() and concat() (uids/gids are renumbered by concat)
_PER_SAMPLE = ("prompt_ids", "response_ids", "rollout_logp", "answers", "finish_reasons", "keep", "vision", "uids",
               "gids", "env_mask", "final_ids", "env_rewards", "conversations", "routed_experts", "rows", "teacher_topk",
               "engine_prompt_ids", "images", "staleness", "segments", "seg_index")


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    def cat(attr: str):
        if all(getattr(b, attr) is None for b in batches):
            return None
        return [x for b in batches for x in (getattr(b, attr) if getattr(b, attr) is not None else [None] * len(b))]

    return RolloutBatch(group_size=batches[0].group_size,
                        **{f: cat(f) for f in _PER_SAMPLE if f not in ("uids", "gids")})


def rollout_metrics(batch: RolloutBatch, scores: torch.Tensor, adv: torch.Tensor, metrics: dict,
                    world_size: int, tp_size: int) -> dict[str, float]:
    """Global (all-rank) statistics of the step's samples, merged with the phase ``metrics``
    (reward components and filter fractions are per-rank means: averaged over ranks)."""
    mask = batch.response_mask()
    # Generated tokens: multi-turn conversations also hold tool answers (prefilled, not generated).
    lens = [len(r) for r in batch.response_ids] if batch.env_mask is None else [sum(m) for m in batch.env_mask]
    # Agent episodes trained as segments: the reward and per-sample counts once per episode (its last
    # segment), the tokens of every segment, padding rows nowhere.
    place = batch.seg_index or [0] * len(batch)
    last, real = [k == 0 for k in place], [k >= 0 for k in place]
    once = scores[torch.tensor(last, dtype=torch.bool)]  # (episodes,) every sample when not an agent batch
    g = all_rank_sums({
        "s": once.sum().item(), "s2": (once ** 2).sum().item(), "cnt": len(once),
        "ntok": sum(n for n, r in zip(lens, real) if r),
        "nall": float(sum(len(x) for x, r in zip(batch.response_ids, real) if r)),
        "trunc": float(sum(f == "length" for f, e in zip(batch.finish_reasons, last) if e)),
        "ntok_loss": mask.sum().item(), "a1": (adv * mask).sum().item(), "a2": (adv ** 2 * mask).sum().item()})
    out = dict(metrics)
    per_replica = ("reward/", "rollout/filtered", "rollout/zero_variance")
    out.update(all_rank_means({k: v for k, v in metrics.items() if k.startswith(per_replica)}, world_size))
    if "reward/errors" in out:  # a count: the sum over replicas (TP ranks score the same samples)
        out["reward/errors"] *= world_size / tp_size
    mean, a_mean, ntok_loss = g["s"] / g["cnt"], g["a1"] / max(g["ntok_loss"], 1), max(g["ntok_loss"], 1)
    out.update({
        "reward/mean": mean, "reward/std": max(g["s2"] / g["cnt"] - mean ** 2, 0.0) ** 0.5,
        "rollout/response_len_mean": g["ntok"] / g["cnt"], "rollout/truncated_frac": g["trunc"] / g["cnt"],
        "rollout/tokens": g["ntok"],
        **({"rollout/conversation_len_mean": g["nall"] / g["cnt"]} if batch.env_mask is not None else {}),
        "advantage/mean": a_mean, "advantage/std": max(g["a2"] / ntok_loss - a_mean ** 2, 0.0) ** 0.5,
    })
    return out
