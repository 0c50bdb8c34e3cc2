"""Benchmark: where an image+text GRPO step's time goes, on 2 CPU ranks, through the real trainer loop.

    .venv/bin/python scripts/bench_vl.py [--steps 3] [--warmup 1] [--prompts_per_step 16] [--n 8]
        [--freeze_vision_tower] [--nproc 2]

Starts its own ranks (torchrun) and runs ``train_grpo.main`` unchanged with the vision-language
demo's settings (``configs/demo_vl_cpu.yaml``) on a fresh tiny Qwen3-VL
(``rlcore.demo.vl.make_tiny_vl_model``) and the shapes task (``make_shapes_data``) in a temporary
folder; only the prompts per step, the samples per prompt, the step count and the frozen tower
are changed (plus no validation, no TensorBoard, no checkpoints). It is instrumented from outside:

  generate   the trainer's ``timing/generate_s`` (the vLLM call, images included: vLLM's own ViT)
  train      ``timing/train_s``: ``grpo.train_on_batch`` (forwards, backwards, optimizer step)
  vision     the train phase's vision tower (``policy.model.model.visual``: patch embedding, ViT
             blocks, merger, deepstack mergers), from module hooks: forward = pre-hook to post-hook
             of every call; backward = from the moment the gradients of all its outputs are there
             (the point ``register_full_backward_pre_hook`` marks) to the moment the gradient of
             its input is (the point ``register_full_backward_hook`` marks). The two torch hooks
             are not usable as they are: the tower returns a ModelOutput (not a tuple of tensors,
             so torch attaches no backward hook to it) and its input, the pixel values, needs no
             gradient (so torch's full backward hook would fire at the start of its backward).
             The benchmark therefore routes the outputs through an identity autograd node (its
             backward = the start) and makes the pixel values a leaf that requires grad (its
             gradient = the end; that adds the patch embedding's input gradient, as much work as
             the patch embedding's forward).
             VeOmni's FSDP path also runs a dummy ViT forward per forward for the absent video
             input (``visual.dummy_forward``, 16 patches, so that every rank reduce-scatters the
             tower); it is part of the figures and shown on its own too.
  text       train - vision: the language model's forward and backward, the loss, FSDP2's
             collectives of the root unit (which holds the tower's patch embedding and mergers)
             and the optimizer step (also shown on its own)
  sync       the switch's ``timing/weight_sync_s`` (the bucketed FSDP2 gather into vLLM)
  step       ``timing/step_s``: the whole loop body (sampling, rewards, switch, logging included)
  memory     per rank, the peak RSS (VmHWM, reset at each phase start) during generation, during
             the train phase (release, onload, train) and during the switch back to generation;
             ``peak_rss_gb`` is the largest over the measured steps. vLLM runs in the rank's
             process, so these are the whole rank's.

A frozen tower (``--freeze_vision_tower``) has no backward: ``vision_bwd_s`` is 0 and
``vision_backward`` false. Timings are per-step means over the measured steps (each the mean
over ranks; ``step_s`` the slowest rank's). The last line is a JSON object with generate_s,
train_s, vision_fwd_s, vision_bwd_s, vision_s, text_s, sync_s, step_s, vision_share_of_train,
peak_rss_gb (one per rank), per_rank, the workload, and ``cpu_time``: the same split in process
CPU seconds per rank (the same hooks and timers), steadier than wall time on a shared,
overloaded host (``load_average`` is recorded beside it; gloo waits cost no CPU time).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

TIMINGS = ("generate", "reward", "train", "vision_fwd", "vision_bwd", "vision_dummy_fwd", "vision_dummy_bwd",
           "optimizer", "weight_sync", "offload", "wake", "release", "onload", "step")  # timing/{name}_s
PHASES = ("generate", "train", "sync")  # peak RSS windows


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts_per_step", "--prompts-per-step", dest="prompts_per_step", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--freeze_vision_tower", "--freeze-vision-tower", dest="freeze_vision_tower",
                   action="store_true", help="train the language model only (the ViT then has no backward)")
    p.add_argument("--micro_batch_size", "--micro-batch-size", dest="micro_batch_size", type=int, default=None,
                   help="sequences per micro-batch (default: the demo config's)")
    p.add_argument("--n_train", "--n-train", dest="n_train", type=int, default=None,
                   help="shapes prompts written (default: enough for every step without repeats, >= 64)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout_s", "--timeout-s", dest="timeout_s", type=float, default=3600)
    args = p.parse_args(argv)
    if min(args.steps, args.prompts_per_step, args.n, args.nproc) < 1 or args.warmup < 1:
        p.error("every count must be >= 1 (--warmup too: the first step warms vLLM and the allocators up)")
    if args.prompts_per_step % args.nproc:
        p.error(f"--prompts_per_step must be a multiple of --nproc ({args.nproc}): each rank samples its share")
    return args


# ----------------------------------------------------------------------------- the vision tower's clock


def _sync(cuda: bool) -> None:
    """Make the wall clock mean 'done'. On CPU nothing is needed: every op (intra-op threads
    included) has finished when it returns, and the CPU autograd engine runs on the thread that
    called backward(), so a hook's time stamp is the completion time of what came before it. On
    cuda, kernels are asynchronous: synchronize at every time stamp."""
    if cuda:
        import torch

        torch.cuda.synchronize()


def _now(cuda: bool) -> tuple[float, float]:
    """(wall clock, this process's CPU time), after a device sync on cuda."""
    _sync(cuda)
    return time.perf_counter(), time.process_time()


def _backward_start_fn():
    import torch

    class BackwardStart(torch.autograd.Function):
        """Identity on the tower's outputs; its backward runs once the gradients of all of them
        are computed (what torch's full backward pre-hook marks) and calls ``callback``. Unused
        outputs get no gradient (grads not materialized): no extra work flows into them."""

        @staticmethod
        def forward(ctx, callback, *xs):
            ctx.callback = callback
            ctx.set_materialize_grads(False)
            return xs

        @staticmethod
        def backward(ctx, *grads):
            ctx.callback()
            return (None, *grads)

    return BackwardStart


class VisionClock:
    """Forward and backward wall time of the vision tower (``model.model.visual``), added to the
    trainer's Timer under vision_fwd / vision_bwd (and vision_dummy_*, the dummy video forward's
    share), so that each step's row carries them as ``timing/vision_*_s``.

    Backward: each trained forward call gets a token whose backward interval runs from its
    outputs' gradients to its input's; ``vision_bwd`` is the union of the intervals (a depth
    counter), ``vision_dummy_bwd`` the dummy calls' intervals. ``counts`` tallies forward calls
    and completed backward intervals (every started backward must end)."""

    def __init__(self, tower, timer, device):
        self.tower, self.timer = tower, timer
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.trainable = any(p.requires_grad for p in tower.parameters())
        self.start_fn = _backward_start_fn()
        self.in_dummy = False
        self._token = None  # the backward token of the forward call under way
        self.fwd_start = (0.0, 0.0)
        self.depth, self.union_start = 0, (0.0, 0.0)
        self.counts = {"fwd": 0, "dummy_fwd": 0, "bwd_started": 0, "bwd_ended": 0, "bwd_overlapping": 0}
        tower.register_forward_pre_hook(self._pre, with_kwargs=True)
        tower.register_forward_hook(self._post, with_kwargs=True)
        inner = getattr(tower, "dummy_forward", None)  # VeOmni: called from the model's forward, calls tower(...)
        if inner is not None:
            def dummy_forward(*a, **kw):
                self.in_dummy = True
                try:
                    return inner(*a, **kw)
                finally:
                    self.in_dummy = False

            tower.dummy_forward = dummy_forward

    def _add(self, name: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        """Wall and process CPU seconds from ``start`` to ``end`` (``_now()`` stamps) under ``name``."""
        self.timer.times[name] = self.timer.times.get(name, 0.0) + end[0] - start[0]
        self.timer.cpu[name] = self.timer.cpu.get(name, 0.0) + end[1] - start[1]

    def _pre(self, module, args, kwargs):
        import torch

        self.fwd_start = _now(self.cuda)
        if not (self.trainable and torch.is_grad_enabled()):
            return None  # frozen tower or a no-grad forward: no backward to time
        token = {"dummy": self.in_dummy, "start": None}
        if args:
            args = (self._leaf(args[0], token), *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": self._leaf(kwargs["hidden_states"], token)}
        self._token = token
        return args, kwargs

    def _leaf(self, x, token):
        """The pixel values as a leaf that requires grad: its gradient is the tower's last."""
        leaf = x if x.requires_grad else x.detach().requires_grad_(True)
        leaf.register_hook(lambda grad: self._bwd_end(token))
        return leaf

    def _post(self, module, args, kwargs, out):
        import torch

        end = _now(self.cuda)
        self._add("vision_fwd", self.fwd_start, end)
        self.counts["fwd"] += 1
        if self.in_dummy:
            self._add("vision_dummy_fwd", self.fwd_start, end)
            self.counts["dummy_fwd"] += 1
        token, self._token = self._token, None
        # Qwen3-VL's tower returns a ModelOutput: the merged image embeddings (pooler_output) and the
        # deepstack features go on into the language model (last_hidden_state is unused)
        tensor_out = isinstance(out, torch.Tensor)
        deepstack = [] if tensor_out else list(getattr(out, "deepstack_features", None) or [])
        outputs = [out if tensor_out else out.pooler_output, *deepstack]
        if token is None or not any(t.requires_grad for t in outputs):
            return None
        marked = self.start_fn.apply(functools.partial(self._bwd_start, token), *outputs)
        if tensor_out:
            return marked[0]
        out.pooler_output = marked[0]
        if deepstack:
            out.deepstack_features = list(marked[1:])
        return out

    def _bwd_start(self, token) -> None:
        now = _now(self.cuda)
        token["start"] = now
        self.counts["bwd_started"] += 1
        if self.depth == 0:
            self.union_start = now
        else:  # another call's backward is still running (interleaved by the autograd engine)
            self.counts["bwd_overlapping"] += 1
        self.depth += 1

    def _bwd_end(self, token) -> None:
        now = _now(self.cuda)
        if token["start"] is None:  # cannot happen: the input's gradient comes after the outputs'
            raise RuntimeError("vision tower: input gradient before its output gradients")
        self.counts["bwd_ended"] += 1
        if token["dummy"]:
            self._add("vision_dummy_bwd", token["start"], now)
        self.depth -= 1
        if self.depth == 0:
            self._add("vision_bwd", self.union_start, now)


# ----------------------------------------------------------------------------- instrumentation


class Recorder:
    """What the benchmark notes from outside the trainer (per rank)."""

    def __init__(self, warmup: int):
        self.warmup = warmup  # rows left out of the figures
        self.rows: list[dict] = []  # per logged step: timings (s), peak RSS per phase (GB), counts
        self.peaks: dict[str, float] = {}
        self.last_cpu = time.process_time()  # process CPU time at the previous row
        self.result: dict | None = None  # rank 0: the summary, made before the process group goes
        self.resettable = bc.reset_peak_rss()
        self.clock: VisionClock | None = None
        self.run = None


def _peak_gb() -> float:
    """The peak RSS since the last reset (VmHWM), or the process's lifetime peak (ru_maxrss,
    KiB on Linux) where the reset is not allowed."""
    mb = bc.peak_rss_mb()
    if mb != mb:  # NaN: no /proc
        mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return mb / 1024


def _window(rec: Recorder, phase: str, fn):
    """``fn`` with the peak RSS over its call recorded as ``rec.peaks[phase]`` (max over calls)."""
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        bc.reset_peak_rss()
        try:
            return fn(*a, **kw)
        finally:
            rec.peaks[phase] = max(rec.peaks.get(phase, 0.0), _peak_gb())
    return wrapped


def instrument(rec: Recorder) -> None:
    """Wrap the trainer's build(), logger and teardown (module attributes of train_grpo)."""
    import train_grpo

    base_build, base_logger, base_teardown = train_grpo.build, train_grpo.MetricsLogger, train_grpo.teardown

    def build(*args):
        run = base_build(*args)
        bc.cpu_timed(run.timer)
        rec.last_cpu = time.process_time()
        policy, switch = run.engines.policy, run.engines.switch
        rec.clock = VisionClock(policy.model.model.visual, run.timer, policy.device)
        inner_step = policy.step

        def step():
            with run.timer("optimizer"):
                return inner_step()

        policy.step = step
        run.sampler.sample = _window(rec, "generate", run.sampler.sample)
        # the train window: release_rollout, onload, train; closed when the switch back starts
        to_training, to_generation = switch.to_training, switch.to_generation

        def start_training():
            bc.reset_peak_rss()
            return to_training()

        def start_generation():
            rec.peaks["train"] = max(rec.peaks.get("train", 0.0), _peak_gb())
            return _window(rec, "sync", to_generation)()

        switch.to_training, switch.to_generation = start_training, start_generation
        rec.run = run
        return run

    class RecordingLogger(base_logger):
        def log(self, step, metrics):
            if "timing/step_s" in metrics:  # a training step's row (validation rows have none)
                row = {name: float(metrics.get(f"timing/{name}_s", 0.0)) for name in TIMINGS}
                cpu, rec.run.timer.cpu = rec.run.timer.cpu, {}
                row.update({f"{name}_cpu": cpu.get(name, 0.0) for name in TIMINGS})
                now = time.process_time()
                row["step_cpu"], rec.last_cpu = now - rec.last_cpu, now  # log to log: the loop body
                row.update({f"peak_{p}_gb": rec.peaks.get(p, 0.0) for p in PHASES})
                row["counts"] = dict(rec.clock.counts)
                row["tokens"] = float(metrics.get("rollout/tokens", 0.0))
                row["mismatch_max"] = float(metrics.get("rollout/mismatch_max", float("nan")))
                rec.rows.append(row)
                rec.peaks = {}
                for k in rec.clock.counts:
                    rec.clock.counts[k] = 0
            super().log(step, metrics)

    def teardown(run):
        """Gather every rank's rows on rank 0 while the process group still exists, then the
        trainer's own teardown (which destroys it)."""
        import torch.distributed as dist

        everyone = [None] * run.info.world_size
        dist.all_gather_object(everyone, rec.rows)
        if run.info.rank == 0:
            rec.result = summarize(everyone, run.cfg, rec)
        base_teardown(run)

    train_grpo.build, train_grpo.MetricsLogger, train_grpo.teardown = build, RecordingLogger, teardown


# ----------------------------------------------------------------------------- worker


def prepare(args, info) -> str:
    """Rank 0 writes the tiny Qwen3-VL and the shapes data; every rank gets the folder."""
    import torch.distributed as dist

    from rlcore import quiet
    from rlcore.demo.vl import make_shapes_data, make_tiny_vl_model

    holder = [tempfile.mkdtemp(prefix="bench_vl_") if info.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    if info.rank == 0:
        with quiet.filtered_output():
            make_tiny_vl_model(os.path.join(root, "model"))
        n_train = args.n_train or max(64, args.prompts_per_step * (args.warmup + args.steps))
        make_shapes_data(os.path.join(root, "shapes"), n_train=n_train, n_val=1)
    dist.barrier()
    return root


def trainer_argv(args, root: str) -> list[str]:
    argv = [
        "--config", os.path.join(bc.REPO, "configs", "demo_vl_cpu.yaml"),
        "--model.path", os.path.join(root, "model"),
        "--model.freeze_vision_tower", "true" if args.freeze_vision_tower else "false",
        "--data.train_files", json.dumps([os.path.join(root, "shapes", "shapes_train.jsonl")]),
        "--data.val_files", "[]",
        "--rollout.n", str(args.n), "--trainer.prompts_per_step", str(args.prompts_per_step),
        "--trainer.total_steps", str(args.warmup + args.steps), "--trainer.output_dir", os.path.join(root, "out"),
        "--checkpoint.save_every", "0", "--checkpoint.save_hf_final", "false", "--checkpoint.resume", "never",
        "--logging.tensorboard", "false", "--logging.console_every", "1000000",
    ]
    if args.micro_batch_size:
        argv += ["--algorithm.micro_batch_size", str(args.micro_batch_size)]
    return argv


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(rows_by_rank: list[list[dict]], cfg, rec: Recorder) -> dict:
    """Per-step means over the measured steps (the rows after the warm-up)."""
    warm = rec.warmup
    ranks = [rows[warm:] for rows in rows_by_rank]
    n = min(len(r) for r in ranks)
    if n == 0:
        raise RuntimeError(f"no measured steps: {[len(r) for r in rows_by_rank]} rows per rank, warm-up {warm}")

    def rank_mean(name: str) -> float:  # mean over steps of the mean over ranks
        return _mean([_mean([r[i][name] for r in ranks]) for i in range(n)])

    t = {name: rank_mean(name) for name in TIMINGS}
    t["step"] = _mean([max(r[i]["step"] for r in ranks) for i in range(n)])
    vision = t["vision_fwd"] + t["vision_bwd"]
    counts = {k: _mean([_mean([r[i]["counts"][k] for r in ranks]) for i in range(n)]) for k in ranks[0][0]["counts"]}
    per_rank = []
    for rank, r in enumerate(ranks):
        per_rank.append({
            "rank": rank, **{f"{name}_s": _mean([s[name] for s in r[:n]]) for name in TIMINGS},
            "peak_rss_gb": max(max(s[f"peak_{p}_gb"] for p in PHASES) for s in r[:n]),
            **{f"peak_rss_{p}_gb": max(s[f"peak_{p}_gb"] for s in r[:n]) for p in PHASES},
        })
    bwd_complete = counts["bwd_started"] == counts["bwd_ended"]
    c = {name: rank_mean(f"{name}_cpu") for name in TIMINGS}  # process CPU seconds, mean over ranks
    vision_cpu = c["vision_fwd"] + c["vision_bwd"]
    cpu_time = {"generate_s": c["generate"], "train_s": c["train"], "vision_fwd_s": c["vision_fwd"],
                "vision_bwd_s": c["vision_bwd"], "vision_s": vision_cpu, "text_s": c["train"] - vision_cpu,
                "sync_s": c["weight_sync"], "step_s": c["step"],
                "vision_share_of_train": vision_cpu / c["train"] if c["train"] > 0 else 0.0}
    return {
        "generate_s": t["generate"], "train_s": t["train"], "vision_fwd_s": t["vision_fwd"],
        "vision_bwd_s": t["vision_bwd"], "vision_s": vision, "text_s": t["train"] - vision,
        "sync_s": t["weight_sync"], "step_s": t["step"],
        "vision_share_of_train": vision / t["train"] if t["train"] > 0 else 0.0,
        "vision_dummy_fwd_s": t["vision_dummy_fwd"], "vision_dummy_bwd_s": t["vision_dummy_bwd"],
        "optimizer_s": t["optimizer"], "reward_s": t["reward"],
        "switch_other_s": t["offload"] + t["wake"] + t["release"] + t["onload"],
        "rest_of_step_s": t["step"] - t["generate"] - t["train"] - t["weight_sync"],
        "peak_rss_gb": [p["peak_rss_gb"] for p in per_rank],
        "peak_rss_reset": rec.resettable,
        "vision_backward": counts["bwd_ended"] > 0,
        "vision_backward_complete": bwd_complete,
        "vision_calls_per_step": counts["fwd"], "vision_dummy_calls_per_step": counts["dummy_fwd"],
        "vision_bwd_calls_per_step": counts["bwd_ended"], "vision_bwd_overlapping_per_step": counts["bwd_overlapping"],
        "rollout_tokens_per_step": _mean([ranks[0][i]["tokens"] for i in range(n)]),
        "mismatch_max": max(r[i]["mismatch_max"] for r in ranks for i in range(n)),
        "cpu_time": cpu_time, "load_average": list(os.getloadavg()),
        "per_rank": per_rank,
        "freeze_vision_tower": bool(cfg.model.freeze_vision_tower),
        "prompts_per_step": cfg.trainer.prompts_per_step, "n": cfg.rollout.n,
        "micro_batch_size": cfg.algorithm.micro_batch_size, "max_response_length": cfg.rollout.max_response_length,
        "steps": n, "warmup": warm, "ranks": len(ranks),
    }


def worker(args) -> None:
    from rlcore.dist import init_distributed

    info = init_distributed("cpu")
    root = prepare(args, info)
    rec = Recorder(args.warmup)
    instrument(rec)
    import train_grpo

    bc.say(info.rank, f"{args.warmup} warm-up + {args.steps} measured steps, {args.prompts_per_step} prompts x "
                      f"{args.n} samples, vision tower {'frozen' if args.freeze_vision_tower else 'trained'}, "
                      f"{info.world_size} ranks")
    try:
        train_grpo.main(trainer_argv(args, root))  # destroys the process group at the end
        if info.rank == 0:
            bc.write_result(rec.result)
    finally:
        if info.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def report(r: dict) -> str:
    frozen = "frozen" if r["freeze_vision_tower"] else "trained"
    lines = [
        f"image+text GRPO step, {r['prompts_per_step']} prompts x {r['n']} samples, vision tower {frozen}, "
        f"{r['ranks']} CPU ranks, mean of {r['steps']} steps after {r['warmup']} warm-up:",
        f"  step            {r['step_s']:8.3f} s",
        f"  generate (vLLM) {r['generate_s']:8.3f} s",
        f"  train           {r['train_s']:8.3f} s",
        f"    vision fwd    {r['vision_fwd_s']:8.3f} s  ({r['vision_calls_per_step']:.0f} calls, "
        f"{r['vision_dummy_calls_per_step']:.0f} of them VeOmni's dummy video forward: "
        f"{r['vision_dummy_fwd_s']:.3f} s)",
        f"    vision bwd    {r['vision_bwd_s']:8.3f} s  " + (
            f"({r['vision_bwd_calls_per_step']:.0f} calls, dummy {r['vision_dummy_bwd_s']:.3f} s)"
            if r["vision_backward"] else "(none: the tower is frozen)"),
        f"    text + rest   {r['text_s']:8.3f} s  (optimizer step {r['optimizer_s']:.3f} s)",
        f"    vision share  {100 * r['vision_share_of_train']:7.1f} %",
        f"  weight sync     {r['sync_s']:8.3f} s",
        f"  rest of step    {r['rest_of_step_s']:8.3f} s  (rewards {r['reward_s']:.3f} s, other switch steps "
        f"{r['switch_other_s']:.3f} s, sampling, logging)",
    ]
    c = r["cpu_time"]
    lines.append(f"  process CPU time per rank: step {c['step_s']:.3f} s, generate {c['generate_s']:.3f}, train "
                 f"{c['train_s']:.3f} = vision {c['vision_s']:.3f} ({100 * c['vision_share_of_train']:.1f} %) + text "
                 f"{c['text_s']:.3f}, sync {c['sync_s']:.3f}  (load average {r['load_average'][0]:.2f})")
    for p in r["per_rank"]:
        lines.append(f"  rank {p['rank']} peak RSS {p['peak_rss_gb']:.2f} GB (generate "
                     f"{p['peak_rss_generate_gb']:.2f}, train {p['peak_rss_train_gb']:.2f}, sync "
                     f"{p['peak_rss_sync_gb']:.2f})")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    r = bc.run_or_relaunch(os.path.abspath(__file__), argv, parse_args, worker)
    if r is None:  # this process was a rank
        return
    print(report(r))
    print(json.dumps(r))


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(sys.argv[1:]))
