"""torchrun worker (1 rank) for tests/test_agent.py: multi-turn conversations on the real vLLM engine.

usage: agent_worker.py OUT_JSON KIND=MODEL_DIR ...     KIND: tiny (word-level template, SecretEnv:
the model's own hermes calls) | qwen3 (Qwen3's template, an environment that answers every turn
with two tool messages). One engine per kind, built and shut down in turn in one launch.

Every ``generate`` call is recorded on its way through (the engine is the real one); the pytest
side checks that each conversation is exactly prompt ids + the ids vLLM returned + template deltas.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_common import hf_logprobs, load_hf, run_kinds  # noqa: E402

from rlcore.agent.chat import ChatRenderer, ToolCallParser  # noqa: E402
from rlcore.agent.loop import Agent  # noqa: E402
from rlcore.agent.sandbox import Limits  # noqa: E402
from rlcore.agent.tools import ToolRunner, load_tools  # noqa: E402
from rlcore.demo.tool import CALL, SecretEnv  # noqa: E402
from rlcore.colocate_rollout import ColocateRollout  # noqa: E402


class TwoToolEnv:
    """Answers each model turn with two tool messages (numbers), done after the third turn."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        self.turn += 1
        if self.turn >= 3:
            return [], 1.0, True
        return [{"role": "tool", "content": str(40 + self.turn)}, {"role": "tool", "content": "7 * 3 = 21"}], None, False


class Recorder:
    """Passes every call to the real engine and keeps (prompts, outputs)."""

    def __init__(self, rollout):
        self.rollout, self.calls = rollout, []

    def generate(self, prompts, **kw):
        out = self.rollout.generate(prompts, **kw)
        self.calls.append({"prompts": [list(p) for p in prompts],
                           "outputs": [[(list(s.response_ids), list(s.logprobs), s.finish_reason) for s in g] for g in out]})
        return out


def run_kind(info, kind: str, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ro = ColocateRollout(model_dir, info, tp_size=1, seed=0, kv_cache_gb=0.0625,
                         max_model_len=1024 if kind == "qwen3" else 256)
    if kind == "tiny":
        env, tools, schemas, per_turn, stop = SecretEnv, [], SecretEnv.tool_schemas, 3, [tok.convert_tokens_to_ids(CALL)]
        prompts, n = [{"prompt": "secret ?", "answer": str(d)} for d in range(8)], 8
    else:
        # A random model rarely ends a turn by itself: a third of the vocabulary also ends one.
        env, tools, per_turn, stop = TwoToolEnv, ["calculator"], 6, list(range(10, len(tok), 3))
        schemas = [t.schema for t in load_tools(tools, None).values()]
        prompts, n = [{"prompt": f"What is {a} + 7 ?", "answer": str(a + 7)} for a in range(3)], 2
    renderer = ChatRenderer(tok, schemas)
    agent = Agent(tok, renderer, ToolCallParser("hermes", tok, schemas), ToolRunner(load_tools(tools, None), Limits(), 4),
                  max_turns=3, max_total_tokens=200, max_tool_response_tokens=16, env_factory=env, stop_token_ids=stop)
    rec = Recorder(ro)
    groups = agent.run(rec, [renderer.prompt_ids([{"role": "user", "content": p["prompt"]}]) for p in prompts],
                       prompts, n=n, seed=11, sampling={"temperature": 1.0}, per_turn_tokens=per_turn)
    again = agent.run(ro, [renderer.prompt_ids([{"role": "user", "content": p["prompt"]}]) for p in prompts],
                      prompts, n=n, seed=11, sampling={"temperature": 1.0}, per_turn_tokens=per_turn)
    hf = load_hf(model_dir)
    convs, worst = [], 0.0
    for g in groups:
        for c in g:
            model_pos = [i for i, m in enumerate(c.env_mask) if m]
            if model_pos:
                ref = hf_logprobs(hf, c.prompt_ids, c.response_ids, 1.0)
                worst = max(worst, (ref[model_pos] - torch.tensor(c.logprobs)[model_pos]).abs().max().item())
            tool_msgs = [m for m in c.messages if m["role"] == "tool"]
            convs.append({"prompt_ids": c.prompt_ids, "response_ids": c.response_ids, "env_mask": c.env_mask,
                          "logprobs": c.logprobs, "turns": c.turns, "tool_calls": c.tool_calls, "finish": c.finish,
                          "env_reward": c.env_reward, "tool_messages": [m["content"] for m in tool_msgs],
                          "messages": c.messages})
    result = {
        "calls": rec.calls, "conversations": convs, "hf_vs_vllm_max": worst, "turn_end": renderer.turn_end,
        "eos": tok.eos_token_id,
        "deltas": {json.dumps(m): renderer.delta_ids(m, True) for m in _distinct_tool_turns(groups)},
        "deltas_no_eos": {json.dumps(m): renderer.delta_ids(m, False) for m in _distinct_tool_turns(groups)},
        "repeat_equal": [c.response_ids for g in groups for c in g] == [c.response_ids for g in again for c in g],
    }
    agent.runner.shutdown()
    ro.shutdown()
    return result


def _distinct_tool_turns(groups) -> list[list[dict]]:
    """Each run of consecutive tool messages in the conversations (one delta each)."""
    seen = []
    for g in groups:
        for c in g:
            run = []
            for m in c.messages + [{"role": "end"}]:
                if m["role"] == "tool":
                    run.append({"role": "tool", "content": m["content"]})
                elif run:
                    if run not in seen:
                        seen.append(run)
                    run = []
    return seen


if __name__ == "__main__":
    run_kinds(run_kind, sys.argv[1:])
