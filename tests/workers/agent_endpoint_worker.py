"""torchrun worker (1 rank) for tests/test_agent_endpoint.py: black-box agents (tests/workers/agents.py,
the official openai client in their own processes) against the rank's endpoint on the real vLLM engine.

usage: agent_endpoint_worker.py OUT_JSON KIND=MODEL_DIR ...     KIND: tiny (the tool demo's word-level
model and template) | qwen3 (Qwen3's template and a byte-level BPE tokenizer). Per kind, one engine:

  exact     append, compact, strip and text agents (continuous batching), and on qwen3 the required and
            named agents (tool_choice: a grammar; their samples scored again): every engine request and
            completion is recorded on its way through (a scored one with the engine's masked log-probs
            kept beside the score's), every response's content; per segment the teacher-forced
            log-probs of a transformers forward of the same weights
  failures  raise, hang (past a 15 s limit), crash, malformed, wrong_key, outside, beside two append
            agents, then the exact call's append agents again (the rank goes on)
  turns     the exact call's agents twice with turns batching: the same seeds give the same episodes
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_common import hf_logprobs, load_hf, run_kinds  # noqa: E402

from rlcore.agent.config import AgentConfig  # noqa: E402
from rlcore.agent.openai_api import OpenAIService  # noqa: E402
from rlcore.agent.serve import EndpointAgent  # noqa: E402
from rlcore.agent.workers import make_runner  # noqa: E402
from rlcore.colocate_rollout import ColocateRollout  # noqa: E402

ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agents.py") + ":run"
NORMAL = ["append", "compact", "strip", "text"]
FORCED = ["required", "named"]  # byte-level BPE only: the tool demo's words cannot spell a hermes call
FAILING = ["raise", "hang", "crash", "malformed", "wrong_key", "outside"]


class Recorder:
    """Wraps the engine steps and the service: every request, completion and response content."""

    def __init__(self, agent: EndpointAgent):
        self.requests, self.completions, self.contents = {}, [], []
        steps, service = agent.steps, agent.service
        submit, score, step, chat, text = steps.submit, steps.score, steps.step, service.chat_response, service.text_response
        scores: set[str] = set()

        def rec_submit(ids, **kw):
            rid = submit(ids, **kw)
            self.requests[rid] = list(ids)
            return rid

        def rec_score(ids, start):
            rid = score(ids, start)
            self.requests[rid] = list(ids)
            scores.add(rid)
            return rid

        def rec_step():
            done = step()
            for f in done:
                prompt = self.requests[f.request_id]
                if f.request_id in scores:  # the policy's log-probs of a sample drawn under a grammar
                    c = next(c for c in self.completions if c["prompt"] + c["ids"] == prompt and "masked" not in c)
                    assert c["ids"] == f.token_ids
                    c["masked"], c["logprobs"] = c["logprobs"], f.logprobs
                    continue
                self.completions.append({"prompt": prompt, "ids": f.token_ids, "logprobs": f.logprobs,
                                         "finish": f.finish_reason})
            return done

        def rec_response(fn):
            def inner(job):
                out = fn(job)
                choice = out["choices"][0]
                content = choice["message"]["content"] if "message" in choice else choice["text"]
                self.contents.append({"episode": job.episode.index, "content": content, "ids": job.sample[0]})
                return out
            return inner

        steps.submit, steps.score, steps.step = rec_submit, rec_score, rec_step
        service.chat_response, service.text_response = rec_response(chat), rec_response(text)

    def take(self) -> dict:
        out = {"completions": self.completions, "contents": self.contents}
        self.completions, self.contents = [], []
        return out


def make_agent(ro, tok, kind: str, batching: str, timeout_s: float) -> EndpointAgent:
    cfg = AgentConfig(entry=ENTRY, workers="process", timeout_s=timeout_s, batching=batching, max_failure_frac=1.0)
    service = OpenAIService(tok, tool_parser="hermes", reasoning_parser="qwen3" if kind == "qwen3" else None,
                            chat_template=None, model_name="policy", max_model_len=ro_len(kind), max_tokens=160,
                            sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    return EndpointAgent(cfg, service, ro, runner_factory=lambda wake: make_runner("process", ENTRY, {}, wake))


def ro_len(kind: str) -> int:
    return 1024 if kind == "qwen3" else 512


def call(agent, modes: list[str], seed: int, max_tokens: int) -> list[dict]:
    rows = [{"mode": m, "prompt": "secret ?" if m != "text" else "user secret", "max_tokens": max_tokens,
             "forced_tokens": 160} for m in modes]
    groups = agent.run(agent.steps.rollout, [[1]] * len(rows), rows, n=2, seed=seed,
                       sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1}, per_turn_tokens=160)
    return [{"mode": m, **ep.plain()} for m, g in zip(modes, groups) for ep in g]


def teacher_forced(model, episodes: list[dict]) -> list[list[float]]:
    """Per episode, per segment: max |recorded - transformers| log-prob over its sampled tokens."""
    out = []
    for ep in episodes:
        diffs = []
        for s in ep["segments"]:
            ref = hf_logprobs(model, s["prompt_ids"], s["response_ids"], 1.0)
            mask = torch.tensor(s["env_mask"], dtype=torch.bool)
            diffs.append((ref[mask] - torch.tensor(s["logprobs"])[mask]).abs().max().item() if mask.any() else 0.0)
        out.append(diffs)
    return out


def run_kind(info, kind: str, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ro = ColocateRollout(model_dir, info, tp_size=1, seed=0, kv_cache_gb=0.0625, max_model_len=ro_len(kind))
    max_tokens = 8 if kind == "qwen3" else 24
    result = {"eos": tok.eos_token_id}
    agent = make_agent(ro, tok, kind, "continuous", 60.0)
    rec = Recorder(agent)
    exact = NORMAL + (FORCED if kind == "qwen3" else [])
    result["exact"] = {"episodes": call(agent, exact, 1, max_tokens), **rec.take(), "metrics": agent.last_metrics}
    agent.cfg.timeout_s = 15.0
    result["failures"] = {"episodes": call(agent, FAILING + ["append"], 2, max_tokens), "metrics": agent.last_metrics}
    rec.take()
    result["after"] = {"episodes": call(agent, NORMAL, 1, max_tokens), **rec.take(), "metrics": agent.last_metrics}
    agent.close()
    turns = make_agent(ro, tok, kind, "turns", 60.0)
    result["turns"] = [call(turns, NORMAL, 3, max_tokens) for _ in range(2)]
    turns.close()
    ro.shutdown()
    model = load_hf(model_dir)
    result["exact"]["teacher_diff"] = teacher_forced(model, result["exact"]["episodes"])
    result["after"]["teacher_diff"] = teacher_forced(model, result["after"]["episodes"])
    return result


if __name__ == "__main__":
    run_kinds(run_kind, sys.argv[1:])
