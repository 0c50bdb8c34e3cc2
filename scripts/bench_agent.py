"""Benchmark: the agent endpoint (rollout.agent) against the built-in multi-turn loop on the tool demo's task.

    .venv/bin/python scripts/bench_agent.py [--calls 3] [--prompts 16] [--n 16] [--nproc 2]
                                            [--sizes 128x2x3,1024x8x64] [--variants process/continuous,...]

Generation seconds per trained sample (one conversation / one episode), on every rank at once as in
training, with the same model, prompts, tools and turns on both sides, for each model size in turn
(``HIDDENxLAYERSxTOKENS``: the model's hidden size and layers, a model turn's tokens; 128x2x3 is the
tool demo's):

  builtin    rollout.multi_turn with the tool demo's SecretEnv (configs/demo_tool_cpu.yaml: a model turn
             ends at its call token (stop_on), its EOS or after its tokens)
  endpoint   rollout.agent with the demo's agent (rlcore/demo/agent.py: the official openai client, the
             lookup tool, a reply ending at its call (a stop string), at most 3 turns, its history kept
             append-only) in each variant of rollout.agent.workers (process, thread) x
             rollout.agent.batching (continuous, turns)

The variants take turns call by call (builtin, then each endpoint variant, then builtin again, ...),
every call with its own seed, the same for all variants, so load drifting on a shared host hits them
alike. Besides the wall time, each call's CPU time per sample (all ranks' summed), split by where it
went: ``engine`` (the rank's main thread inside vLLM: generate calls or scheduler steps), ``loop``
(the rest of the main thread: the built-in loop's own work, or the endpoint's serving loop),
``endpoint`` (the rank's other threads: the HTTP server parsing, rendering and answering requests;
with thread workers the agents too) and ``agents`` (the agent worker processes and their zygote).
Prints each call, then per size the medians and each variant's ratio to builtin; the last line is a
JSON object with them (keys ``SIZE/SIDE_...``).
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
PARTS = ("engine", "loop", "endpoint", "agents")  # where a call's CPU time went (module docstring)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3, help="measured calls per side and size (after one warm-up call)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per call and rank")
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="128x2x3,1024x8x64",
                   help="model sizes, HIDDENxLAYERSxTOKENS (tokens per model turn); 128x2x3: the tool demo's")
    p.add_argument("--variants", default="process/continuous,process/turns", help="endpoint variants, workers/batching")
    p.add_argument("--timeout-s", type=float, default=3600)
    return p.parse_args(argv)


def sizes(spec: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in spec.split(",") if item]


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
    from rlcore.dist import init_distributed

    info = init_distributed("cpu", 1800)
    result: dict = {}
    for hidden, layers, tokens in sizes(args.sizes):
        result.update(_measure_size(args, info, hidden, layers, tokens))
    if info.rank == 0:
        bc.write_result(result)


def _measure_size(args: argparse.Namespace, info, hidden: int, layers: int, tokens: int) -> dict:
    """One model size: every side's calls, interleaved; its report lines; its part of the result."""
    from transformers import AutoTokenizer

    from rlcore import agent as agent_wing
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.dist import all_reduce_sum, barrier
    from rlcore.step.sampling import multi_turn_batch

    root, label = os.environ["BENCH_ROOT"], f"{hidden}x{layers}x{tokens}"
    model, data = os.path.join(root, f"tool_{hidden}x{layers}"), os.path.join(root, "data", "tool_train.jsonl")
    cfgs = configs(model, data, [v for v in args.variants.split(",") if v], tokens)
    tok = AutoTokenizer.from_pretrained(model)
    ro = ColocateRollout(model, info, tp_size=1, seed=0, kv_cache_gb=0.25, max_model_len=_context(tokens))
    agents = {name: agent_wing.build_agent(cfg, tok, ro) for name, cfg in cfgs.items()}
    engine = _time_engine(ro, agents)
    prompts = _prompts(data, args.prompts, tok)
    rows: dict[str, list[dict]] = {name: [] for name in agents}
    for call in range(args.calls + 1):
        for name, ag in agents.items():
            barrier()
            engine.update(s=0.0, cpu=0.0, calls=0)
            before = _cpu_now(ag)
            start = time.perf_counter()
            batch = multi_turn_batch(ag, ro, prompts, cfgs[name].rollout, seed=1000 + call)
            seconds = time.perf_counter() - start
            cpu = _cpu_split(before, _cpu_now(ag), engine["cpu"])
            turns = sum(c.turns for c in batch.conversations)
            total = all_reduce_sum([len(batch), turns, *(cpu[k] for k in PARTS)])
            row = {"ms": seconds / len(batch) * 1e3, "turns": total[1] / total[0],
                   **{k: v / total[0] * 1e3 for k, v in zip(PARTS, total[2:])}}
            bc.say(info.rank, f"{label} call {call}{' (warm-up)' if call == 0 else ''} {name:20s} {seconds:6.2f} s "
                              f"{row['ms']:7.2f} ms/sample  {row['turns']:.2f} turns/sample  engine {engine['s']:5.2f} "
                              f"s in {engine['calls']} calls  CPU ms/sample "
                              + " ".join(f"{k} {row[k]:.2f}" for k in PARTS))
            if call > 0:
                rows[name].append(row)
    for ag in agents.values():
        getattr(ag, "close", lambda: None)()
    ro.shutdown()
    return _report(info.rank, label, rows)


def _prompts(data: str, count: int, tok) -> list:
    from rlcore.task.prompts import Prompt

    rows = [json.loads(line) for line in open(data)][:count]
    return [Prompt(ids=tok(r["prompt"])["input_ids"], answer=r["answer"], text=r["prompt"], row=r) for r in rows]


def _time_engine(ro, agents: dict) -> dict:
    """Wall and main-thread CPU seconds inside the engine per call: the built-in loop's generate calls,
    the endpoint's scheduler steps (the rest of a call is the agents, the HTTP side, and waiting for them)."""
    totals = {"s": 0.0, "cpu": 0.0, "calls": 0}

    def timed(fn):
        def inner(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                totals["s"] += time.perf_counter() - start
                totals["cpu"] += time.thread_time() - cpu
                totals["calls"] += 1
        return inner

    ro.generate = timed(ro.generate)
    for ag in agents.values():
        steps = getattr(ag, "steps", None)
        if steps is not None:
            steps.step = timed(steps.step)
    return totals


def _cpu_now(agent) -> tuple[float, float, float]:
    """(this process's CPU, its main thread's, the agent worker processes' with their zygote) in seconds."""
    runner = getattr(agent, "runner", None)
    proc = getattr(runner, "proc", None)  # rlcore.agent.workers.ProcessRunner's zygote
    return time.process_time(), time.thread_time(), bc.process_tree_cpu_s(proc.pid) if proc is not None else 0.0


def _cpu_split(before: tuple, after: tuple, engine_cpu: float) -> dict[str, float]:
    process, main, agents = (b - a for a, b in zip(before, after))
    return {"engine": engine_cpu, "loop": main - engine_cpu, "endpoint": process - main, "agents": agents}


def _report(rank: int, label: str, rows: dict[str, list[dict]]) -> dict:
    med = {name: {k: bc.median([r[k] for r in rs]) for k in rs[0]} for name, rs in rows.items()}
    base = med["builtin"]["ms"]
    bc.say(rank, f"{label}: {'side':20s} {'ms/sample':>10s} {'ratio':>6s} {'turns':>6s}   CPU ms/sample: "
                 + " ".join(f"{k:>8s}" for k in (*PARTS, "total")))
    result = {}
    for name, m in med.items():
        cpu_total = sum(m[k] for k in PARTS)
        bc.say(rank, f"{label}: {name:20s} {m['ms']:10.2f} {m['ms'] / base:6.2f} {m['turns']:6.2f}                  "
                     + " ".join(f"{m[k]:8.2f}" for k in PARTS) + f" {cpu_total:8.2f}")
        result.update({f"{label}/{name}_ms_per_sample": m["ms"], f"{label}/{name}_cpu_ms_per_sample": cpu_total,
                       **{f"{label}/{name}_cpu_{k}_ms": m[k] for k in PARTS}})
        if name != "builtin":
            result[f"{label}/{name}_ratio"] = m["ms"] / base
    return result


def main(argv: list[str]) -> None:
    if bc.under_torchrun():
        bc.run_or_relaunch(__file__, argv, parse_args, worker)
        return
    args = parse_args(argv)
    from rlcore.demo.tool import make_tool_data

    made = "BENCH_ROOT" not in os.environ  # a folder of its own: removed at the end
    root = os.environ.setdefault("BENCH_ROOT", tempfile.mkdtemp(prefix="bench_agent_"))
    try:
        for hidden, layers, _ in sizes(args.sizes):
            make_model(root, hidden, layers)
        make_tool_data(os.path.join(root, "data"), n_train=max(args.prompts, 64), n_val=8)
        result = bc.run_or_relaunch(__file__, argv, parse_args, worker)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
