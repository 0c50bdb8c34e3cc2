"""Benchmark: where a GRPO step's time goes, on 2 CPU ranks, through the real trainer loop.

    .venv/bin/python scripts/bench_step.py [--steps 6] [--warmup 2] [--response-len 32]
    .venv/bin/python scripts/bench_step.py --moe --variant base="--algorithm.mini_batches 2" \
        --variant r2="--algorithm.mini_batches 2 --algorithm.routing_replay r2" ...

``--variant NAME=OVERRIDES`` (repeatable) runs the benchmark once per variant, one after the other,
with those trainer overrides, and prints each one's step and train time and its ratio to the first
variant's: how replay and each rollout-correction mode cost (``--moe``: a small Qwen3-MoE, EP over
the ranks, for routing replay).

Starts its own ranks (torchrun) and runs ``train_grpo.main`` unchanged on a small random Qwen3
and the toy task, instrumented from outside: the metrics logger notes when each step's row is
written (step time = the interval between two rows: the whole loop body, logging included),
and each trainer generate call is paired with a bare ``vllm.LLM.generate`` on the same engine,
at the same weights, with the same prompts and SamplingParams (its time is taken out of the
trainer's figures; the sampled tokens must come out identical).

Prints the phase breakdown (medians over the steps after ``--warmup``), memory after each phase,
and as the last line a JSON object with ``overhead_ratio`` = step time / (generate + train +
weight sync) (``overhead_ratio_total``: the same over the measured steps together, where a cost
paid every k-th step counts at its share; the last step, which writes the final checkpoint, left out) and ``rollout_efficiency`` = the trainer's generation tokens/s / the bare vLLM
call's, both medians over the measured steps (see ``summarize`` for the exact definitions).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768)
MOE_MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8,
                 moe_intermediate_size=256)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--moe", action="store_true", help="a small Qwen3-MoE (8 experts, top-2), EP = ranks")
    p.add_argument("--extra", default="", help="trainer overrides, one string (e.g. '--algorithm.ppo_epochs 2')")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="compare variants: one run each, with these trainer overrides")
    args = p.parse_args(argv)
    if any("=" not in v for v in args.variant):
        p.error("--variant takes NAME=OVERRIDES, e.g. r2='--algorithm.routing_replay r2'")
    if min(args.steps, args.response_len, args.prompts_per_step, args.n, args.nproc) < 1 or args.warmup < 1:
        p.error("every count must be >= 1 (--warmup too: the first step compiles)")
    return args


# ----------------------------------------------------------------------------- instrumentation


class Recorder:
    """What the benchmark notes from outside the trainer (per rank)."""

    def __init__(self):
        # (time the row was logged, process CPU time then, step, metrics, CPU s per timer name)
        self.rows: list[tuple[float, float, int, dict, dict]] = []
        self.gen_calls: list[dict] = []  # one per rollout.generate call
        self.run = None


def instrument(rec: Recorder) -> None:
    """Wrap the trainer's logger, build() (module attributes of train_grpo) and timer."""
    import train_grpo

    base_logger, base_build = train_grpo.MetricsLogger, train_grpo.build

    class TimedLogger(base_logger):
        def log(self, step, metrics):
            cpu, rec.run.timer.cpu = rec.run.timer.cpu, {}
            rec.rows.append((time.perf_counter(), time.process_time(), step, dict(metrics), cpu))
            super().log(step, metrics)

    def build(*args):
        run = base_build(*args)
        bc.cpu_timed(run.timer)
        wrap_generate(run.engines.rollout, rec)
        rec.run = run
        return run

    train_grpo.MetricsLogger, train_grpo.build = TimedLogger, build


def wrap_generate(rollout, rec: Recorder) -> None:
    """Each trainer generate call also runs a bare ``LLM.generate`` of the same requests, at the
    same weights (before or after it, alternating by step, so neither always finds the caches
    warm). The bare run's time is taken out of the trainer's ``generate`` timer and out of the
    step interval, so the trainer's figures stay its own."""
    inner = rollout.generate

    def generate(prompts, **kw):
        step = len(rec.rows) + 1
        bare_first = step % 2 == 0
        bare = bare_generate(rollout, prompts, kw) if bare_first else None
        start, cpu = time.perf_counter(), time.process_time()
        out = inner(prompts, **kw)
        wrapper_s, wrapper_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        if not bare_first:
            bare = bare_generate(rollout, prompts, kw)
        timer = rec.run.timer  # the bare call is not the trainer's: taken out (added back on exit)
        timer.times["generate"] = timer.times.get("generate", 0.0) - bare["bare_s"]
        timer.cpu["generate"] = timer.cpu.get("generate", 0.0) - bare["bare_cpu_s"]
        rec.gen_calls.append({"step": step, "wrapper_s": wrapper_s, "wrapper_cpu_s": wrapper_cpu_s, **bare,
                              "tokens": sum(len(s.response_ids) for o in out for s in o),
                              "token_ids": [s.response_ids for o in out for s in o]})
        return out

    rollout.generate = generate


def bare_generate(ro, prompts, kw) -> dict:
    """The same TokensPrompts and SamplingParams the wrapper builds (per-prompt seeds included),
    timed around ``LLM.generate`` only; prefix cache reset before (as at the trainer's wake-up)
    and after (the trainer's own call must not hit it either); the trainer's RNG untouched."""
    from vllm.inputs import TokensPrompt

    kw = dict(kw)
    n, seed, stop = kw.pop("n"), kw.pop("seed", None), kw.pop("stop_token_ids", None)
    params = [ro._sampling_params(j, n, seed, stop, **kw) for j in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    ro.llm.reset_prefix_cache()
    with ro._engine_rng_scope(), ro._compile_stance():
        start, cpu = time.perf_counter(), time.process_time()
        outs = ro.llm.generate(inputs, params, use_tqdm=False)
        bare_s, bare_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    ro.llm.reset_prefix_cache()
    return {"bare_s": bare_s, "bare_cpu_s": bare_cpu_s, "bare_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
            "bare_token_ids": [list(c.token_ids) for o in outs for c in o.outputs]}


# ----------------------------------------------------------------------------- worker


def prepare(args, info) -> str:
    """Rank 0 writes a small random model and the toy data; every rank gets the folder."""
    import torch.distributed as dist

    from rlcore.demo.toy import make_tiny_model, make_tiny_moe_model, make_toy_data

    holder = [tempfile.mkdtemp(prefix="bench_step_") if info.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    if info.rank == 0:
        if args.moe:
            make_tiny_moe_model(os.path.join(root, "model"), max_position_embeddings=256, **MOE_MODEL)
        else:
            make_tiny_model(os.path.join(root, "model"), max_position_embeddings=256, **MODEL)
        make_toy_data(os.path.join(root, "data"), n_train=2000, n_val=10)
    dist.barrier()
    return root


def trainer_argv(args, root: str) -> list[str]:
    return [
        "--config", os.path.join(bc.REPO, "configs", "demo_cpu.yaml"),
        "--model.path", os.path.join(root, "model"),
        "--data.train_files", json.dumps([os.path.join(root, "data", "toy_train.jsonl")]),
        "--data.val_files", "[]",
        "--rollout.max_response_length", str(args.response_len), "--rollout.max_model_len", "128",
        "--rollout.n", str(args.n), "--trainer.prompts_per_step", str(args.prompts_per_step),
        "--trainer.total_steps", str(args.warmup + args.steps), "--trainer.output_dir", os.path.join(root, "out"),
        "--algorithm.kl_loss_coef", "0", "--checkpoint.save_hf_final", "false", "--checkpoint.resume", "never",
        "--logging.console_every", "1000000",
        *(["--parallel.ep_size", str(args.nproc)] if args.moe else []), *shlex.split(args.extra),
    ]


def per_step(args, rec: Recorder) -> list[dict]:
    """Per measured step on this rank: step time, the timings, tokens and the bare replay."""
    steps = []
    for k in range(args.warmup, len(rec.rows)):
        t, cpu_t, step, m, cpu = rec.rows[k]
        calls = [c for c in rec.gen_calls if c["step"] == step]
        tokens = sum(c["tokens"] for c in calls)
        bare_s, bare_tok = sum(c["bare_s"] for c in calls), sum(c["bare_tokens"] for c in calls)
        bare_cpu = sum(c["bare_cpu_s"] for c in calls)
        steps.append({"step_s": t - rec.rows[k - 1][0] - bare_s, "bare_s": bare_s,
                      "cpu_ratio": (bare_cpu, sum(c["wrapper_cpu_s"] for c in calls)),
                      "step_cpu_s": cpu_t - rec.rows[k - 1][1] - bare_cpu,
                      "core_cpu_s": sum(cpu.get(name, 0.0) for name in ("generate", "train", "weight_sync")),
                      **{k2: v for k2, v in m.items() if k2.startswith(("timing/", "memory/"))},
                      "gen_tok_s": tokens / m["timing/generate_s"], "bare_tok_s": bare_tok / bare_s,
                      "same_tokens": all(c["token_ids"] == c["bare_token_ids"] for c in calls)})
    return steps


def summarize(steps_by_rank: list[list[dict]]) -> dict:
    """Medians over the measured steps. Per step: the step time is the slowest rank's interval;
    the useful work is the critical path, max over ranks of generate + train + weight sync (a
    rank that generated faster waits for the other in the next collective: that wait is DP
    imbalance of sampling, not switching overhead, and shows as ``gen_imbalance_s``). The
    rollout efficiency is sum over ranks of bare time / sum of the trainer's generate time
    (the tokens are identical, so this is the tokens/s ratio)."""
    n, ranks = len(steps_by_rank[0]), steps_by_rank
    core = lambda s: s["timing/generate_s"] + s["timing/train_s"] + s["timing/weight_sync_s"]  # noqa: E731
    step_s = [max(r[i]["step_s"] for r in ranks) for i in range(n)]  # (steps,)
    ratio = [step_s[i] / max(core(r[i]) for r in ranks) for i in range(n)]
    eff = [sum(r[i]["bare_s"] for r in ranks) / sum(r[i]["timing/generate_s"] for r in ranks) for i in range(n)]
    keys = sorted({k for r in ranks for s in r for k in s if k.startswith(("timing/", "memory/"))})
    phases = {k: bc.median([sum(r[i][k] for r in ranks) / len(ranks) for i in range(n)])
              for k in keys if all(k in s for r in ranks for s in r)}
    # The same ratio on process CPU time (the trainer's rollout call vs the bare call): on a shared,
    # overloaded host wall time mostly measures waiting for a core; CPU time measures the work.
    eff_cpu = [sum(r[i]["cpu_ratio"][0] for r in ranks) / sum(r[i]["cpu_ratio"][1] for r in ranks) for i in range(n)]
    # Overhead on CPU time too (sum over ranks): the work outside generate/train/sync, free of
    # the waiting that an overloaded host adds to every wall-clock interval.
    ratio_cpu = [sum(r[i]["step_cpu_s"] for r in ranks) / sum(r[i]["core_cpu_s"] for r in ranks) for i in range(n)]
    imbalance = [max(r[i]["timing/generate_s"] for r in ranks) - min(r[i]["timing/generate_s"] for r in ranks)
                 for i in range(n)]
    return {
        "overhead_ratio": bc.median(ratio), "rollout_efficiency": bc.median(eff),
        # Over the measured steps together: a cost paid every k-th step (rollout.check_sync_every)
        # counts at its share, which the per-step median would leave out. The last step is left
        # out: it writes the run's final checkpoint, once per run.
        "overhead_ratio_total": sum(step_s[:-1]) / sum(max(core(r[i]) for r in ranks) for i in range(n - 1))
        if n > 1 else ratio[0],
        "rollout_efficiency_cpu_time": bc.median(eff_cpu), "overhead_ratio_cpu_time": bc.median(ratio_cpu),
        "step_s": bc.median(step_s), "generate_s": phases["timing/generate_s"], "train_s": phases["timing/train_s"],
        "weight_sync_s": phases["timing/weight_sync_s"], "gen_imbalance_s": bc.median(imbalance),
        "gen_tokens_per_s": bc.median([sum(r[i]["gen_tok_s"] for r in ranks) / len(ranks) for i in range(n)]),
        "bare_tokens_per_s": bc.median([sum(r[i]["bare_tok_s"] for r in ranks) / len(ranks) for i in range(n)]),
        "replay_same_tokens": all(s["same_tokens"] for r in ranks for s in r),
        "overhead_ratio_per_step": ratio, "rollout_efficiency_per_step": eff, "phases": phases,
        "steps": n, "ranks": len(ranks),
    }


def worker(args) -> None:
    import shutil

    from rlcore.dist import init_distributed

    info = init_distributed("cpu")
    root = prepare(args, info)
    rec = Recorder()
    instrument(rec)
    import train_grpo

    bc.say(info.rank, f"{args.warmup} warm-up + {args.steps} measured steps, {args.prompts_per_step} prompts x "
                      f"{args.n} samples x <= {args.response_len} tokens, {info.world_size} ranks")
    train_grpo.main(trainer_argv(args, root))  # destroys the process group at the end
    steps = per_step(args, rec)
    # The process group is gone: hand the per-rank rows to rank 0 through files.
    mine = os.path.join(root, f"steps_{info.rank}.json")
    with open(mine + ".tmp", "w") as f:
        json.dump(steps, f)
    os.replace(mine + ".tmp", mine)  # appears complete or not at all
    if info.rank == 0:
        paths = [os.path.join(root, f"steps_{r}.json") for r in range(info.world_size)]
        deadline = time.time() + 120
        while not all(os.path.exists(p) for p in paths) and time.time() < deadline:
            time.sleep(0.2)
        by_rank = []
        for p in paths:
            with open(p) as f:
                by_rank.append(json.load(f))
        bc.write_result(summarize(by_rank))
        shutil.rmtree(root, ignore_errors=True)


def without_variants(argv: list[str]) -> list[str]:
    """``argv`` less its ``--variant`` options (each run gets one variant's overrides as --extra)."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--variant="):
            skip = False
        elif a == "--variant":
            skip = True
        else:
            out.append(a)
    return out


def compare(argv: list[str]) -> None:
    """One run per --variant, one after the other; a table of step and train time vs the first."""
    args, rows, base = parse_args(argv), [], without_variants(argv)
    for spec in args.variant:
        name, overrides = spec.split("=", 1)
        print(f"== {name}: {overrides}", flush=True)
        r = bc.relaunch(os.path.abspath(__file__), [*base, "--extra", f"{args.extra} {overrides}"], args.nproc,
                        args.timeout_s)
        rows.append({"variant": name, "overrides": overrides, "step_s": r["step_s"], "train_s": r["train_s"],
                     "overhead_ratio": r["overhead_ratio"], "overhead_ratio_total": r["overhead_ratio_total"],
                     "generate_s": r["generate_s"], "weight_sync_s": r["weight_sync_s"], "result": r})
    first = rows[0]
    print(f"{'variant':16s} {'step_s':>8s} {'train_s':>8s} {'train/first':>12s} {'step/first':>11s} "
          f"{'overhead':>9s} {'ovh_total':>9s}")
    for row in rows:
        row.update(train_ratio=row["train_s"] / first["train_s"], step_ratio=row["step_s"] / first["step_s"])
        print(f"{row['variant']:16s} {row['step_s']:8.3f} {row['train_s']:8.3f} {row['train_ratio']:12.3f} "
              f"{row['step_ratio']:11.3f} {row['overhead_ratio']:9.3f} {row['overhead_ratio_total']:9.3f}")
    print(json.dumps({"variants": rows}))


def main(argv: list[str]) -> None:
    if not bc.under_torchrun() and parse_args(argv).variant:
        return compare(argv)
    r = bc.run_or_relaunch(os.path.abspath(__file__), argv, parse_args, worker)
    if r is None:  # this process was a rank
        return
    print(f"step {r['step_s']:.3f}s = generate {r['generate_s']:.3f} + train {r['train_s']:.3f} + weight sync "
          f"{r['weight_sync_s']:.3f} + rest; overhead_ratio {r['overhead_ratio']:.3f} (all steps together {r['overhead_ratio_total']:.3f}); rollout tokens/s "
          f"{r['gen_tokens_per_s']:.0f} vs bare vLLM {r['bare_tokens_per_s']:.0f}: efficiency {r['rollout_efficiency']:.3f}")
    for k, v in r["phases"].items():
        print(f"  {k:40s} {v:.4f}")
    print(json.dumps(r))


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(sys.argv[1:]))
