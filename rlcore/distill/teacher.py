"""The teacher in the loop: after a step's samples are drawn and scored, the teacher's engine
scores every sampled token (one prefill per distinct prompt + response, batched per rank), and the
reverse-KL advantage joins or replaces the reward's (rlcore.algo.distill).

Per rank, on the rank's own samples before they are sharded for training (a TP group's ranks hold
the same samples and run the same engine call). Memory: inside the phase switch's scoring context
(rlcore.step.switch.PhaseSwitcher.judging), the policy's engine sleeps while the teacher is awake.
Multi-turn: tool and environment tokens are off the loss mask, so they get no signal; the teacher
still reads them as context.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rlcore.algo.distill import combine, distill_advantage, distill_sums
from rlcore.dist import all_rank_sums, all_reduce_max

if TYPE_CHECKING:
    from rlcore.algo.batch import RolloutBatch
    from rlcore.distill.config import DistillConfig


class Teacher:
    """``advantages(batch, reward_adv)`` -> (the loss's advantage (N, T), distill/* metrics)."""

    def __init__(self, cfg: DistillConfig, engine, temperature: float, switch, timer, tp_size: int = 1):
        self.cfg, self.engine, self.temperature = cfg, engine, temperature
        self.switch, self.timer, self.tp_size = switch, timer, tp_size

    def logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """(N, T) the teacher's log-prob of each response token (0 past each response), and the
        call's counts. The engine runs once per distinct prompt + response (with its images: the
        prompt as the policy's engine got it). In topk mode it also sets ``batch.teacher_topk``
        (per sample the k best tokens at each response position)."""
        prompts = batch.engine_prompt_ids or batch.prompt_ids
        images = batch.images or [None] * len(batch)
        seqs = [(tuple(p) + tuple(r), id(im)) for p, r, im in zip(prompts, batch.response_ids, images)]
        by_key = {}  # each distinct (ids, images) once, with its images
        for key, im in zip(seqs, images):
            by_key.setdefault(key, im)
        distinct = list(by_key)
        ids = [list(key[0]) for key in distinct]
        ims = list(by_key.values()) if batch.images is not None else None
        topk = self.cfg.topk if self.cfg.mode == "topk" else 0
        start = time.perf_counter()
        with self.switch.judging([self]):  # the policy's engine sleeps, the teacher is awake
            with self.timer("teacher"):
                if topk:
                    scored = self.engine.token_logprobs_topk(ids, topk, self.temperature, ims)
                else:
                    scored = [(own, None) for own in self.engine.token_logprobs(ids, self.temperature, ims)]
            self.switch.record_memory("teacher")
        seconds = time.perf_counter() - start
        by_seq = dict(zip(distinct, scored))
        out = torch.zeros(len(seqs), max(1, max(len(r) for r in batch.response_ids)))  # (N, T)
        tops = []
        for i, r in enumerate(batch.response_ids):
            own, top = by_seq[seqs[i]]
            # own[k] is log p(x_{k+1} | x_<=k): the response's tokens are the sequence's last len(r)
            out[i, : len(r)] = torch.tensor(own[len(own) - len(r):], dtype=out.dtype)
            if top is not None:
                tops.append(_topk_tensors(top[len(top) - len(r):], topk))
        if topk:
            batch.teacher_topk = tops
        return out, {"sequences": float(len(distinct)), "samples": float(len(seqs)),
                     "tokens": float(sum(len(own) + 1 for own, _ in scored)), "seconds": seconds}

    def advantages(self, batch: RolloutBatch, reward_adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Collective (the metrics' sums): every rank calls it with its own samples."""
        teacher_logp, counts = self.logprobs(batch)
        mask, student_logp = batch.response_mask(), batch.rollout_logp_matrix()  # (N, T) each
        distill_adv = distill_advantage(self.cfg.mode, student_logp, teacher_logp, mask, self.cfg.advantage_clamp)
        adv = combine(reward_adv, distill_adv, self.cfg.coef, self.cfg.reward_weight)
        sums = distill_sums(student_logp, teacher_logp, mask)
        if batch.teacher_topk is not None:  # the teacher's probability mass inside its top k
            sums["topk_mass"] = sum(float((lp.exp().sum(-1) * mask[i, : lp.shape[0]]).sum())
                                    for i, (_, lp) in enumerate(batch.teacher_topk))
        return adv, self._metrics(sums, counts)

    def _metrics(self, sums: dict, counts: dict) -> dict[str, float]:
        seconds = counts.pop("seconds")
        g = all_rank_sums({**sums, **{f"n_{k}": v for k, v in counts.items()}})  # each replica tp_size times
        slowest = all_reduce_max([seconds])[0]
        tokens = max(g["tokens"], 1.0)
        return {"distill/reverse_kl": g["kl"] / tokens, "distill/teacher_logprob_mean": g["teacher"] / tokens,
                "distill/student_logprob_mean": g["student"] / tokens,
                "distill/distinct_frac": g["n_sequences"] / max(g["n_samples"], 1.0),
                "perf/teacher_tokens_per_s": g["n_tokens"] / self.tp_size / max(slowest, 1e-9),
                **({"distill/topk_mass": g["topk_mass"] / tokens} if "topk_mass" in g else {})}


def _topk_tensors(top: list[tuple[list, list]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One response's [(ids, log-probs)] per position -> (R, k) int64 ids and (R, k) float32 log-probs
    (a position with fewer than k entries, which a vocabulary smaller than k would give, is padded
    with id 0 at log-prob -inf: no mass)."""
    ids = torch.zeros(len(top), k, dtype=torch.int64)
    logp = torch.full((len(top), k), float("-inf"))
    for j, (toks, lps) in enumerate(top):
        ids[j, : len(toks)] = torch.tensor(toks[:k], dtype=torch.int64)
        logp[j, : len(lps)] = torch.tensor(lps[:k])
    return ids, logp
