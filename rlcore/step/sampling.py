"""One step's samples: prompts -> generate (vLLM) -> score, with DAPO dynamic sampling.

``StepSampler`` holds what these verbs use (the rollout engine, the prompt order, the tokenizer and
the scorer) and their two config sections; nothing here trains or touches the policy.

Dynamic sampling drops the groups whose rewards are all equal (zero advantage, no gradient). With
``algorithm.oversample`` the step's first round already samples enough prompts for the groups it
will keep (:func:`plan_prompts`, from a running estimate of the kept fraction), because the engine
is far faster on one large batch than on several small ones; extra rounds are the fallback.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from rlcore.agent.serve import EndpointAgent
from rlcore.algo import batch as rollout_batch
from rlcore.config import AlgorithmConfig, RolloutConfig
from rlcore.dist import all_reduce_max, all_reduce_sum
from rlcore.metrics import Timer
from rlcore.task import images as vision
from rlcore.task.prompts import PromptSampler, derive_seed, generation_seed  # noqa: F401  (generation_seed: re-exported)

_SELECT_OFFSET = 700_001  # the kept-group draw of a step: apart from the generation seeds
KEEP_RATE_PRIOR = 0.5  # the first step's guess of the kept fraction, before any measurement
KEEP_RATE_WEIGHT = 0.5  # weight of the newest step in the running estimate (about 2 steps' memory)
ALL_REPLICAS_OK = 0.8  # the round is sized so every replica keeps enough with this probability


def binomial_at_least(m: int, p: float, k: int) -> float:
    """P(X >= k) for X ~ Binomial(m, p)."""
    if k <= 0:
        return 1.0
    return sum(math.comb(m, i) * p ** i * (1 - p) ** (m - i) for i in range(k, m + 1))


def plan_prompts(needed: int, keep_rate: float, max_factor: float, replicas: int = 1) -> int:
    """Prompts per replica for one round that must keep ``needed`` groups on every replica: the
    fewest m with P(Binomial(m, keep_rate) >= needed) >= ALL_REPLICAS_OK ** (1 / replicas), between
    ``needed`` and ``ceil(max_factor * needed)``. Each group is kept or not independently of where
    it sits in the batch, so the binomial is the right count model."""
    if needed <= 0:
        return 0
    cap = max(needed, math.ceil(max_factor * needed))
    p = min(max(keep_rate, 1e-3), 1.0)
    want = ALL_REPLICAS_OK ** (1.0 / max(replicas, 1))
    for m in range(needed, cap + 1):
        if binomial_at_least(m, p, needed) >= want:
            return m
    return cap


def choose_groups(informative: list[int], target: int, seed: int) -> list[int]:
    """``target`` of the informative group indices, drawn uniformly without replacement (seeded,
    so a resumed step keeps the same ones), in batch order. A uniform draw, not the first ones:
    the oversampled surplus must not favour the prompts that happen to come first."""
    if len(informative) <= target:
        return list(informative)
    return sorted(random.Random(seed).sample(informative, target))


@dataclass
class StepSampler:
    rollout: object  # rlcore.protocols.Rollout
    prompts: PromptSampler
    tokenizer: object
    scorer: object  # rlcore.task.rewards.Scorer
    cfg: RolloutConfig
    algo: AlgorithmConfig
    prompts_per_step: int
    seed: int
    timer: Timer
    processor: object = None  # rlcore.task.images.VisionProcessor when prompts carry images
    agent: object = None  # rlcore.agent.loop.Agent: multi-turn conversations with tools
    keep_rate: float = field(default=KEEP_RATE_PRIOR)  # running estimate of the kept-group fraction
    switch: object = None  # rlcore.step.switch.PhaseSwitcher: wakes the policy's engine after judging
    partial: object = None  # rlcore.step.partial.PartialRollouts (rollout.partial.enable), made here
    decode: list = field(default_factory=list)  # this step's generate calls: tokens per request

    def __post_init__(self):
        partial = getattr(self.cfg, "partial", None)  # a section without it (tests' stand-ins): off
        if partial is not None and partial.enable and self.partial is None:
            from rlcore.step.partial import PartialRollouts

            self.partial = PartialRollouts(self.cfg.partial, self.cfg.n, self.cfg.max_response_length,
                                           dynamic=self.algo.dynamic_sampling, max_rounds=self.algo.max_sampling_rounds,
                                           agent=self.agent)

    def state_dict(self) -> dict:
        return {"keep_rate": self.keep_rate, **({"partial": self.partial.state_dict()} if self.partial else {})}

    def load_state_dict(self, state: dict) -> None:
        self.keep_rate = state.get("keep_rate", KEEP_RATE_PRIOR)  # checkpoints before it: the prior
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial", []))

    def sample(self, step: int) -> tuple[rollout_batch.RolloutBatch, torch.Tensor, dict]:
        """This replica's samples of ``step``, their shaped rewards (N,) and reward metrics, with
        rollout/tail_decode_frac (tail_iterations over the step's generate calls, all ranks)."""
        self.decode = []
        batch, scores, metrics = self._sample(step)
        tail, total = all_reduce_sum(list(tail_iterations(self.decode)))
        metrics["rollout/tail_decode_frac"] = tail / max(total, 1.0)
        return batch, scores, metrics

    def count_decode(self, lengths: list[int]) -> None:
        """One generate call's tokens per request (rollout/tail_decode_frac)."""
        self.decode.append(list(lengths))

    def _sample(self, step: int) -> tuple[rollout_batch.RolloutBatch, torch.Tensor, dict]:
        if self.partial is not None:  # suspended groups continue; the step stops once enough are done
            batch, partial_metrics = self.partial.sample(self, step)
            scores, metrics = self.score(batch)
            groups = max(len(scores) // batch.group_size, 1)
            informative = len(rollout_batch.informative_groups(scores, batch.group_size))
            metrics["rollout/zero_variance_groups_frac"] = 1.0 - informative / groups  # dynamic: the filter's
            return batch, scores, {**metrics, **partial_metrics}
        if not self.algo.dynamic_sampling:
            batch = self.generate(self.next_prompts(self.per_replica()), step)
            scores, metrics = self.score(batch)
            groups = max(len(scores) // batch.group_size, 1)
            informative = len(rollout_batch.informative_groups(scores, batch.group_size))
            metrics["rollout/zero_variance_groups_frac"] = 1.0 - informative / groups
            metrics["rollout/generated_per_trained"] = 1.0
            return batch, scores, metrics
        return self.sample_dynamic(step)

    def sample_dynamic(self, step: int) -> tuple[rollout_batch.RolloutBatch, torch.Tensor, dict]:
        """DAPO dynamic sampling: keep ``target`` informative groups per replica. Round 0 samples
        plan_prompts(target) prompts (without oversample: target, each round, as before it);
        while a replica is short, another round samples for the largest shortfall, sized by this
        step's kept fraction so far (all replicas in lockstep, at most max_sampling_rounds).
        Surplus informative groups are dropped by a uniform seeded draw; a replica still short
        pads with dropped groups masked out of the loss."""
        target, n = self.per_replica(), self.cfg.n
        kept, dropped, metrics, seen, needed, rate = [], [], {}, 0, target, self.keep_rate
        for round_ in range(self.algo.max_sampling_rounds):
            size = target if not self.algo.oversample else plan_prompts(
                needed, rate, self.algo.oversample_max, self.rollout.dp_size)
            batch = self.generate(self.next_prompts(size), step, round_)
            scores, round_metrics = self.score(batch)
            metrics = metrics or round_metrics  # reward metrics: those of the first round
            good = set(rollout_batch.informative_groups(self.filter_values(batch, scores), n))
            for g in range(len(scores) // n):
                group = (batch.select(list(range(g * n, (g + 1) * n))), scores[g * n: (g + 1) * n])
                (kept if g in good else dropped).append(group)
            seen += len(scores) // n
            needed = int(all_reduce_max([float(max(target - len(kept), 0))])[0])
            total_seen, total_kept = all_reduce_sum([seen, len(kept)])
            if needed == 0:
                break
            rate = total_kept / total_seen  # a fallback round: this step's own rate is the better guess
        self.keep_rate += KEEP_RATE_WEIGHT * (total_kept / max(total_seen, 1) - self.keep_rate)
        for part, _ in dropped[: max(0, target - len(kept))]:
            part.keep = [0.0] * len(part)
        chosen = [kept[i] for i in choose_groups(list(range(len(kept))), target,
                                                  derive_seed(self.seed, _SELECT_OFFSET + step))]
        chosen += dropped[: target - len(chosen)]
        ranks = self.rollout.dp_size * self.rollout.tp_size  # the sums count each TP rank of a replica
        metrics.update({
            "rollout/filtered_groups_frac": 1.0 - total_kept / max(total_seen, 1),
            "rollout/zero_variance_groups_frac": 1.0 - total_kept / max(total_seen, 1),
            "rollout/sampling_rounds": round_ + 1,
            "rollout/generated_per_trained": total_seen / (target * ranks),
            "rollout/keep_rate_est": self.keep_rate})
        return rollout_batch.concat([b for b, _ in chosen]), torch.cat([s for _, s in chosen]), metrics

    def filter_values(self, batch: rollout_batch.RolloutBatch, scores: torch.Tensor) -> torch.Tensor:
        """What dynamic sampling compares within a group: the shaped rewards, or with
        algorithm.dynamic_sampling_metric=score the scores before DAPO's overlong penalty."""
        penalty = rollout_batch.overlong_penalties(batch, self.algo, response_budget(self.cfg))
        if getattr(self.algo, "dynamic_sampling_metric", "reward") == "reward" or penalty is None:
            return scores
        return scores - penalty.to(scores.dtype)

    def per_replica(self) -> int:
        return self.prompts_per_step // self.rollout.dp_size

    def next_prompts(self, per_replica: int) -> list:
        """This rollout replica's ``per_replica`` prompts: its slice of the next per_replica x
        dp_size prompts of the global order (every rank draws the same, so the order stays shared)."""
        dp_rank, dp_size = self.rollout.dp_rank, self.rollout.dp_size
        batch = self.prompts.next_batch(per_replica * dp_size)
        return batch[dp_rank * per_replica: (dp_rank + 1) * per_replica]

    def generate(self, prompts: list, step: int, round_: int = 0) -> rollout_batch.RolloutBatch:
        r = self.cfg
        if self.switch is not None:
            self.switch.ensure_generation()  # a previous round's judging put the engine to sleep
        if self.agent is not None:
            with self.timer("generate"):
                batch = multi_turn_batch(self.agent, self.rollout, prompts, r, generation_seed(self.seed, step, round_),
                                         self.timer)
            for lengths in self.agent.stats["turn_lengths"]:  # one generate call per turn
                self.count_decode(lengths)
            return batch
        images = vision.prompt_images(prompts)  # None for text-only prompts
        with self.timer("generate"):
            out = self.rollout.generate([p.ids for p in prompts], n=r.n, temperature=r.temperature, top_p=r.top_p,
                                        top_k=r.top_k, max_tokens=r.max_response_length,
                                        seed=generation_seed(self.seed, step, round_),
                                        **({"images": images} if images else {}))
        self.count_decode([len(x.response_ids) for samples in out for x in samples])
        # The policy's form of each prompt: image tokens expanded, pixels and M-RoPE positions
        # (one object per prompt, shared by its group: the shared-prompt packing keys on it).
        policy_form = [(p.ids, None) if not im else self.processor.prepare(p.ids, im)
                       for p, im in zip(prompts, images or [None] * len(prompts))]
        flat = [(p, form, s) for p, form, samples in zip(prompts, policy_form, out) for s in samples]
        return rollout_batch.RolloutBatch(
            prompt_ids=[ids for _, (ids, _), _ in flat], response_ids=[s.response_ids for _, _, s in flat],
            rollout_logp=[s.logprobs for _, _, s in flat], answers=[p.answer for p, _, _ in flat],
            finish_reasons=[s.finish_reason for _, _, s in flat], group_size=r.n,
            vision=[v for _, (_, v), _ in flat] if images else None, rows=[p.row for p, _, _ in flat],
            routed_experts=[s.routed_experts for _, _, s in flat] if flat and flat[0][2].routed_experts is not None
            else None,
            engine_prompt_ids=[p.ids for p, _, _ in flat] if images else None,
            images=[im for im, samples in zip(images, out) for _ in samples] if images else None)

    def score(self, batch: rollout_batch.RolloutBatch, collective: bool = True) -> tuple[torch.Tensor, dict]:
        """Rule-based rewards (N,), then DAPO overlong shaping / truncation masking when configured.
        ``collective`` False: no all-rank conversation metrics (one rank scoring alone)."""
        with self.timer("reward"):
            texts = self.tokenizer.batch_decode(batch.final_ids or batch.response_ids, skip_special_tokens=True)
            values, metrics = self.scorer.score(texts, batch.answers, batch.env_rewards, rows=batch.rows)
            if batch.conversations is not None:  # an agent episode that failed scores 0 (rlcore.agent.serve)
                values = [0.0 if getattr(c, "failed", False) else v for c, v in zip(batch.conversations, values)]
            if batch.conversations is not None and collective:
                metrics.update(agent_metrics(batch.conversations, self.rollout.tp_size))
                metrics.update(getattr(self.agent, "last_metrics", {}))  # agent/*: the endpoint's episodes
            shaped, shape_metrics = rollout_batch.shape_rewards(torch.tensor(values, dtype=torch.float32), batch,
                                                       self.algo, response_budget(self.cfg))
        return shaped, {**metrics, **shape_metrics}


def tail_iterations(calls: list[list[int]], tail: float = 0.1) -> tuple[float, float]:
    """(tail, total) decode iterations of a step whose generate calls, in order, had requests
    producing these token counts. A batched call decodes as long as its longest request (total:
    the sum of each call's max); an iteration is the tail's when at most ``tail`` x the step's
    sequences (the most requests of any call) are still decoding in it: the iterations spent on
    the last 10% while the rest wait, whether within one call or in a step's late, thin chunks."""
    peak = max((len(c) for c in calls), default=0)
    few = math.floor(tail * peak)  # at most this many still decoding: the tail
    tail_n = total = 0.0
    for lengths in calls:
        if not lengths:
            continue
        desc = sorted(lengths, reverse=True)
        total += desc[0]
        tail_n += desc[0] - (desc[few] if few < len(desc) else 0)  # iterations with <= few requests left
    return tail_n, total


def agent_metrics(conversations: list, tp_size: int = 1) -> dict[str, float]:
    """rollout/turns_mean, tool_calls_mean, tool_errors_frac, tool_timeout_frac, finish_* fractions over
    all ranks' conversations (collective; each replica counted once)."""
    from rlcore.agent.loop import FINISH_REASONS, conversation_metrics

    local = conversation_metrics(conversations)
    keys = ["samples", "turns", "tool_calls", "tool_errors", "tool_timeouts", "malformed_calls",
            *[f"finish_{r}" for r in FINISH_REASONS]]
    total = dict(zip(keys, (v / tp_size for v in all_reduce_sum([local.get(k, 0.0) for k in keys]))))
    n, calls = max(total["samples"], 1.0), max(total["tool_calls"] + total["malformed_calls"], 1.0)
    out = {"rollout/turns_mean": total["turns"] / n, "rollout/tool_calls_mean": total["tool_calls"] / n,
           "rollout/tool_errors_frac": total["tool_errors"] / calls,
           "rollout/tool_timeout_frac": total["tool_timeouts"] / calls,
           "rollout/malformed_calls_mean": total["malformed_calls"] / n}
    out.update({f"rollout/finish_{r}_frac": total[f"finish_{r}"] / n for r in FINISH_REASONS})
    return out


def response_budget(cfg: RolloutConfig) -> int:
    """Tokens after the prompt a sample may have: one response, a whole conversation, or an agent
    episode's segment (its context)."""
    if cfg.agent.enable:
        return cfg.max_model_len
    return cfg.multi_turn.max_total_tokens if cfg.multi_turn.enable else cfg.max_response_length


def multi_turn_batch(agent, rollout, prompts: list, r: RolloutConfig, seed: int,
                     timer: Timer | None = None) -> rollout_batch.RolloutBatch:
    """The prompts' conversations (rlcore.agent.loop) as a RolloutBatch with its env mask. The
    timer records the tools' share of the generate time (timing/tool_s) and each turn's generate."""
    n = r.n
    groups = agent.run(rollout, [p.ids for p in prompts], [p.row for p in prompts], n=n, seed=seed,
                       sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k},
                       per_turn_tokens=r.max_response_length)
    if timer is not None:  # inside timing/generate_s: the tools' share, and each turn's generate call
        timer.add("tool", agent.stats["tool_s"])
        for turn, seconds in enumerate(agent.stats["generate_s"], 1):
            timer.add(f"generate_turn{turn}", seconds)
    flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
    return rollout_batch.RolloutBatch(
        prompt_ids=[c.prompt_ids for _, c in flat], response_ids=[c.response_ids for _, c in flat],
        rollout_logp=[c.logprobs for _, c in flat], answers=[p.answer for p, _ in flat],
        finish_reasons=[c.finish for _, c in flat], group_size=n, env_mask=[c.env_mask for _, c in flat],
        final_ids=[c.final_text_ids() for _, c in flat], env_rewards=[c.env_reward for _, c in flat],
        conversations=[c for _, c in flat], rows=[p.row for p, _ in flat],
        segments=[c.all_segments() for _, c in flat] if isinstance(agent, EndpointAgent) else None)  # agent episodes


def shard_for_training(rollout, batch: rollout_batch.RolloutBatch, adv: torch.Tensor, scores: torch.Tensor):
    """Ranks of one TP group hold the same samples: each trains on (and logs) its own slice."""
    tp, tp_rank = rollout.tp_size, rollout.tp_rank
    if tp == 1:
        return batch, adv, scores
    per = len(batch) // tp
    idx = list(range(tp_rank * per, (tp_rank + 1) * per))
    mine = batch.select(idx)
    t = mine.response_mask().shape[1]  # the slice's longest response: adv's columns past it are padding
    return mine, adv[idx][:, :t], scores[idx]
