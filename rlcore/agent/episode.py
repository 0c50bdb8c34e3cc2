"""An agent episode as the endpoint records it: token-exact segments, and what the trainer reads.

Every completion the endpoint serves is recorded from the engine's own ids: the prompt ids exactly
as the engine saw them, the sampled ids and log-probs exactly as sampled; nothing is re-tokenized.
A request whose history extends the previous one (the previous messages, then the assistant message
the endpoint returned, then new messages: rlcore.agent.openai_api decides) continues the current
segment: the new messages' template delta goes in as context (mask 0), then the new sample (mask 1).
Any other request (the agent stripped thinking, summarised, rewrote its history, or the previous
completion was cut) starts a new segment whose prompt is the engine's prompt for that request.

An episode is one sample of its GRPO group; its segments are trained as separate rows sharing the
episode's advantage (rlcore/step/segments.py). To everything between generation and that split
(scoring, dynamic sampling, advantages, partial rollouts, metrics) the episode looks like a
multi-turn Conversation (rlcore.agent.loop): ``prompt_ids``, ``response_ids``, ``env_mask`` and
``logprobs`` are those of its last segment, ``final_text_ids()`` the last completion's tokens,
``env_reward`` the agent's own reward.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

# finish: "stop" (the agent returned), "length" (the endpoint refused a request over the context or the
# episode's request budget: the episode is scored as it stands), "failed" (see FAILURES)
FAILURES = ("raised", "timeout", "malformed", "crashed")


@dataclass
class Segment:
    prompt_ids: list[int]  # the engine's prompt at the segment's first request
    response_ids: list[int] = field(default_factory=list)  # every later token: sampled (mask 1) or context (0)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # vLLM's, 0.0 on context tokens

    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class Episode:
    index: int  # in this rank's call (the request seeds derive from it)
    fallback_ids: list[int]  # the data row's prompt ids: the row of an episode that made no request
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0  # completions served
    appended: int = 0  # of them, requests that extended the previous one
    prompt_tokens: int = 0  # prompt tokens of the served requests
    cached_tokens: int = 0  # of them, served from vLLM's prefix cache
    latency_s: float = 0.0  # from a request's arrival to its response, summed
    tool_calls: int = 0  # calls the model made (parsed by the tool parser)
    final_ids: list[int] = field(default_factory=list)  # the last completion's sampled ids
    env_reward: float | None = None  # what the agent returned (None: the reward components score final_ids)
    finish: str | None = None  # None while running (and when cancelled)
    version: int = 0  # partial rollouts: the policy version that ran it (its tokens' staleness)
    failure: str | None = None  # one of FAILURES when finish == "failed"
    error: str | None = None  # the agent's traceback or the endpoint's reason, cut
    # Serving state (not plain data: dropped by plain()): the append check's view of the last
    # request (rlcore.agent.openai_api.History), whether the episode takes requests, the count admitted.
    history: object = None
    closed: bool = False
    over_budget: bool = False
    asked: int = 0  # requests received (rollout.agent.max_requests counts them)
    admitted: int = 0  # requests admitted into the engine (request k's seed key ends in /k)
    cancelled: bool = False  # partial rollouts: stopped by the step's stop rule, to run again
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ the Conversation interface

    @property
    def last(self) -> Segment:
        return self.segments[-1] if self.segments else Segment(list(self.fallback_ids), [0], [0], [0.0])

    @property
    def prompt_ids(self) -> list[int]:
        return self.last.prompt_ids

    @property
    def response_ids(self) -> list[int]:
        return self.last.response_ids if self.segments or self.finish is not None else []  # [] before it ran

    @property
    def env_mask(self) -> list[int]:
        return self.last.env_mask

    @property
    def logprobs(self) -> list[float]:
        return self.last.logprobs

    @property
    def turns(self) -> int:
        return self.requests

    tool_errors = tool_timeouts = malformed = 0  # the built-in loop's counts: the agent's own business here

    @property
    def versions(self) -> list[int]:
        """The policy version of each of the row's tokens (none before the episode ran)."""
        return [self.version] * len(self.response_ids) if self.segments else []

    def final_text_ids(self) -> list[int]:
        return list(self.final_ids)

    @property
    def failed(self) -> bool:
        return self.finish == "failed"

    def all_segments(self) -> list[Segment]:
        """The rows the episode trains: its segments, or the placeholder row of an episode that
        made no request (context only, nothing trained)."""
        return list(self.segments) or [self.last]

    # ------------------------------------------------------------------ recording

    def record(self, prompt_ids: list[int], delta: list[int] | None, ids: list[int], logprobs: list[float]) -> bool:
        """A served completion: ``delta`` None starts a segment at ``prompt_ids``; else the request's
        prompt is the current segment's ids + ``delta`` (if a concurrent request of the episode grew
        the segment meanwhile, this one starts its own). Call with ``lock`` held; False (nothing
        recorded) once the episode is closed."""
        if self.closed and self.finish is not None:
            return False
        if delta is not None and self.segments and self.segments[-1].ids() + delta == prompt_ids:
            seg = self.segments[-1]
            seg.response_ids += delta
            seg.env_mask += [0] * len(delta)
            seg.logprobs += [0.0] * len(delta)
            self.appended += 1
        else:
            seg = Segment(list(prompt_ids))
            self.segments.append(seg)
        seg.response_ids += ids
        seg.env_mask += [1] * len(ids)
        seg.logprobs += logprobs
        self.final_ids = list(ids)
        return True

    def stop_requests(self) -> None:
        """The endpoint refused a request over a budget (context length, requests per episode): no
        more requests; the episode finishes "length" when the agent returns, scored as it stands
        (an exception the refusal causes is not the agent's failure)."""
        self.closed, self.over_budget = True, True

    def end(self, ok: bool, reward: float | None = None, failure: str | None = None, error: str | None = None) -> bool:
        """The episode is over (first caller wins; call with ``lock`` held): later requests are refused
        and late completions dropped. A failed episode's reward is 0."""
        if self.finish is not None:
            return False
        self.closed = True
        if self.over_budget:
            self.finish, self.env_reward = "length", reward if ok else 0.0
        elif ok:
            self.finish, self.env_reward = "stop", reward
        else:
            self.finish, self.env_reward, self.failure, self.error = "failed", 0.0, failure, error
        return True

    def plain(self) -> dict:
        """The recorded data (to share with TP peers, to checkpoint with partial rollouts)."""
        skip = {"history", "closed", "over_budget", "asked", "admitted", "cancelled", "lock"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["segments"] = [vars(s).copy() for s in self.segments]
        return out

    @classmethod
    def from_plain(cls, data: dict) -> "Episode":
        ep = cls(**{k: v for k, v in data.items() if k != "segments"})
        ep.segments = [Segment(**s) for s in data["segments"]]
        ep.closed = True
        return ep


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """This rank's sums (all-reduced by the caller): requests, segments, append-only requests, prompt
    and cached tokens, latency, failures by kind; cancelled episodes (partial rollouts) left out."""
    episodes = [ep for ep in episodes if not ep.cancelled]
    out = {"episodes": float(len(episodes)), "served": float(sum(ep.requests > 0 for ep in episodes)), "requests": 0.0, "segments": 0.0, "appended": 0.0,
           "prompt_tokens": 0.0, "cached_tokens": 0.0, "latency_s": 0.0, "failures": 0.0, "length": 0.0}
    out.update({f"failure_{k}": 0.0 for k in FAILURES})
    for ep in episodes:
        out["requests"] += ep.requests
        out["segments"] += len(ep.segments)
        out["appended"] += ep.appended
        out["prompt_tokens"] += ep.prompt_tokens
        out["cached_tokens"] += ep.cached_tokens
        out["latency_s"] += ep.latency_s
        out["length"] += ep.finish == "length"
        if ep.failed:
            out["failures"] += 1
            out[f"failure_{ep.failure}"] += 1
    return out


def summarise(total: dict[str, float]) -> dict[str, float]:
    """``agent/*`` from the all-rank sums of episode_metrics."""
    n, req = max(total["episodes"], 1.0), max(total["requests"], 1.0)
    later = total["requests"] - total["served"]  # requests after an episode's first: each could extend the previous
    out = {"agent/episodes": total["episodes"], "agent/failures": total["failures"],
           "agent/failure_frac": total["failures"] / n, "agent/requests_mean": total["requests"] / n,
           "agent/segments_mean": total["segments"] / n,
           "agent/append_only_frac": total["appended"] / later if later > 0 else 1.0,
           "agent/cached_prompt_frac": total["cached_tokens"] / max(total["prompt_tokens"], 1.0),
           "timing/agent_request_s": total["latency_s"] / req, "agent/length_frac": total["length"] / n}
    out.update({f"agent/failures_{k}": total[f"failure_{k}"] for k in FAILURES if total[f"failure_{k}"]})
    return out
