"""One step's samples: prompts -> generate (vLLM) -> score, with DAPO dynamic-sampling refills.

``StepSampler`` holds what these verbs use (the rollout engine, the prompt order, the tokenizer and
the scorer) and their two config sections; nothing here trains or touches the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore import grpo, vision
from rlcore.config import AlgorithmConfig, RolloutConfig
from rlcore.data import PromptSampler, derive_seed
from rlcore.dist import all_reduce_sum
from rlcore.metrics import Timer

_VALIDATION_OFFSET = 500_009  # validation seeds stay apart from the training steps'


def generation_seed(seed: int, step: int, round_: int = 0, validation: bool = False) -> int:
    """vLLM seed of one generation call: per step (so a resumed run samples what the uninterrupted
    one did), per dynamic-sampling round (a round that reused the step's seed would draw the same
    random stream for its new prompts), and apart for validation."""
    return derive_seed(seed, step + (_VALIDATION_OFFSET if validation else 0)) + round_ * 2**62


@dataclass
class StepSampler:
    rollout: object  # rlcore.build.Rollout
    prompts: PromptSampler
    tokenizer: object
    scorer: object  # rlcore.rewards.Scorer
    cfg: RolloutConfig
    algo: AlgorithmConfig
    prompts_per_step: int
    seed: int
    timer: Timer
    processor: object = None  # rlcore.vision.VisionProcessor when prompts carry images

    def sample(self, step: int) -> tuple[grpo.RolloutBatch, torch.Tensor, dict]:
        """This replica's samples of ``step``, their shaped rewards (N,) and reward metrics. With
        DAPO dynamic sampling, groups whose rewards are all equal are dropped and more prompts are
        sampled (at most max_sampling_rounds rounds, in lockstep over all replicas); a replica
        still short then pads with dropped groups masked out of the loss."""
        batch = self.generate(self.next_prompts(), step)
        scores, metrics = self.score(batch)
        # groups whose rewards are all equal have zero advantage: no gradient unless filtered out
        groups = max(len(scores) // batch.group_size, 1)
        informative = len(grpo.informative_groups(scores, batch.group_size))
        metrics["rollout/zero_variance_groups_frac"] = 1.0 - informative / groups
        if not self.algo.dynamic_sampling:
            return batch, scores, metrics
        n, target = batch.group_size, len(batch) // batch.group_size
        kept, dropped, seen = [], [], 0
        for round_ in range(self.algo.max_sampling_rounds):
            if round_ > 0:
                batch = self.generate(self.next_prompts(), step, round_)
                scores, _ = self.score(batch)
            good = set(grpo.informative_groups(scores, n))
            seen += len(scores) // n
            for g in range(len(scores) // n):
                group = (batch.select(list(range(g * n, (g + 1) * n))), scores[g * n: (g + 1) * n])
                (kept if g in good else dropped).append(group)
            short, total_seen, total_kept = all_reduce_sum([float(len(kept) < target), seen, len(kept)])
            if short == 0:
                break
        for part, _ in dropped[: max(0, target - len(kept))]:
            part.keep = [0.0] * len(part)
        chosen = (kept + dropped)[:target]
        metrics["rollout/filtered_groups_frac"] = 1.0 - total_kept / max(total_seen, 1)
        metrics["rollout/sampling_rounds"] = round_ + 1
        return grpo.concat([b for b, _ in chosen]), torch.cat([s for _, s in chosen]), metrics

    def next_prompts(self) -> list:
        """This rollout replica's share of the step's global prompt batch."""
        dp_rank, dp_size = self.rollout.dp_rank, self.rollout.dp_size
        batch = self.prompts.next_batch(self.prompts_per_step)
        per = len(batch) // dp_size
        return batch[dp_rank * per: (dp_rank + 1) * per]

    def generate(self, prompts: list, step: int, round_: int = 0) -> grpo.RolloutBatch:
        r = self.cfg
        images = vision.prompt_images(prompts)  # None for text-only prompts
        with self.timer("generate"):
            out = self.rollout.generate([p.ids for p in prompts], n=r.n, temperature=r.temperature, top_p=r.top_p,
                                        top_k=r.top_k, max_tokens=r.max_response_length,
                                        seed=generation_seed(self.seed, step, round_),
                                        **({"images": images} if images else {}))
        # The policy's form of each prompt: image tokens expanded, pixels and M-RoPE positions
        # (one object per prompt, shared by its group: the shared-prompt packing keys on it).
        policy_form = [(p.ids, None) if not im else self.processor.prepare(p.ids, im)
                       for p, im in zip(prompts, images or [None] * len(prompts))]
        flat = [(p, form, s) for p, form, samples in zip(prompts, policy_form, out) for s in samples]
        return grpo.RolloutBatch(
            prompt_ids=[ids for _, (ids, _), _ in flat], response_ids=[s.response_ids for _, _, s in flat],
            rollout_logp=[s.logprobs for _, _, s in flat], answers=[p.answer for p, _, _ in flat],
            finish_reasons=[s.finish_reason for _, _, s in flat], group_size=r.n,
            vision=[v for _, (_, v), _ in flat] if images else None)

    def score(self, batch: grpo.RolloutBatch) -> tuple[torch.Tensor, dict]:
        """Rule-based rewards (N,), then DAPO overlong shaping / truncation masking when configured."""
        with self.timer("reward"):
            texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            values, metrics = self.scorer.score(texts, batch.answers)
            shaped, shape_metrics = grpo.shape_rewards(torch.tensor(values, dtype=torch.float32), batch,
                                                       self.algo, self.cfg.max_response_length)
        return shaped, {**metrics, **shape_metrics}


def shard_for_training(rollout, batch: grpo.RolloutBatch, adv: torch.Tensor, scores: torch.Tensor):
    """Ranks of one TP group hold the same samples: each trains on (and logs) its own slice."""
    tp, tp_rank = rollout.tp_size, rollout.tp_rank
    if tp == 1:
        return batch, adv, scores
    per = len(batch) // tp
    idx = list(range(tp_rank * per, (tp_rank + 1) * per))
    return batch.select(idx), adv[idx], scores[idx]
