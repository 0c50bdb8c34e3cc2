"""Partial rollouts with an early stop (``rollout.partial``): a step stops generating once every rank
has enough finished groups; the others are suspended on their rank, with their tokens so far, vLLM's
log-prob of each token (its behaviour policy) and the policy version that sampled it, and continue in
the next step from where they stopped (re-prefilled under the new weights).

Per rank, each step:

    1. drop suspended groups whose oldest token would be trained more than ``max_staleness`` policy
       versions after it was sampled (counted: rollout/dropped_stale)
    2. start new groups so that ``ceil(oversample x target)`` are in flight (one collective: every
       rank draws the same number of prompts from the shared order, as without partial rollouts)
    3. generate in chunks of ``chunk_tokens`` per unfinished sequence; after each chunk one all-reduce
       of the finished-group counts: stop when every rank has ``target`` (no controller, no router)
    4. train ``target`` finished groups, oldest first (a group that waited is never passed over for a
       newer short one: the trained set is biased toward short responses only by what the early
       stop cuts, measured as rollout/partial_len_bias: the trained sequences' mean length over that
       of every sequence with tokens, trained or suspended); the rest stay suspended

A step whose pool already holds enough finished groups (left over by the previous one) trains them
without generating; their tokens are then one policy version old (rollout/staleness_*).

``oversample`` 1 waits for every group (synchronous, in chunks); above 1 the stragglers are suspended,
not thrown away. A group trains once all its samples have finished, so GRPO's baseline compares
complete responses. The suspended state is part of the checkpoint (StepSampler.state_dict).
Single-turn text prompts only (multi-turn, images, routing replay and dynamic sampling are refused
by the config check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlcore.algo import batch as rollout_batch
from rlcore.dist import all_reduce_max, all_reduce_sum
from rlcore.task.prompts import Prompt, generation_seed


@dataclass
class Seq:
    """One sample in flight: its tokens so far, vLLM's log-prob of each, the policy version of each."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once finished


@dataclass
class Group:
    prompt: Prompt
    start: int  # the step that started it
    seqs: list[Seq]

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    def oldest(self) -> int | None:
        return min((v for s in self.seqs for v in s.versions), default=None)


class PartialRollouts:
    """The suspended groups of this rank and the step's generation (see the module docstring)."""

    def __init__(self, cfg, n: int, max_response_length: int):
        self.cfg, self.n, self.max_len = cfg, n, max_response_length  # cfg: rlcore.config.PartialConfig
        self.pool: list[Group] = []

    # ------------------------------------------------------------------------- the step

    def sample(self, sampler, step: int) -> tuple[rollout_batch.RolloutBatch, dict]:
        """This rank's ``target`` finished groups for ``step`` as a batch (groups of n), and metrics."""
        version, target = step - 1, sampler.per_replica()  # the policy generating now has had step - 1 updates
        dropped = self._drop_stale(version)
        self._start_groups(sampler, step, math.ceil(self.cfg.oversample * target))
        chunks, resumed_at_start = 0, {id(g) for g in self.pool if any(x.ids for x in g.seqs)}  # from earlier steps
        while True:
            ready = sum(g.done for g in self.pool)
            if all_reduce_max([float(target - min(ready, target))])[0] == 0:  # every rank has enough
                break
            self._generate_chunk(sampler, step, chunks, version)
            chunks += 1
        chosen = sorted((g for g in self.pool if g.done), key=lambda g: g.start)[:target]
        self.pool = [g for g in self.pool if all(g is not c for c in chosen)]
        batch = self._batch(chosen, version)
        return batch, self._metrics(chosen, resumed_at_start, dropped, chunks, batch, sampler.rollout.tp_size)

    def _drop_stale(self, version: int) -> int:
        keep = [g for g in self.pool if g.oldest() is None or version - g.oldest() <= self.cfg.max_staleness]
        dropped = len(self.pool) - len(keep)
        self.pool = keep
        return dropped

    def _start_groups(self, sampler, step: int, in_flight: int) -> None:
        """Fill the pool to ``in_flight`` groups; every rank draws max-over-ranks prompts per replica
        from the shared order (a collective), and uses its slice's first ones."""
        need = int(all_reduce_max([float(max(in_flight - len(self.pool), 0))])[0])
        if need == 0:
            return
        mine = sampler.next_prompts(need)[: max(in_flight - len(self.pool), 0)]
        self.pool += [Group(p, step, [Seq() for _ in range(self.n)]) for p in mine]

    def _generate_chunk(self, sampler, step: int, chunk: int, version: int) -> None:
        """One generate call: every unfinished sequence continues by up to ``chunk_tokens`` tokens."""
        todo = [(g, s) for g in self.pool for s in g.seqs if s.finish is None]
        if not todo:
            return
        r = sampler.cfg
        if sampler.switch is not None:
            sampler.switch.ensure_generation()
        with sampler.timer("generate"):
            out = sampler.rollout.generate([g.prompt.ids + s.ids for g, s in todo], n=1, temperature=r.temperature,
                                           top_p=r.top_p, top_k=r.top_k, max_tokens=self.cfg.chunk_tokens,
                                           seed=generation_seed(sampler.seed, step, chunk))
        for (_, s), (sample,) in zip(todo, out):
            room = self.max_len - len(s.ids)
            ids, lps = sample.response_ids[:room], sample.logprobs[:room]
            s.ids += ids
            s.logprobs += lps
            s.versions += [version] * len(ids)
            if sample.finish_reason == "stop" and len(sample.response_ids) <= room:
                s.finish = "stop"
            elif len(s.ids) >= self.max_len:
                s.finish = "length"

    # ------------------------------------------------------------------------- the batch and metrics

    def _batch(self, groups: list[Group], version: int) -> rollout_batch.RolloutBatch:
        flat = [(g, s) for g in groups for s in g.seqs]
        return rollout_batch.RolloutBatch(
            prompt_ids=[g.prompt.ids for g, _ in flat], response_ids=[list(s.ids) for _, s in flat],
            rollout_logp=[list(s.logprobs) for _, s in flat], answers=[g.prompt.answer for g, _ in flat],
            finish_reasons=[s.finish for _, s in flat], group_size=self.n, rows=[g.prompt.row for g, _ in flat],
            staleness=[[version - v for v in s.versions] for _, s in flat])

    def _metrics(self, chosen: list[Group], resumed: set, dropped: int, chunks: int,
                 batch: rollout_batch.RolloutBatch, tp_size: int) -> dict[str, float]:
        stale = [x for row in batch.staleness for x in row]
        in_flight = [len(s.ids) for g in [*chosen, *self.pool] for s in g.seqs if s.ids]  # every started sequence
        local = [float(sum(id(g) in resumed for g in chosen)), float(len(chosen)), float(sum(stale)),
                 float(len(stale)), float(dropped), float(len(self.pool)), float(sum(len(r) for r in batch.response_ids)),
                 float(len(batch)), float(sum(in_flight)), float(len(in_flight))]
        (res, groups, st_sum, st_n, drop, susp, tr_len, tr_n, all_len, all_n) = (v / tp_size for v in all_reduce_sum(local))
        return {"rollout/partial_frac": res / max(groups, 1.0), "rollout/staleness_mean": st_sum / max(st_n, 1.0),
                "rollout/staleness_max": all_reduce_max([float(max(stale, default=0))])[0],
                "rollout/dropped_stale": drop, "rollout/suspended_groups": susp, "rollout/chunks": float(chunks),
                "rollout/partial_len_bias": (tr_len / max(tr_n, 1.0)) / max(all_len / max(all_n, 1.0), 1e-9)}

    # ------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> list[dict]:
        return [{"prompt": vars(g.prompt), "start": g.start, "seqs": [vars(s) for s in g.seqs]} for g in self.pool]

    def load_state_dict(self, pool: list[dict]) -> None:
        self.pool = [Group(Prompt(**g["prompt"]), g["start"], [Seq(**s) for s in g["seqs"]]) for g in pool]
