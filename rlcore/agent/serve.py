"""Black-box agents on the colocated engine: each rank serves its own episodes' requests.

``EndpointAgent.run`` has the built-in loop's signature (rlcore.agent.loop.Agent.run), so the step's
generate, validation and the rest take it where they take that loop. A call:

    1. makes n episodes per prompt, each with its own API key; opens the rank's endpoint
       (rlcore.agent.endpoint) on a loopback port;
    2. starts the user's ``run(row=..., base_url=..., api_key=...)`` for each episode in a worker
       (rlcore.agent.workers: a process per episode by default), at most rollout.agent.concurrency
       at a time, each under rollout.agent.timeout_s;
    3. on this thread (the only one that may drive vLLM), until every episode has ended: admits the
       requests the HTTP threads rendered, runs engine steps (rlcore.rollout.serving), hands each
       finished request back to its HTTP thread, ends the episodes whose agent returned, raised,
       crashed or ran past its limit (their process killed, their key revoked, their requests aborted);
    4. closes the endpoint and checks the failure share (collective: every rank stops together).

Batching (rollout.agent.batching): ``continuous`` admits a request as soon as it arrives, into the
running batch (vLLM's scheduler mixes its prefill with the others' decode steps); ``turns`` waits
until every running episode has a request waiting and the engine is idle, then admits them together
(the built-in loop's batches: the same batch composition on every run of a deterministic agent).
scripts/bench_agent.py measures both.

Seeds: request k of episode e samples with the seed key ``{call seed}/{e}/{k}`` (rollout.checks.
request_seed adds the DP replica), so a resumed step's episodes draw what the first run drew.
With TP > 1 only the group's leader (TP rank 0) runs agents and the endpoint; once per loop it sends
the others what to enqueue and abort (an all-gather of plain data), every rank steps its engine in
the same order, and the episodes reach the others at the end.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque

from rlcore.agent.episode import Episode, episode_metrics, summarise
from rlcore.agent.openai_api import ApiError
from rlcore.agent.zygote import CRASHED

log = logging.getLogger("rlcore.agent")
_IDLE_S = 0.05  # the loop's wait when the engine is idle and nothing arrived
_CALL_IDS = 1_000_000  # worker ids of call c: c * _CALL_IDS + the episode's index


class EndpointAgent:
    """What a rank needs to serve agent episodes (built once: rlcore.agent.build_agent)."""

    def __init__(self, cfg, service, rollout, *, runner_factory, leader: bool = True, tp_size: int = 1,
                 sandbox=None):
        from rlcore.rollout.serving import EngineSteps

        self.cfg, self.service, self.leader, self.tp_size = cfg, service, leader, tp_size
        self.steps = EngineSteps(rollout)
        self.runner_factory, self.runner = runner_factory, None
        self.sandbox = sandbox
        self.wake = threading.Event()
        self.jobs: deque = deque()  # rendered requests from the HTTP threads, in arrival order
        self.stats: dict = {}
        self.last_metrics: dict = {}
        self.calls = 0  # run() calls served by this rank
        self.serving = False  # a call's loop is taking requests
        self.reward_note = ""  # how the run's reward uses what run() returns (the start-up line)
        self.told: dict = {}  # TP > 1: the leader's engine calls of this loop iteration (_tell_group)

    # ------------------------------------------------------------------ the call

    def start(self, prompt_ids: list[int], row: dict | None, n: int) -> list[Episode]:
        """A group's n episodes before they run (partial rollouts keep them in their pool)."""
        return [Episode(k, list(prompt_ids)) for k in range(n)]

    def run(self, rollout, prompts: list[list[int]], rows: list, *, n: int, seed: int, sampling: dict,
            per_turn_tokens: int, stop=None) -> list[list[Episode]]:
        """For each prompt (its row) its ``n`` episodes, run to the end; or, with ``stop`` (partial
        rollouts: ``stop(groups done, episodes running) -> bool``, called on every rank once per loop,
        collective), until it says so: the episodes still running are then cancelled (``cancelled``)."""
        episodes = [Episode(k, list(prompts[k // n])) for k in range(len(prompts) * n)]
        self.service.new_call({"temperature": sampling["temperature"], "top_p": sampling.get("top_p", 1.0),
                               "top_k": sampling.get("top_k", -1)}, per_turn_tokens)
        self.stats = {"generate_s": [], "tool_s": 0.0, "turn_lengths": []}
        start = time.perf_counter()
        if self.leader:
            self._serve(episodes, [rows[k // n] for k in range(len(episodes))], seed, n, stop)
        else:
            _replay(self, stop)
        if self.tp_size > 1:
            episodes = self._follow(episodes if self.leader else None)
        self.stats["serve_s"] = time.perf_counter() - start
        self.stats["turn_lengths"] = [[len(s.response_ids) for ep in episodes for s in ep.segments]]
        self.check_failures(episodes)
        return [episodes[i * n: (i + 1) * n] for i in range(len(prompts))]

    def _serve(self, episodes: list[Episode], rows: list, seed: int, n: int, stop) -> None:
        from rlcore.agent.endpoint import Endpoint

        runner = self._runner()
        self.calls += 1
        base = self.calls * _CALL_IDS  # the workers' ids: this call's (a late report of an earlier call is dropped)
        endpoint = Endpoint(self.service, self._submit, lambda ep: runner.kill(base + ep.index), self.cfg.port,
                            self.sandbox, self.cfg.max_requests)
        keys = {secrets.token_urlsafe(18): ep for ep in episodes}
        endpoint.keys = keys
        calls = {ep.index: {"row": row, "base_url": endpoint.base_url, "api_key": key, "model": self.service.model_name,
                            "seed": f"{seed}/{ep.index}"} for (key, ep), row in zip(keys.items(), rows)}
        if self.sandbox is not None:
            calls = {k: {**c, "sandbox_url": endpoint.base_url[: -len("/v1")]} for k, c in calls.items()}
        loop = _Loop(self, episodes, calls, runner, seed, base, n, stop)
        self.serving = True
        try:
            loop.run()
        finally:
            self.serving = False
            endpoint.close()
            loop.release()

    def _follow(self, episodes) -> list[Episode]:
        """TP > 1: every rank of a replica gets its leader's episodes (a collective over all ranks)."""
        from rlcore.dist import all_gather_objects

        data = all_gather_objects([ep.plain() for ep in episodes] if episodes is not None else None)
        mine = data[(self.steps.rollout.dp_rank) * self.tp_size]
        return [Episode.from_plain(d) for d in mine]

    def _submit(self, job) -> None:
        if not self.serving:  # a request that raced the call's end: answered, not left waiting
            _Loop.release_job(job)
            return
        self.jobs.append(job)
        self.wake.set()

    def _runner(self):
        if self.runner is None:
            self.runner = self.runner_factory(self.wake)
        return self.runner

    def start_workers(self) -> None:
        """Start the agents' workers now (the zygote imports the agent: its errors show at build)."""
        self._runner()

    def check_failures(self, episodes: list[Episode]) -> dict[str, float]:
        """All ranks: the call's agent/* metrics; stop the run (exit code 5, every rank together) when
        failures pass rollout.agent.max_failure_frac."""
        from rlcore.dist import all_reduce_sum
        from rlcore.errors import Exit, fail

        local = episode_metrics(episodes)
        keys = sorted(local)
        total = dict(zip(keys, (v / self.tp_size for v in all_reduce_sum([local[k] for k in keys]))))
        self.last_metrics = summarise(total)
        frac = self.last_metrics["agent/failure_frac"]
        if frac > self.cfg.max_failure_frac:
            first = next((ep for ep in episodes if ep.failed), None)
            kinds = ", ".join(f"{k.split('_', 1)[1]} {int(v)}" for k, v in self.last_metrics.items()
                              if k.startswith("agent/failures_"))
            fail(
                f"rollout.agent: {int(total['failures'])} of {int(total['episodes'])} episodes failed ({kinds}), more "
                f"than rollout.agent.max_failure_frac={self.cfg.max_failure_frac}; fix the agent "
                f"({self.cfg.entry}) or raise the limit. A failure on this rank: "
                + (f"{first.failure}: {(first.error or '').strip()[-1500:]}" if first else "(none on this rank)"),
                Exit.AGENT_FAILURES)
        return self.last_metrics

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


class _Loop:
    """One call's serving loop on the leader's main thread (see the module docstring, step 3)."""

    def __init__(self, agent: EndpointAgent, episodes: list[Episode], calls: dict, runner, seed: int, base: int,
                 n: int = 1, stop=None):
        self.agent, self.episodes, self.calls, self.runner, self.seed = agent, episodes, calls, runner, seed
        self.base, self.n, self.stop = base, n, stop
        self.cfg = agent.cfg
        self.waiting = deque(episodes)  # not started yet
        self.deadline: dict[int, float] = {}  # running episodes: index -> time limit
        self.inflight: dict[str, object] = {}  # vLLM request id -> Job
        self.to_score: list = []  # constrained jobs sampled, to be scored with the policy (EngineSteps.score)
        self.logged: set[str] = set()

    def run(self) -> None:
        agent, steps = self.agent, self.agent.steps
        cap = self.cfg.concurrency or len(self.episodes)
        while True:
            while self.waiting and len(self.deadline) < cap:
                ep = self.waiting.popleft()
                self.deadline[ep.index] = time.monotonic() + self.cfg.timeout_s
                self.runner.start(self.base + ep.index, self.calls[ep.index])
            self.collect()
            self.expire()
            submitted = self.admit()
            aborted = self.abort_ended()
            step = steps.busy()
            done = not step and not self.deadline and not self.waiting
            if agent.tp_size > 1:  # the group's other ranks make the same engine calls (_replay)
                done = _tell_group(agent, {"submit": submitted, "abort": aborted, "step": step, "done": done})
            if step:
                for f in steps.step():
                    self.finished(self.inflight.pop(f.request_id, None), f)
            if self.stop is not None:  # partial rollouts: the step's stop rule decides, on every rank
                if self.stop(self.groups_done(), bool(self.deadline or self.waiting)):
                    self.release(cancel=True)
                    return
            elif done and not step:
                return
            if not step:
                agent.wake.wait(_IDLE_S)
                agent.wake.clear()

    def finished(self, job, f) -> None:
        """A request the engine finished: the job is answered, or, when its sample followed a grammar,
        scored first (the engine's log-probs are then the masked distribution's, not the policy's)."""
        if job is None:
            return
        if job.sample is not None:  # its score: the policy's log-probs of the sampled ids
            ids, _, finish, cached = job.sample
            job.sample = (ids, f.logprobs, finish, cached)
        else:
            job.sample = (f.token_ids, f.logprobs, f.finish_reason, f.cached_tokens)
            if job.rescore and f.token_ids:
                self.to_score.append(job)
                return
        job.event.set()

    def groups_done(self) -> int:
        eps, n = self.episodes, self.n
        return sum(all(e.finish is not None for e in eps[i: i + n]) for i in range(0, len(eps), n))

    def collect(self) -> None:
        """The workers' reports: episodes whose agent returned, raised or crashed."""
        for wid, ok, reward, error in self.runner.events():
            eid = wid - self.base
            if not 0 <= eid < len(self.episodes):
                continue  # an episode of an earlier call, killed at its end
            ep = self.episodes[eid]
            failure = None if ok else ("crashed" if (error or "").startswith(CRASHED) else "raised")
            with ep.lock:
                ep.end(ok, reward, failure, error)
            self.note(ep)
            self.deadline.pop(eid, None)

    def expire(self) -> None:
        """End the episodes past their limit. Limits are set as episodes start, all with one timeout, so the
        dict is in deadline order: the loop stops at the first one not yet due (this runs every iteration)."""
        now = time.monotonic()
        for eid, _ in list(itertools.takewhile(lambda item: now > item[1], self.deadline.items())):
            ep = self.episodes[eid]
            with ep.lock:
                ep.end(False, failure="timeout", error=f"the episode ran past rollout.agent.timeout_s="
                                                       f"{self.cfg.timeout_s:g}")
            self.note(ep)
            self.runner.kill(self.base + eid)
            del self.deadline[eid]

    def admit(self) -> list[tuple]:
        """Queued requests into the engine: all of them (continuous), or once every running episode
        has one waiting and the engine is idle (turns). Returns what was submitted, as plain data."""
        jobs, out = self.agent.jobs, []
        for job in self.to_score:  # sampled under a grammar in the last step: scored before anything else
            request = ("score", job.prompt_ids + list(job.sample[0]), len(job.prompt_ids))
            rid = _submit(self.agent.steps, request)
            self.inflight[rid] = job
            out.append((rid, request))
        self.to_score = []
        if not jobs:
            return out
        if self.cfg.batching == "turns":
            waiting = {j.episode.index for j in jobs}
            if self.inflight or any(eid not in waiting for eid in self.deadline):
                return out
        batch = []
        while jobs:
            batch.append(jobs.popleft())
        if self.cfg.batching == "turns":
            batch.sort(key=lambda j: j.episode.index)
        for job in batch:
            ep = job.episode
            with ep.lock:
                over, k = ep.finish is not None, ep.admitted
                ep.admitted += 1
            if over:
                self.release_job(job)
                continue
            request = ("sample", job.prompt_ids, f"{self.seed}/{ep.index}/{k}", job.max_tokens,
                       {**self.agent.service.sampling, **job.stops, "structured_outputs": job.constraint})
            rid = _submit(self.agent.steps, request)
            self.inflight[rid] = job
            out.append((rid, request))
        return out

    def abort_ended(self) -> list[str]:
        dead = [rid for rid, job in self.inflight.items() if job.episode.finish is not None]
        self.agent.steps.abort(dead)
        for rid in dead:
            self.release_job(self.inflight.pop(rid))
        return dead

    @staticmethod
    def release_job(job) -> None:
        job.error = ApiError(410, "this episode is over", "episode_over")
        job.event.set()

    def note(self, ep: Episode) -> None:
        """Say a failure once per kind and call (the first line of what the agent raised)."""
        if ep.failed and ep.failure not in self.logged:
            self.logged.add(ep.failure)
            tail = (ep.error or "").strip().splitlines()[-1:] or [""]
            log.warning("rollout.agent: episode %d failed (%s): %s", ep.index, ep.failure, tail[0][:300])

    def release(self, cancel: bool = False) -> None:
        """After the call (or on an error): nothing runs on, nothing waits. ``cancel``: the episodes
        not finished are cancelled (partial rollouts run their groups again), not failed."""
        for eid in list(self.deadline):
            self.runner.kill(self.base + eid)
            ep = self.episodes[eid]
            with ep.lock:
                if cancel and ep.finish is None:
                    ep.cancelled = ep.closed = True
                else:
                    ep.end(False, failure="timeout", error="the call ended before the episode")
        self.deadline.clear()
        for ep in self.waiting:
            ep.cancelled = ep.closed = True
        self.waiting.clear()
        self.agent.steps.abort(list(self.inflight))
        for job in list(self.inflight.values()) + list(self.agent.jobs) + self.to_score:
            self.release_job(job)
        self.inflight.clear()
        self.to_score = []
        self.agent.jobs.clear()


def _submit(steps, request: tuple) -> str:
    """One engine request, as plain data (TP > 1: the group's other ranks make the same)."""
    if request[0] == "score":
        return steps.score(request[1], request[2])
    _, ids, seed, max_tokens, sampling = request
    return steps.submit(ids, seed=seed, max_tokens=max_tokens, **sampling)


def _tell_group(agent: EndpointAgent, message: dict | None) -> bool:
    """TP > 1, once per loop on every rank: each leader's engine calls reach its group (an all-gather
    over all ranks: the replicas loop together); True once every leader is done."""
    from rlcore.dist import all_gather_objects

    gathered = all_gather_objects(message)
    agent.told = gathered[agent.steps.rollout.dp_rank * agent.tp_size]
    return all(m["done"] for m in gathered[:: agent.tp_size])


def _replay(agent: EndpointAgent, stop=None) -> None:
    """A TP rank that is not its group's leader: make the leader's engine calls, in its order (and
    take part in the stop rule's collective, when there is one)."""
    ids: dict[str, str] = {}  # the leader's request id -> this rank's
    while True:
        done = _tell_group(agent, None)
        told = agent.told
        for leader_rid, request in told["submit"]:
            ids[leader_rid] = _submit(agent.steps, request)
        agent.steps.abort([ids.pop(r) for r in told["abort"] if r in ids])
        if told["step"]:
            agent.steps.step()  # finished requests leave the engine; their ids are not reused
        if stop is not None:
            if stop(0, False):
                return
        elif done and not told["step"]:
            return
