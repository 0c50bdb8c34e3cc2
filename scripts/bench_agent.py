"""Benchmark: the agent endpoint (rollout.agent) against the built-in multi-turn loop on the tool demo's task.

    .venv/bin/python scripts/bench_agent.py [--calls 5] [--prompts 16] [--n 16] [--nproc 2] [--hidden 128]

Generation seconds per trained sample (one conversation / one episode), on every rank at once as in
training, with the same model, prompts, tools and turns on both sides:

  builtin    rollout.multi_turn with the tool demo's SecretEnv (configs/demo_tool_cpu.yaml: a model turn
             ends at its call token (stop_on), its EOS or after its tokens)
  endpoint   rollout.agent with the demo's agent (rlcore/demo/agent.py: the official openai client, the
             lookup tool, a reply ending at its call (a stop string), at most 3 turns, its history kept
             append-only) in each variant of rollout.agent.workers (process, thread) x
             rollout.agent.batching (continuous, turns)

The variants take turns call by call (builtin, then each endpoint variant, then builtin again, ...),
every call with its own seed, the same for all variants, so load drifting on a shared host hits them
alike. Prints each call, then the medians per sample and each variant's ratio to builtin; the last
line is a JSON object with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

VARIANTS = ("process/continuous", "process/turns", "thread/continuous", "thread/turns")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5, help="measured calls per variant (after one warm-up call each)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per call and rank")
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128, help="the model's hidden size (128: the tool demo's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=3, help="tokens per model turn (3: the tool demo's)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="endpoint variants, workers/batching")
    p.add_argument("--timeout-s", type=float, default=3600)
    return p.parse_args(argv)


def make_model(root: str, hidden: int, layers: int) -> str:
    from rlcore.demo.tool import VOCAB, make_tool_tokenizer
    from rlcore.demo.toy import make_tiny_model

    out = os.path.join(root, f"tool_{hidden}x{layers}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        make_tiny_model(out, seed=0, vocab_size=len(VOCAB), hidden_size=hidden, num_layers=layers,
                        intermediate_size=2 * hidden)
        make_tool_tokenizer(out)
    return out


def configs(model: str, data: str, variants: list[str], max_tokens: int) -> dict:
    """name -> the trainer's config of that side (parsed as a run's would be)."""
    from rlcore.config.cli import parse_config

    common = ["--model.path", model, "--data.train_files", f'["{data}"]', "--data.val_files", f'["{data}"]',
              "--trainer.output_dir", os.path.join(os.path.dirname(data), "out"), "--parallel.device", "cpu",
              "--rollout.max_response_length", str(max_tokens), "--rollout.max_model_len", str(_context(max_tokens))]
    out = {"builtin": parse_config(["--config", "configs/demo_tool_cpu.yaml", *common,
                                    "--rollout.multi_turn.max_total_tokens", str(3 * (max_tokens + 8))])}
    for v in variants:
        workers, batching = v.split("/")
        out[v] = parse_config(["--config", "configs/demo_agent_cpu.yaml", *common,
                               "--rollout.agent.kwargs", '{"compact_every": 0, "max_turns": 3, "call_bonus": 0.2}',
                               "--rollout.agent.workers", workers, "--rollout.agent.batching", batching])
    return out


def _context(max_tokens: int) -> int:
    """The context both sides need for 3 turns of ``max_tokens``: the prompt, the turns, the tool answers."""
    return 64 if max_tokens <= 3 else 32 * -(-(16 + 3 * (max_tokens + 8)) // 32)


def worker(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from rlcore import agent as agent_wing
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.dist import barrier, init_distributed
    from rlcore.step.sampling import multi_turn_batch

    info = init_distributed("cpu", 1800)
    root = os.environ["BENCH_ROOT"]
    model, data = os.path.join(root, f"tool_{args.hidden}x{args.layers}"), os.path.join(root, "data", "tool_train.jsonl")
    variants = [v for v in args.variants.split(",") if v]
    cfgs = configs(model, data, variants, args.max_tokens)
    tok = AutoTokenizer.from_pretrained(model)
    ro = ColocateRollout(model, info, tp_size=1, seed=0, kv_cache_gb=0.25, max_model_len=_context(args.max_tokens))
    agents = {name: agent_wing.build_agent(cfg, tok, ro) for name, cfg in cfgs.items()}
    engine = _time_engine(ro, agents)
    prompts = _prompts(data, args.prompts, tok)
    times: dict[str, list[float]] = {name: [] for name in agents}
    turns: dict[str, list[float]] = {name: [] for name in agents}
    in_engine: dict[str, list[float]] = {name: [] for name in agents}
    for call in range(args.calls + 1):
        for name, ag in agents.items():
            barrier()
            engine.update(s=0.0, calls=0)
            start = time.perf_counter()
            batch = multi_turn_batch(ag, ro, prompts, cfgs[name].rollout, seed=1000 + call)
            seconds = time.perf_counter() - start
            barrier()
            per = seconds / len(batch)
            mean_turns = sum(c.turns for c in batch.conversations) / len(batch)
            bc.say(info.rank, f"call {call}{' (warm-up)' if call == 0 else ''} {name:20s} {seconds:6.2f} s "
                              f"{per * 1e3:7.2f} ms/sample  {mean_turns:.2f} model turns/sample  engine "
                              f"{engine['s']:5.2f} s in {engine['calls']} calls")
            if call > 0:
                times[name].append(per)
                turns[name].append(mean_turns)
                in_engine[name].append(engine["s"] / len(batch))
    for ag in agents.values():
        getattr(ag, "close", lambda: None)()
    _report(info.rank, times, turns, in_engine)


def _prompts(data: str, count: int, tok) -> list:
    from rlcore.task.prompts import Prompt

    rows = [json.loads(line) for line in open(data)][:count]
    return [Prompt(ids=tok(r["prompt"])["input_ids"], answer=r["answer"], text=r["prompt"], row=r) for r in rows]


def _time_engine(ro, agents: dict) -> dict:
    """Seconds inside the engine per call: the built-in loop's generate calls, the endpoint's scheduler
    steps (the rest of a call is the agents, the HTTP side, and waiting for them)."""
    totals = {"s": 0.0, "calls": 0}

    def timed(fn):
        def inner(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals["s"] += time.perf_counter() - start
                totals["calls"] += 1
        return inner

    ro.generate = timed(ro.generate)
    for ag in agents.values():
        steps = getattr(ag, "steps", None)
        if steps is not None:
            steps.step = timed(steps.step)
    return totals


def _report(rank: int, times: dict, turns: dict, in_engine: dict) -> None:
    base = bc.median(times["builtin"])
    result = {"builtin_ms_per_sample": base * 1e3}
    bc.say(rank, f"{'side':20s} {'ms/sample':>10s} {'ratio':>6s} {'turns':>6s} {'engine ms/sample':>17s}")
    for name, xs in times.items():
        m = bc.median(xs)
        bc.say(rank, f"{name:20s} {m * 1e3:10.2f} {m / base:6.2f} {bc.median(turns[name]):6.2f} "
                     f"{bc.median(in_engine[name]) * 1e3:17.2f}")
        if name != "builtin":
            result[f"{name}_ms_per_sample"] = m * 1e3
            result[f"{name}_ratio"] = m / base
    if rank == 0:
        bc.write_result(result)


def main(argv: list[str]) -> None:
    if bc.under_torchrun():
        bc.run_or_relaunch(__file__, argv, parse_args, worker)
        return
    args = parse_args(argv)
    from rlcore.demo.tool import make_tool_data

    made = "BENCH_ROOT" not in os.environ  # a folder of its own: removed at the end
    root = os.environ.setdefault("BENCH_ROOT", tempfile.mkdtemp(prefix="bench_agent_"))
    try:
        make_model(root, args.hidden, args.layers)
        make_tool_data(os.path.join(root, "data"), n_train=max(args.prompts, 64), n_val=8)
        result = bc.run_or_relaunch(__file__, argv, parse_args, worker)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
