"""Worker (torchrun, 1 rank, or 2 ranks sharing one tensor-parallel engine): partial rollouts
(rlcore.step.partial) on the real vLLM engine over 4 steps, with new weights pushed into the engine between steps (the tiny model's, perturbed: what a sync
does). Three token ids stop a sequence (stop_token_ids), so lengths spread and the early stop suspends
some groups. Dynamic sampling is on: a sample's reward is its length's parity, so a group whose
samples' lengths have one parity is filtered when it finishes. Every generate call is recorded; for each trained sequence the pytest side's check runs
here: its ids and log-probs are the concatenation of what vLLM returned for it, call by call. Each
rank writes OUT.json.rank<R> (a TP group's ranks must suspend and train the same sequences).

Then (with CHATML_MODEL) multi-turn: conversations with the calculator tool on a second engine of
the same TP layout, chunks of 2 tokens: a turn spans chunks and steps, and tool answers come between
them (the TP leader runs the tools, the other rank takes its answers). Written as OUT.json.agent.rank<R>.

    torchrun --nproc_per_node=TP tests/workers/partial_worker.py MODEL OUT.json [TP [CHATML_MODEL]]
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import io
import json
import os
import sys
import types

import torch

from rlcore.dist import init_distributed

STOP = [3, 5, 7]


def main() -> None:
    model_dir, out_path = sys.argv[1:3]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    info = init_distributed("cpu", 300)
    from safetensors.torch import load_file

    from rlcore.config import PartialConfig, RolloutConfig
    from rlcore.metrics import Timer
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.step.partial import PartialRollouts
    from rlcore.task.prompts import Prompt

    rollout = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=64)
    calls = []
    generate = rollout.generate

    def spy(prompts, **kw):  # vLLM itself, with three stop tokens; every call recorded
        out = generate(prompts, stop_token_ids=STOP, **kw)
        calls.append([(list(p), list(s[0].response_ids), list(s[0].logprobs)) for p, s in zip(prompts, out)])
        return out

    rollout.generate = spy
    queue = [Prompt(ids=[10 + i % 7, 11, 12 + i % 5], text="", answer="", row={"i": i}) for i in range(64)]
    cfg = RolloutConfig(n=2, max_response_length=16, max_model_len=64)
    sampler = types.SimpleNamespace(per_replica=lambda: 3, cfg=cfg, switch=None, timer=Timer(), seed=0, rollout=rollout)
    sampler.next_prompts = lambda k: [queue.pop(0) for _ in range(k)]
    sampler.count_decode = lambda lengths: None
    sampler.score = lambda b, collective=True: (torch.tensor([float(len(r) % 2) for r in b.response_ids]), {})
    part = PartialRollouts(PartialConfig(enable=True, chunk_tokens=3, oversample=2.0, max_staleness=3), 2, 16,
                           dynamic=True, max_rounds=3)
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    trained, metrics, kept = [], [], []
    for step in range(1, 5):
        batch, m = part.sample(sampler, step)
        trained += list(zip(batch.prompt_ids, batch.response_ids, batch.rollout_logp, batch.staleness))
        kept += [len(batch.response_ids[i]) % 2 != len(batch.response_ids[i + 1]) % 2
                 for i in range(0, len(batch), 2) if batch.keep[i]]  # each kept group informative
        metrics.append(m)
        g = torch.Generator().manual_seed(step)
        rollout.update_weights(((k, v + 0.02 * torch.randn(v.shape, generator=g)) for k, v in base.items()), full=True)
    mismatched = []
    for prompt, ids, logp, _ in trained:
        got_ids, got_lp = [], []
        for call in calls:  # in order: the call that continued this sequence from where it stood
            for p, r, lp in call:
                room = len(ids) - len(got_ids)
                if r and p == prompt + got_ids and r[:room] == ids[len(got_ids):len(got_ids) + len(r)]:
                    got_ids, got_lp = got_ids + r[:room], got_lp + lp[:room]
                    break
        if got_ids != ids or got_lp != logp:
            mismatched.append({"prompt": prompt, "ids": ids, "returned": got_ids})
    with open(f"{out_path}.rank{info.rank}", "w") as f:
        json.dump({"trained": len(trained), "mismatched": mismatched, "metrics": metrics, "kept_informative": kept,
                   "trained_ids": [[p, ids] for p, ids, *_ in trained], "pool_left": len(part.pool),
                   "resumed_samples": sum(any(s > 0 for s in st) for *_, st in trained),
                   "max_staleness_seen": max((max(st, default=0) for *_, st in trained), default=0)}, f)
    rollout.shutdown()
    if len(sys.argv) > 4:
        agent_phase(info, sys.argv[4], f"{out_path}.agent.rank{info.rank}", tp)


# The first turn opens a calculator call that the random model cannot close: a malformed call, whose
# error message is the tool answer, then a second turn.
PREFIX = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'


def agent_phase(info, model_dir: str, out_path: str, tp: int) -> None:
    from transformers import AutoTokenizer

    from rlcore.agent import tp_share
    from rlcore.agent.chat import ChatRenderer, ToolCallParser
    from rlcore.agent.loop import Agent
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import ToolRunner, load_tools
    from rlcore.config import PartialConfig, RolloutConfig
    from rlcore.metrics import Timer
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.step.partial import PartialRollouts
    from rlcore.task.prompts import Prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=1024)
    calls, generate = [], rollout.generate

    def spy(prompts, **kw):
        out = generate(prompts, **kw)
        calls.append([(list(p), list(s[0].response_ids), list(s[0].logprobs)) for p, s in zip(prompts, out)])
        return out

    rollout.generate = spy
    tools = load_tools(["calculator"], None)
    schemas = [t.schema for t in tools.values()]
    renderer = ChatRenderer(tok, schemas, first_turn_prefix=PREFIX)
    agent = Agent(tok, renderer, ToolCallParser("hermes", tok, schemas), ToolRunner(tools, Limits(), 2), max_turns=3,
                  max_total_tokens=160, max_tool_response_tokens=12, stop_token_ids=list(range(10, len(tok), 3)),
                  leader=rollout.tp_rank == 0, share=tp_share(tp, rollout.tp_rank, rollout.dp_rank))
    queue = [Prompt(ids=renderer.prompt_ids([{"role": "user", "content": f"What is {a} + 7 ?"}]), text="",
                    answer=str(a + 7), row={"i": a}) for a in range(64)]
    cfg = RolloutConfig(n=2, max_response_length=6, max_model_len=1024)
    sampler = types.SimpleNamespace(per_replica=lambda: 2, cfg=cfg, switch=None, timer=Timer(), seed=0, rollout=rollout,
                                    count_decode=lambda lengths: None)
    sampler.next_prompts = lambda k: [queue.pop(0) for _ in range(k)]
    part = PartialRollouts(PartialConfig(enable=True, chunk_tokens=2, oversample=2.0, max_staleness=3), 2, 6,
                           agent=agent)
    trained, state = [], None
    for step in range(1, 5):
        batch, _ = part.sample(sampler, step)
        trained += [{"prompt_ids": c.prompt_ids, "response_ids": c.response_ids, "env_mask": c.env_mask,
                     "logprobs": c.logprobs, "versions": c.versions, "turns": c.turns, "finish": c.finish,
                     "staleness": st} for c, st in zip(batch.conversations, batch.staleness)]
        if step == 2:
            state = part.state_dict()  # a checkpoint's copy of the pool: it must round-trip exactly
            buf = io.BytesIO()
            torch.save(state, buf)  # as the checkpoint writes it, and loads it (weights_only)
            buf.seek(0)
            again = PartialRollouts(part.cfg, 2, 6, agent=agent)
            again.load_state_dict(torch.load(buf, weights_only=True))
            state = again.state_dict() == state and len(state) > 0
    with open(out_path, "w") as f:
        json.dump({"calls": calls, "trained": trained, "state_round_trip": state, "pool_left": len(part.pool)}, f)
    agent.runner.shutdown()
    rollout.shutdown(exiting=True)  # the worker ends next, as a run's teardown


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
