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
        self.stats = {"generate_s": [], "tool_s": 0.0}
        for turn in range(self.max_turns):
            active = [c for c in flat if c.finish is None]
            if not active:
                break
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
            pending = [self.take_turn(c, s) for c, s in zip(active, outs)]
            self.answer_calls([(c, p) for c, p in zip(active, pending) if p is not None], last=turn + 1 == self.max_turns)
        for c in flat:
            c.finish = c.finish or "max_turns"
        return groups

    def take_turn(self, c: Conversation, sample) -> list | None:
        """Append the turn's sampled ids; return its calls (or the environment's messages), or None
        when the conversation ended here."""
        budget = self.max_total_tokens - len(c.response_ids)
        ids, logp = list(sample.response_ids[:budget]), list(sample.logprobs[:budget])
        c.last_turn = (len(c.response_ids), len(c.response_ids) + len(ids))
        c.response_ids += ids
        c.env_mask += [1] * len(ids)
        c.logprobs += logp
        c.turns += 1
        prefix = self.renderer.first_turn_prefix if c.turns == 1 else ""  # the first turn continues it
        parsed = self.parser.parse(prefix + self.turn_text(ids))
        c.messages.append({"role": "assistant", "content": parsed.content,
                           **({"tool_calls": [{"type": "function", "function": {"name": nm, "arguments": a}}
                                              for nm, a in parsed.calls]} if parsed.calls else {})})
        if sample.finish_reason == "length" or len(ids) < len(sample.response_ids):
            c.finish = "length"  # cut: no call of it runs; an environment still scores the conversation
            if c.env is not None:
                reward = c.env.step(list(c.messages))[1]
                c.env_reward = c.env_reward if reward is None else float(reward)
            return None
        if c.env is not None:
            return [("env", parsed)]
        if parsed.malformed:
            c.malformed += 1
            return [("malformed", None)]
        if not parsed.calls:
            c.finish = "stop"
            return None
        return parsed.calls

    def turn_text(self, ids: list[int]) -> str:
        """A turn's text for the parser: special tokens kept (some templates' call markers are
        special), the closing end-of-turn token dropped."""
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)

    def answer_calls(self, pending: list[tuple[Conversation, list]], last: bool) -> None:
        """Run every call of the turn together, then give each conversation its new messages."""
        calls = [(name, args) for _, items in pending for name, args in items if name not in ("env", "malformed")]
        start = time.perf_counter()
        results = iter(self.runner.run(calls)) if calls else iter(())
        for c, items in pending:
            new = self.respond(c, items, results)
            if new is None:
                continue
            if last:
                c.finish = "max_turns"
                continue
            delta = self.renderer.delta_ids(new, ended_with_eos=bool(c.response_ids)
                                            and c.response_ids[-1] == self.tokenizer.eos_token_id)
            if len(c.response_ids) + len(delta) >= self.max_total_tokens:
                c.finish = "length"  # no room left for another turn after the tool's answer
                continue
            c.messages += new
            c.response_ids += delta
            c.env_mask += [0] * len(delta)
            c.logprobs += [0.0] * len(delta)
        self.stats["tool_s"] += time.perf_counter() - start

    def respond(self, c: Conversation, items: list, results) -> list[dict] | None:
        """This conversation's new messages (None: it ended)."""
        if items[0][0] == "env":
            new, reward, done = c.env.step(list(c.messages))
            c.env_reward = c.env_reward if reward is None else float(reward)
            c.tool_calls += len(items[0][1].calls)
            if done:
                c.finish = "env_done"
                return None
            return [self.clip(m) for m in new]
        if items[0][0] == "malformed":
            c.tool_errors += 1
            return [self.clip({"role": "tool", "content": "Error: the tool call could not be parsed; write it "
                               "in the format the system prompt shows"})]
        out = []
        for _ in items:
            r: CallResult = next(results)
            c.tool_calls += 1
            c.tool_errors += r.error is not None
            c.tool_timeouts += r.timed_out
            out.append(self.clip({"role": "tool", "content": r.content}))
        return out

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
