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

With dynamic sampling (``algorithm.dynamic_sampling``) each group is scored when it finishes and,
if its rewards are all equal, leaves the pool (DAPO's filter: only informative groups count toward
``target``); the pool is refilled from the prompt order with up to ``(max_sampling_rounds - 1) x
target`` new groups a step, as many prompts as dynamic sampling's extra rounds draw without partial
rollouts. A rank still short once no rank can get more trains filtered groups masked out of the
loss, as without partial rollouts.

Multi-turn conversations (``rollout.multi_turn``, plain tools) are suspended between turns or
inside one: a chunk continues each conversation's current turn; a turn that ends is parsed and its
tool calls run, as rlcore.agent.loop does, and the next chunk starts the next turn. Images, routing
replay and environments (env.cls: state a checkpoint cannot carry) are refused by the config check.

Agent episodes (``rollout.agent``) are never suspended: an episode's state is the agent program's, in
its own process, which neither a weight update nor a checkpoint can carry. The step runs its groups'
episodes with the stop rule checked on every loop of the endpoint's serving (rlcore.agent.serve); when
it fires, the episodes still running are cancelled (their processes killed, their requests aborted)
and their groups wait in the pool to be run again, whole, from the start, in a later step: no token
of an agent episode is ever trained under a policy other than the one that sampled it. Finished
groups beyond the step's target wait in the pool as other finished groups do (one version stale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlcore.agent.serve import EndpointAgent
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

    @property
    def response_ids(self) -> list[int]:  # as a Conversation's (multi-turn groups hold those)
        return self.ids


@dataclass
class Group:
    prompt: Prompt
    start: int  # the step that started it
    seqs: list  # Seq, or rlcore.agent.loop.Conversation (multi-turn)
    informative: bool | None = None  # dynamic sampling: rewards not all equal (None: not scored yet)

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    def oldest(self) -> int | None:
        return min((v for s in self.seqs for v in s.versions), default=None)


class PartialRollouts:
    """The suspended groups of this rank and the step's generation (see the module docstring)."""

    def __init__(self, cfg, n: int, max_response_length: int, dynamic: bool = False, max_rounds: int = 1,
                 agent=None):
        self.cfg, self.n, self.max_len = cfg, n, max_response_length  # cfg: rlcore.config.PartialConfig
        self.dynamic, self.max_rounds = dynamic, max_rounds  # algorithm.dynamic_sampling, max_sampling_rounds
        self.agent = agent  # rlcore.agent.loop.Agent: multi-turn conversations (max_response_length: per turn)
        self.pool: list[Group] = []

    # ------------------------------------------------------------------------- the step

    def sample(self, sampler, step: int) -> tuple[rollout_batch.RolloutBatch, dict]:
        """This rank's ``target`` finished groups for ``step`` as a batch (groups of n), and metrics."""
        version, target = step - 1, sampler.per_replica()  # the policy generating now has had step - 1 updates
        dropped, in_flight = self._drop_stale(version), math.ceil(self.cfg.oversample * target)
        self._start_groups(sampler, step, in_flight)
        chunks, filtered, judged = 0, [], 0
        refill = (self.max_rounds - 1) * target  # dynamic sampling: groups a step may start beyond the first fill
        if self.agent is not None:
            self.agent.stats = {"generate_s": [], "tool_s": 0.0, "turn_lengths": []}
        resumed_at_start = {id(g) for g in self.pool if any(x.response_ids for x in g.seqs)}  # from earlier steps
        while True:
            if self.dynamic:  # the filter: finished groups whose rewards are all equal leave the pool
                new, out = self._filter(sampler, version)
                judged, filtered = judged + new, filtered + out
                refill -= self._start_groups(sampler, step, in_flight, cap=refill)  # for the filtered ones
            ready = sum(g.done for g in self.pool)
            unfinished = any(s.finish is None for g in self.pool for s in g.seqs)
            with sampler.timer("stop_rule"):  # timing/stop_rule_s: mostly waiting for the slowest rank's chunk
                short, moving = all_reduce_max([float(target - min(ready, target)), float(unfinished)])
            if short == 0 or not moving:  # every rank has enough, or no rank can get more (rounds used up)
                break
            if isinstance(self.agent, EndpointAgent):  # agent episodes: run whole, cancelled at the stop rule
                self._run_episodes(sampler, step, chunks, version, target)
            else:
                self._generate_chunk(sampler, step, chunks, version)
            chunks += 1
        if self.agent is not None:
            sampler.timer.add("tool", self.agent.stats["tool_s"])  # inside timing/generate_s
        chosen = sorted((g for g in self.pool if g.done), key=lambda g: g.start)[:target]
        self.pool = [g for g in self.pool if all(g is not c for c in chosen)]
        pads = filtered[: target - len(chosen)]  # a rank still short trains filtered groups masked out
        batch = self._batch(chosen + pads, version)
        if pads:
            batch.keep = [1.0] * (len(chosen) * self.n) + [0.0] * (len(pads) * self.n)
        metrics = self._metrics(chosen, resumed_at_start, dropped, chunks, batch, sampler.rollout.tp_size)
        if self.dynamic:
            started = (self.max_rounds - 1) * target - refill  # beyond the first fill
            metrics.update(self._filter_metrics(judged, len(filtered), started, target, sampler.rollout))
        return batch, metrics

    def _filter(self, sampler, version: int) -> tuple[int, list[Group]]:
        """Score the groups that finished since the last call (DAPO's filter): those whose rewards
        are all equal leave the pool. Returns (groups scored, the filtered ones)."""
        new = [g for g in self.pool if g.done and g.informative is None]
        if not new:
            return 0, []
        scores, _ = sampler.score(self._batch(new, version), collective=False)  # only this rank scores here
        good = set(rollout_batch.informative_groups(scores, self.n))
        for i, g in enumerate(new):
            g.informative = i in good
        out = [g for g in new if not g.informative]
        self.pool = [g for g in self.pool if g.informative is not False]
        return len(new), out

    def _filter_metrics(self, judged: int, filtered: int, started: int, target: int, rollout) -> dict[str, float]:
        """rollout/sampling_rounds: 1 + the refills in rounds' worth of ``target`` groups (the most of any rank)."""
        total_judged, total_filtered = (v / rollout.tp_size for v in all_reduce_sum([float(judged), float(filtered)]))
        rounds = 1 + math.ceil(all_reduce_max([float(started)])[0] / max(target, 1))
        frac = total_filtered / max(total_judged, 1.0)
        return {"rollout/filtered_groups_frac": frac, "rollout/zero_variance_groups_frac": frac,
                "rollout/sampling_rounds": float(rounds),
                "rollout/generated_per_trained": total_judged / max(target * rollout.dp_size, 1)}

    def _drop_stale(self, version: int) -> int:
        keep = [g for g in self.pool if g.oldest() is None or version - g.oldest() <= self.cfg.max_staleness]
        dropped = len(self.pool) - len(keep)
        self.pool = keep
        return dropped

    def _start_groups(self, sampler, step: int, in_flight: int, cap: int | None = None) -> int:
        """Fill the pool to ``in_flight`` groups, at most ``cap`` new ones; every rank draws max-over-
        ranks prompts per replica from the shared order (a collective) and uses its slice's first
        ones. Returns how many this rank started."""
        want = max(in_flight - len(self.pool), 0) if cap is None else min(max(in_flight - len(self.pool), 0), cap)
        need = int(all_reduce_max([float(want)])[0])
        if need == 0:
            return 0
        mine = sampler.next_prompts(need)[:want]
        self.pool += [Group(p, step, self.agent.start(p.ids, p.row, self.n) if self.agent is not None
                            else [Seq() for _ in range(self.n)]) for p in mine]
        return len(mine)

    def _generate_chunk(self, sampler, step: int, chunk: int, version: int) -> None:
        """One generate call: every unfinished sequence continues by up to ``chunk_tokens`` tokens
        (a conversation: its current turn, which may have begun in an earlier chunk or step)."""
        todo = [(g, s) for g in self.pool for s in g.seqs if s.finish is None]
        if not todo:
            if self.agent is not None:
                self.agent.answer([])  # with TP every rank ends each chunk in the tools' collective
            return
        r = sampler.cfg
        if sampler.switch is not None:
            sampler.switch.ensure_generation()
        stop = {"stop_token_ids": self.agent.stop_token_ids} if self.agent is not None else {}
        contexts = [(s.prompt_ids if self.agent is not None else g.prompt.ids) + s.response_ids for g, s in todo]
        with sampler.timer("generate"):
            out = sampler.rollout.generate(contexts, n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                           max_tokens=self.cfg.chunk_tokens,
                                           seed=generation_seed(sampler.seed, step, chunk), **stop)
        sampler.count_decode([len(sample.response_ids) for (sample,) in out])
        if self.agent is not None:
            return self._continue_turns([s for _, s in todo], [o for (o,) in out], version)
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

    def _run_episodes(self, sampler, step: int, chunk: int, version: int, target: int) -> None:
        """Agent episodes of the pool's unfinished groups, run until every rank has ``target`` finished
        groups (or none can get more): the rest are cancelled and stay in the pool to run again."""
        todo = [g for g in self.pool if not g.done]
        before = sum(g.done for g in self.pool)

        def stop(done: int, running: bool) -> bool:  # every rank, once per serving loop (collective)
            short, moving = all_reduce_max([float(target - min(before + done, target)), float(running)])
            return short == 0 or not moving

        r = sampler.cfg
        if sampler.switch is not None:
            sampler.switch.ensure_generation()
        with sampler.timer("generate"):
            groups = self.agent.run(sampler.rollout, [g.prompt.ids for g in todo], [g.prompt.row for g in todo],
                                    n=self.n, seed=generation_seed(sampler.seed, step, chunk),
                                    sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k},
                                    per_turn_tokens=r.max_response_length, stop=stop)
        for g, episodes in zip(todo, groups):
            if all(e.finish is not None for e in episodes):  # else its placeholders stay: run again later
                for e in episodes:
                    e.version = version
                g.seqs = episodes

    def _continue_turns(self, convs: list, samples: list, version: int) -> None:
        """Each conversation's turn grows by its chunk; a turn that ended (end of turn, or its
        per-turn or total token budget) is closed as rlcore.agent.loop does it, and the tools of
        all closed turns answer together (their tokens are context: env_mask 0)."""
        agent, pending = self.agent, []
        for c, sample in zip(convs, samples):
            if c.turn_start is None:
                c.turn_start = len(c.response_ids)
            room = min(self.max_len - (len(c.response_ids) - c.turn_start), agent.max_total_tokens - len(c.response_ids))
            ids, lps = list(sample.response_ids[:room]), list(sample.logprobs[:room])
            c.response_ids += ids
            c.env_mask += [1] * len(ids)
            c.logprobs += lps
            ended = sample.finish_reason == "stop" and len(sample.response_ids) <= room
            if ended or len(ids) >= room:
                answer = agent.close_turn(c, c.turn_start, cut=not ended)
                if answer is not None:
                    pending.append((c, answer))
        agent.answer(pending)
        for c in convs:  # the sampled tokens and the tools' answers: this version's
            c.versions += [version] * (len(c.response_ids) - len(c.versions))

    # ------------------------------------------------------------------------- the batch and metrics

    def _batch(self, groups: list[Group], version: int) -> rollout_batch.RolloutBatch:
        flat = [(g, s) for g in groups for s in g.seqs]
        stale = [[version - v for v in s.versions] for _, s in flat]
        if self.agent is not None:  # conversations (agent episodes), as rlcore.step.sampling.multi_turn_batch builds them
            return rollout_batch.RolloutBatch(
                prompt_ids=[c.prompt_ids for _, c in flat], response_ids=[list(c.response_ids) for _, c in flat],
                rollout_logp=[list(c.logprobs) for _, c in flat], answers=[g.prompt.answer for g, _ in flat],
                finish_reasons=[c.finish for _, c in flat], group_size=self.n,
                env_mask=[list(c.env_mask) for _, c in flat], final_ids=[c.final_text_ids() for _, c in flat],
                env_rewards=[c.env_reward for _, c in flat], conversations=[c for _, c in flat],
                rows=[g.prompt.row for g, _ in flat], staleness=stale,
                segments=[c.all_segments() for _, c in flat] if isinstance(self.agent, EndpointAgent) else None)
        return rollout_batch.RolloutBatch(
            prompt_ids=[g.prompt.ids for g, _ in flat], response_ids=[list(s.ids) for _, s in flat],
            rollout_logp=[list(s.logprobs) for _, s in flat], answers=[g.prompt.answer for g, _ in flat],
            finish_reasons=[s.finish for _, s in flat], group_size=self.n, rows=[g.prompt.row for g, _ in flat],
            staleness=stale)

    def _metrics(self, chosen: list[Group], resumed: set, dropped: int, chunks: int,
                 batch: rollout_batch.RolloutBatch, tp_size: int) -> dict[str, float]:
        masks = batch.env_mask or [[1] * len(row) for row in batch.staleness]  # the policy's own tokens
        stale = [x for row, m in zip(batch.staleness, masks) for x, k in zip(row, m) if k]
        in_flight = [len(s.response_ids) for g in [*chosen, *self.pool] for s in g.seqs if s.response_ids]
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
        """The pool as plain data, a copy: the loop snapshots it at each step's start (the state a
        preemption saves when it abandons the step), and the step then grows the live lists. A
        conversation goes without its environment (partial rollouts refuse env.cls)."""
        return [{"prompt": dict(vars(g.prompt)), "start": g.start, "informative": g.informative,
                 "seqs": [_plain(s) for s in g.seqs]} for g in self.pool]

    def load_state_dict(self, pool: list[dict]) -> None:
        from rlcore.agent.episode import Episode
        from rlcore.agent.loop import Conversation

        if isinstance(self.agent, EndpointAgent):  # agent episodes (rollout.agent)
            make = Episode.from_plain
        else:
            kind = Seq if self.agent is None else Conversation
            make = lambda s: kind(**s)  # noqa: E731
        self.pool = [Group(Prompt(**g["prompt"]), g["start"], [make(s) for s in g["seqs"]], g.get("informative"))
                     for g in pool]


def _plain(seq) -> dict:
    """A Seq's, a Conversation's or an agent Episode's fields, each list copied (their items are not
    mutated after)."""
    if hasattr(seq, "plain"):
        return seq.plain()
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(seq).items() if k != "env"}
