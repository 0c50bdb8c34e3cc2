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

    @property
    def name(self) -> str:
        return "teacher"

    def logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """(N, T) the teacher's log-prob of each response token (0 past each response), and the
        call's counts. The engine runs once per distinct prompt + response."""
        seqs = [tuple(p) + tuple(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        distinct = list(dict.fromkeys(seqs))
        start = time.perf_counter()
        with self.switch.judging([self]):  # the policy's engine sleeps, the teacher is awake
            with self.timer("teacher"):
                scored = self.engine.token_logprobs([list(s) for s in distinct], self.temperature)
            self.switch.record_memory("teacher")
        seconds = time.perf_counter() - start
        by_seq = dict(zip(distinct, scored))
        out = torch.zeros(len(seqs), max(1, max(len(r) for r in batch.response_ids)))  # (N, T)
        for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
            # scored[k] is log p(x_{k+1} | x_<=k): response token j sits at k = len(p) - 1 + j
            out[i, : len(r)] = torch.tensor(by_seq[seqs[i]][len(p) - 1:], dtype=out.dtype)
        return out, {"sequences": float(len(distinct)), "samples": float(len(seqs)),
                     "tokens": float(sum(len(s) for s in distinct)), "seconds": seconds}

    def advantages(self, batch: RolloutBatch, reward_adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Collective (the metrics' sums): every rank calls it with its own samples."""
        teacher = self.logprobs(batch)
        teacher_logp, counts = teacher
        mask, student_logp = batch.response_mask(), batch.rollout_logp_matrix()  # (N, T) each
        adv = combine(reward_adv, distill_advantage(self.cfg.mode, student_logp, teacher_logp, mask),
                      self.cfg.coef, self.cfg.reward_weight)
        return adv, self._metrics(distill_sums(student_logp, teacher_logp, mask), counts)

    def _metrics(self, sums: dict, counts: dict) -> dict[str, float]:
        seconds = counts.pop("seconds")
        g = all_rank_sums({**sums, **{f"n_{k}": v for k, v in counts.items()}})  # each replica tp_size times
        slowest = all_reduce_max([seconds])[0]
        tokens = max(g["tokens"], 1.0)
        return {"distill/reverse_kl": g["kl"] / tokens, "distill/teacher_logprob_mean": g["teacher"] / tokens,
                "distill/student_logprob_mean": g["student"] / tokens,
                "distill/distinct_frac": g["n_sequences"] / max(g["n_samples"], 1.0),
                "perf/teacher_tokens_per_s": g["n_tokens"] / self.tp_size / max(slowest, 1e-9)}
