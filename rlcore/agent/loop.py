"""The multi-turn rollout: every rank runs all its active conversations turn by turn.

Each turn is ONE batched ``generate`` over the rank's still-active conversations on the colocated
engine (same seeding scheme as single-turn: a resumed step samples what the uninterrupted one
did), then the turn's tool calls of all conversations run together in a bounded pool, then each
conversation gets its tool messages as template-rendered delta ids (rlcore.agent.chat). A
conversation ends on an end-of-turn without a call ("stop"), when its environment says done
("env_done"), after ``max_turns`` ("max_turns"), or on a token budget ("length").

Per sample, ``response_ids`` is everything after the prompt, and ``env_mask`` marks the model's
own tokens (1: trained, with vLLM's log-probs) apart from tool/environment tokens (0: context).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlcore.agent.chat import ChatRenderer, ToolCallParser
from rlcore.agent.tools import CallResult, ToolRunner

FINISH_REASONS = ("stop", "env_done", "max_turns", "length")
_TURN_SEED = 2**56  # turn t >= 1 of a call draws from seed + t * _TURN_SEED


@dataclass
class Conversation:
    prompt_ids: list[int]
    messages: list[dict]  # the conversation as messages (for environments, logs and val samples)
    env: object = None  # this sample's environment instance (env.cls), or None: plain tools
    response_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = tool/environment
    logprobs: list[float] = field(default_factory=list)  # vLLM's, 0.0 on environment tokens
    last_turn: tuple[int, int] = (0, 0)  # [start, end) of the final model turn in response_ids
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed: int = 0
    env_reward: float | None = None
    finish: str | None = None  # None while active
    # Partial rollouts (rlcore.step.partial): the policy version of each response token, and where
    # the turn being generated chunk by chunk began in response_ids (None: between turns).
    versions: list[int] = field(default_factory=list)
    turn_start: int | None = None

    def final_text_ids(self) -> list[int]:
        return self.response_ids[self.last_turn[0]: self.last_turn[1]]


@dataclass
class Agent:
    """What a rank needs to run conversations: built once (rlcore.agent.build_agent)."""

    tokenizer: object
    renderer: ChatRenderer
    parser: ToolCallParser
    runner: ToolRunner
    max_turns: int
    max_total_tokens: int
    max_tool_response_tokens: int
    env_factory: object = None  # callable -> a fresh environment, or None
    stop_token_ids: list[int] = field(default_factory=list)  # end a turn besides EOS (multi_turn.stop_on)
    # TP > 1: the ranks of a replica hold the same conversations; only the leader (TP rank 0) runs
    # tools and environments, ``share(obj)`` hands its answers to the others (a collective per turn).
    leader: bool = True
    share: object = None
    stats: dict = field(default_factory=dict)  # timing of the last call: generate per turn, tools

    def start(self, prompt_ids: list[int], row: dict | None, n: int) -> list[Conversation]:
        """The n conversations of one prompt; with an environment each gets its own, reset on the row."""
        convs = []
        for _ in range(n):
            env = self.env_factory() if self.env_factory else None
            messages = list(env.reset(row)) if env is not None else []
            convs.append(Conversation(prompt_ids, messages, env))
        if self.env_factory:  # the prompt is what the environment's reset says, rendered with the tools
            ids = self.renderer.prompt_ids(convs[0].messages)
            for c in convs:
                c.prompt_ids = ids
        return convs

    def run(self, rollout, prompts: list[list[int]], rows: list, *, n: int, seed: int, sampling: dict,
            per_turn_tokens: int) -> list[list[Conversation]]:
        """For each prompt its ``n`` conversations, run to the end."""
        groups = [self.start(p, r, n) for p, r in zip(prompts, rows)]
        prompts = [g[0].prompt_ids for g in groups]
        flat = [c for g in groups for c in g]
        sampling = {**sampling, "stop_token_ids": self.stop_token_ids}
        self.stats = {"generate_s": [], "tool_s": 0.0, "turn_lengths": []}
        for turn in range(self.max_turns):
            active = [c for c in flat if c.finish is None]
            if not active and self.share is None:
                break  # with TP ranks every rank keeps the turn count: each turn ends in a collective
            outs = self.generate_turn(rollout, prompts, active, n, seed, turn, sampling, per_turn_tokens)
            pending = [(c, p) for c, p in ((c, self.take_turn(c, s)) for c, s in zip(active, outs)) if p is not None]
            self.answer(pending)
        for c in flat:
            c.finish = c.finish or "max_turns"
        return groups

    def generate_turn(self, rollout, prompts, active, n, seed, turn, sampling, per_turn_tokens) -> list:
        """One batched generate over the active conversations: each one's sample of this turn."""
        if not active:
            return []
        room = max(self.max_total_tokens - len(c.response_ids) for c in active)
        start = time.perf_counter()
        if turn == 0:  # n samples per prompt, exactly as a single-turn step draws them
            outs = [s for g in rollout.generate(prompts, n=n, seed=seed, max_tokens=min(per_turn_tokens, room),
                                                **sampling) for s in g]
        else:
            outs = [g[0] for g in rollout.generate([c.prompt_ids + c.response_ids for c in active], n=1,
                                                   seed=seed + turn * _TURN_SEED,
                                                   max_tokens=min(per_turn_tokens, room), **sampling)]
        self.stats["generate_s"].append(time.perf_counter() - start)
        self.stats["turn_lengths"].append([len(o.response_ids) for o in outs])
        return outs

    def take_turn(self, c: Conversation, sample) -> tuple | None:
        """Append the turn's sampled ids; return what the tools or the environment must answer
        (``(kind, parsed turn)``), or None when the conversation ended here."""
        budget = self.max_total_tokens - len(c.response_ids)
        ids, logp = list(sample.response_ids[:budget]), list(sample.logprobs[:budget])
        start = len(c.response_ids)
        c.response_ids += ids
        c.env_mask += [1] * len(ids)
        c.logprobs += logp
        return self.close_turn(c, start, cut=sample.finish_reason == "length" or len(ids) < len(sample.response_ids))

    def close_turn(self, c: Conversation, start: int, cut: bool) -> tuple | None:
        """The model turn ``response_ids[start:]`` is complete (``cut``: by a token budget): parse it
        and say what must answer it (see take_turn)."""
        ids = c.response_ids[start:]
        c.last_turn, c.turn_start = (start, len(c.response_ids)), None
        c.turns += 1
        prefix = self.renderer.first_turn_prefix if c.turns == 1 else ""  # the first turn continues it
        parsed = self.parser.parse(prefix + self.turn_text(ids))
        c.malformed += parsed.malformed
        c.messages.append({"role": "assistant", "content": parsed.content,
                           **({"tool_calls": [{"type": "function", "function": {"name": nm, "arguments": a}}
                                              for nm, a in parsed.calls]} if parsed.calls else {})})
        if cut:
            c.finish = "length"  # cut: no call of it runs; an environment still scores the conversation
            return ("env_final", parsed) if c.env is not None else None
        if c.env is not None:
            return ("env", parsed)
        if parsed.malformed:
            return ("malformed", parsed)
        if not parsed.calls:
            c.finish = "stop"
            return None
        return ("calls", parsed)

    def answer(self, pending: list[tuple[Conversation, tuple]]) -> None:
        """The turn's tools and environments answer every pending conversation together (with TP,
        the leader runs them and the replica's other ranks take its answers: call it on every rank)."""
        start = time.perf_counter()
        outcomes = self.outcomes(pending) if self.leader else None
        if self.share is not None:  # the TP ranks of a replica continue with its leader's tool answers
            outcomes = self.share(outcomes)
        self.apply(pending, outcomes)
        self.stats["tool_s"] = self.stats.get("tool_s", 0.0) + time.perf_counter() - start

    def turn_text(self, ids: list[int]) -> str:
        """A turn's text for the parser: special tokens kept (some templates' call markers are
        special), the closing end-of-turn token dropped."""
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)

    def outcomes(self, pending: list[tuple[Conversation, tuple]]) -> list[dict]:
        """What the tools and environments answer, per pending conversation (plain data, so the
        TP ranks of a replica can take their leader's): the new messages (None: the conversation
        ended), a reward, and the call counts. Every call of the turn runs together."""
        calls = [call for _, (kind, parsed) in pending if kind == "calls" for call in parsed.calls]
        results = iter(self.runner.run(calls)) if calls else iter(())
        out = []
        for c, (kind, parsed) in pending:
            o = {"new": None, "reward": None, "done": False, "calls": 0, "errors": 0, "timeouts": 0}
            if kind in ("env", "env_final"):
                new, o["reward"], o["done"] = c.env.step(list(c.messages))
                o["new"] = [dict(m) for m in new] if kind == "env" and not o["done"] else None
                o["calls"] = len(parsed.calls)
            elif kind == "malformed":
                o["new"] = [{"role": "tool", "content": "Error: the tool call could not be parsed; write it in "
                             "the format the system prompt shows"}]
                o["errors"] = 1
            else:
                rs: list[CallResult] = [next(results) for _ in parsed.calls]
                o["new"] = [{"role": "tool", "content": r.content} for r in rs]
                o.update(calls=len(rs), errors=sum(r.error is not None for r in rs),
                         timeouts=sum(r.timed_out for r in rs))
            out.append(o)
        return out

    def apply(self, pending: list[tuple[Conversation, tuple]], outcomes: list[dict]) -> None:
        """Each conversation gets its answers as template-rendered delta ids, or ends (after its
        ``max_turns``-th turn: "max_turns")."""
        for (c, (kind, _)), o in zip(pending, outcomes):
            c.env_reward = c.env_reward if o["reward"] is None else float(o["reward"])
            c.tool_calls, c.tool_errors, c.tool_timeouts = (c.tool_calls + o["calls"], c.tool_errors + o["errors"],
                                                            c.tool_timeouts + o["timeouts"])
            if c.finish is not None:  # ended this turn (cut by a budget): only scored
                continue
            if o["new"] is None:
                c.finish = "env_done"
                continue
            if c.turns >= self.max_turns:
                c.finish = "max_turns"
                continue
            new = [self.clip(m) for m in o["new"]]
            delta = self.renderer.delta_ids(new, ended_with_eos=bool(c.response_ids)
                                            and c.response_ids[-1] == self.tokenizer.eos_token_id)
            if len(c.response_ids) + len(delta) >= self.max_total_tokens:
                c.finish = "length"  # no room left for another turn after the tool's answer
                continue
            c.messages += new
            c.response_ids += delta
            c.env_mask += [0] * len(delta)
            c.logprobs += [0.0] * len(delta)

    def clip(self, message: dict) -> dict:
        """A tool / environment message cut to max_tool_response_tokens tokens of content."""
        ids = self.tokenizer(str(message.get("content", "")), add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_tool_response_tokens:
            return message
        return {**message, "content": self.tokenizer.decode(ids[: self.max_tool_response_tokens]) + " ...(cut)"}


def conversation_metrics(convs: list[Conversation]) -> dict[str, float]:
    """This rank's sums (all-reduced by the caller): turns, calls, errors, timeouts, finish reasons."""
    out = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "malformed_calls": 0.0,
           "samples": float(len(convs))}
    for c in convs:
        out["turns"] += c.turns
        out["tool_calls"] += c.tool_calls
        out["tool_errors"] += c.tool_errors
        out["tool_timeouts"] += c.tool_timeouts
        out["malformed_calls"] += c.malformed
        out[f"finish_{c.finish}"] = out.get(f"finish_{c.finish}", 0.0) + 1
    return out
