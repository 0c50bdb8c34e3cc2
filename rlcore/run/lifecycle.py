"""The run's state and its lifecycle around the loop: resume, checkpoints (periodic, on preemption,
after divergence), skipped-step accounting, and teardown."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from rlcore import distill, judge
from rlcore.algo.exploration import EntropyControl
from rlcore.config import Config
from rlcore.dist import DistInfo, exit_process
from rlcore.errors import Exit
from rlcore.metrics import MetricsLogger, Timer, format_duration
from rlcore.run import checkpoint, preempt, run_config
from rlcore.run.build import Engines
from rlcore.step.sampling import StepSampler


@dataclass
class RunState:
    """What changes as the run goes and goes into a checkpoint beside the engines' state."""

    step: int = 0
    saved_step: int = -1  # step of the newest checkpoint this process wrote or resumed from
    skips_total: int = 0  # optimizer steps skipped for a non-finite loss / grad norm (actor/skipped_steps)
    skips_consecutive: int = 0  # trainer steps in a row with a skipped optimizer step


@dataclass
class Run:
    """The parts the lifecycle functions below act on (checkpoints, resume, stops, teardown)."""

    cfg: Config
    info: DistInfo
    engines: Engines
    sampler: StepSampler
    logger: MetricsLogger
    timer: Timer
    stop: preempt.StopRequest
    watchdog: preempt.Watchdog
    resume_from: str | None = None  # checkpoint folder found and checked before any model loaded
    val_prompts: list | None = None  # data.val_files, tokenized
    entropy: EntropyControl | None = None  # the entropy coefficient of the next update
    loss_options: dict = field(default_factory=dict)  # grpo.train_on_batch's tis_cap, clip_cov, correction
    state: RunState = field(default_factory=RunState)
    started_at: float = field(default_factory=time.perf_counter)  # for the end summary: the process start


def resume(run: Run) -> None:
    path = run.resume_from
    if path is None:
        if run.info.is_main:
            print(f"starting fresh (checkpoint.resume={run.cfg.checkpoint.resume}: no checkpoint to resume)", flush=True)
        return
    switch = run.engines.switch
    switch.to_training()  # vLLM released first: the load needs the trainer state on the device
    switch.record_checkpoint(f"load {os.path.basename(path)}")
    state = checkpoint.load(run.engines.policy, path, run.info.rank)
    run.state.step = run.state.saved_step = state["step"]
    run.sampler.prompts.load_state_dict(state["data"])
    run.sampler.load_state_dict(state.get("sampling", {}))
    if run.entropy is not None:
        run.entropy.load_state_dict(state.get("exploration", {}))
    skips = state.get("skips", {})
    run.state.skips_total, run.state.skips_consecutive = skips.get("total", 0), skips.get("consecutive", 0)
    if switch.checker is not None:
        switch.checker.at_resume(run.state.step)
    switch.to_generation()  # the engine still holds the initial weights: push the resumed ones
    probe = switch.pop_metrics().get("rollout/sync_probe_max")  # not step + 1's row: the uninterrupted run has none
    if run.info.is_main:
        if probe is not None:
            print(f"sync check of the resumed weights: max |d log-prob| {probe:.2e}", flush=True)
        # Rows and events a killed run wrote after this checkpoint are written again below.
        dropped = checkpoint.trim_metrics(run.cfg.trainer.output_dir, run.state.step)
        checkpoint.purge_tensorboard(run.logger, run.state.step)
        note = f"; dropped {dropped} metrics.jsonl row(s) written after it" if dropped else ""
        print(f"resumed from {path} at step {run.state.step}{note}", flush=True)
        if run.engines.policy.lr_schedule_changes:
            print(f"LR schedule follows this run's config from step {run.state.step} on, not the checkpoint's: "
                  + "; ".join(run.engines.policy.lr_schedule_changes), flush=True)


def trainer_state(run: Run) -> dict:
    """What a checkpoint needs beyond the policy, optimizer, scheduler and RNG."""
    return {"step": run.state.step, "data": run.sampler.prompts.state_dict(), "sampling": run.sampler.state_dict(),
            "exploration": run.entropy.state_dict() if run.entropy is not None else {},
            "skips": {"total": run.state.skips_total, "consecutive": run.state.skips_consecutive}}


def step_snapshot(run: Run) -> dict:
    """The state at the start of a step (= the end of step - 1): cheap, taken every step."""
    run.state.step -= 1
    state = trainer_state(run)
    run.state.step += 1
    return {"step": run.state.step - 1, "trainer": state, "rng": checkpoint.rng_state()}


def stop_preempted(run: Run, at_start: dict | None) -> None:
    """Every rank, after a collective stop decision: checkpoint the last complete step (unless that
    is saved already; never with checkpoint.save_every=-1), then exit with Exit.PREEMPTED. ``at_start``:
    the current step is abandoned."""
    step = run.state.step if at_start is None else at_start["step"]
    never = run.cfg.checkpoint.save_every == NEVER_SAVE
    if step > 0 and run.state.saved_step != step and not never:
        state, rng = (trainer_state(run), None) if at_start is None else (at_start["trainer"], at_start["rng"])
        with run.watchdog.phase("checkpoint"):
            asleep_for_checkpoint(run, f"save step_{step}")
            checkpoint.save(run.engines.policy, run.cfg.trainer.output_dir, step, state, run.info.rank,
                            run.cfg.checkpoint.keep_last, rng=rng, files=run_config.files(run.cfg))
        run.state.saved_step = step
    run.stop.cancel_deadline()
    since = run.stop.seconds_since_signal()
    origin = f"{since:.1f} s after the signal reached this rank" if since is not None else "signal on another rank"
    saved = f"checkpoint step_{step} is complete" if step > 0 else "no step completed, nothing to save"
    then = "resume with checkpoint.resume=auto"
    if never and step > 0:
        saved, then = "nothing saved (checkpoint.save_every=-1)", "a restart starts over"
    print(f"rank {run.info.rank}: preempted at step {step} ({origin}); {saved}; exiting with code "
          f"{int(Exit.PREEMPTED)} ({then})", file=sys.stderr, flush=True)
    # The grace period is short: skip the engine shutdown and interpreter teardown (~10 s on CPU).
    # The checkpoint ended with a barrier, logs are flushed, and no collective follows. C++
    # destructors still run (exit_process): on CPU they remove vLLM's tensor-parallel shm files,
    # which a resume on this host needs gone.
    run.watchdog.close()
    run.logger.close()
    run.engines.rollout.shutdown(exiting=True)  # a LoRA engine's adapter folder in /dev/shm
    exit_process(Exit.PREEMPTED, run_atexit=False)


def count_skips(run: Run, metrics: dict) -> dict:
    """The engine skipped the optimizer step on a non-finite grad norm (global, so every rank agrees)."""
    skipped = int(metrics.get("actor/skipped", 0))
    run.state.skips_total += skipped
    run.state.skips_consecutive = run.state.skips_consecutive + 1 if skipped else 0
    if skipped and run.info.is_main:
        print(f"step {run.state.step}: non-finite loss or grad norm (actor/grad_norm={metrics.get('actor/grad_norm')}); "
              f"{skipped} optimizer step(s) skipped, {run.state.skips_consecutive} step(s) in a row "
              f"(trainer.max_consecutive_skips={run.cfg.trainer.max_consecutive_skips})", file=sys.stderr, flush=True)
    return {"actor/skipped_steps": run.state.skips_total}


def stop_if_diverged(run: Run) -> None:
    """After max_consecutive_skips skipped steps: checkpoint (model and optimizer are those of the last
    good update, as skipped steps change neither; none with checkpoint.save_every=-1) and exit with
    Exit.NON_FINITE."""
    limit = run.cfg.trainer.max_consecutive_skips
    if run.state.skips_consecutive < limit:
        return
    never = run.cfg.checkpoint.save_every == NEVER_SAVE
    if run.state.saved_step != run.state.step and not never:
        asleep_for_checkpoint(run, f"save step_{run.state.step}")
        checkpoint.save(run.engines.policy, run.cfg.trainer.output_dir, run.state.step, trainer_state(run), run.info.rank,
                        run.cfg.checkpoint.keep_last, files=run_config.files(run.cfg))
        run.state.saved_step = run.state.step
    if run.info.is_main:
        saved = (f"Checkpoint step_{run.state.step} holds the model and optimizer of the last good update. "
                 if not never else "No checkpoint was written (checkpoint.save_every=-1). ")
        then = "then resume with checkpoint.resume=auto" if not never else "then start again"
        print(f"error: training stopped at step {run.state.step}: {limit} steps in a row had a non-finite loss or "
              f"gradient norm (trainer.max_consecutive_skips={limit}), and their optimizer steps were skipped. "
              f"{saved}Lower optim.lr, check rewards and data for NaN/inf, or raise trainer.max_consecutive_skips, "
              f"{then}.", file=sys.stderr, flush=True)
    teardown(run)
    raise SystemExit(int(Exit.NON_FINITE))


def asleep_for_checkpoint(run: Run, what: str) -> None:
    """A save outside the loop's own (preemption, divergence) finds vLLM awake: release it first, so
    that the trainer state the save brings to the device never meets vLLM's memory (the plan's
    checkpoint column)."""
    if run.engines.switch.phase == "generation":
        run.engines.switch.to_training()
    run.engines.switch.record_checkpoint(what)


NEVER_SAVE = -1  # checkpoint.save_every: no checkpoint at all (verl's trainer.save_freq=-1)


def checkpoint_due(step: int, total_steps: int, save_every: int) -> bool:
    """Whether step ``step`` writes a checkpoint: every ``save_every`` steps and at the last step;
    save_every 0: the last step only; NEVER_SAVE: never (HF exports are decided apart)."""
    if save_every == NEVER_SAVE:
        return False
    return step == total_steps or (save_every > 0 and step % save_every == 0)


def write_due_checkpoint(run: Run) -> int | None:
    """In the train phase, after the optimizer step (vLLM asleep, the trainer state on the device):
    write the checkpoint and the HF exports due at this step. Returns the step whose checkpoint
    ``commit_checkpoint`` must make current once the step's metrics row is written, or None."""
    c, out, step = run.cfg.checkpoint, run.cfg.trainer.output_dir, run.state.step
    last = step == run.cfg.trainer.total_steps
    pending = None
    if checkpoint_due(step, run.cfg.trainer.total_steps, c.save_every):
        run.engines.switch.record_checkpoint(f"save step_{step}")
        checkpoint.write(run.engines.policy, out, step, trainer_state(run), run.info.rank, files=run_config.files(run.cfg))
        pending = step
    if c.hf_every and step % c.hf_every == 0:
        checkpoint.export_hf(run.engines.policy, os.path.join(out, "hf", f"step_{step}"), c.hf_dtype, run.info.is_main)
    if last and c.save_hf_final:
        checkpoint.export_hf(run.engines.policy, os.path.join(out, "hf_final"), c.hf_dtype, run.info.is_main)
    return pending


def commit_checkpoint(run: Run, step: int | None) -> None:
    """Make the checkpoint written for ``step`` the one a resume takes (a checkpoint always has its
    metrics row: a run killed in between resumes from the previous one)."""
    if step is None:
        return
    path = checkpoint.commit(run.cfg.trainer.output_dir, step, run.info.rank, run.cfg.checkpoint.keep_last)
    run.state.saved_step = step
    if run.info.is_main:
        print(f"saved checkpoint {path}", flush=True)


def teardown(run: Run) -> None:
    import torch.distributed as dist

    if run.info.is_main and run.state.step == run.cfg.trainer.total_steps:
        print(end_summary(run), flush=True)
    if run.watchdog is not None:
        run.watchdog.close()
    run.logger.close()
    # The process ends next (rlcore.dist.run_then_exit): the engines go with it (ColocateRollout's
    # shutdown(exiting=True)); judges before the policy's engine, as theirs share its vLLM groups.
    judge.shutdown(run.engines.judges, exiting=True)
    distill.shutdown(run.engines.teacher, exiting=True)
    run.engines.rollout.shutdown(exiting=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_summary(run: Run) -> str:
    """The last line of a finished run: how long, and where its outputs are."""
    out, c = run.cfg.trainer.output_dir, run.cfg.checkpoint
    parts = [f"done: {run.state.step} steps in {format_duration(time.perf_counter() - run.started_at)}"]
    if c.save_hf_final:
        parts.append(f"HF model {os.path.join(out, 'hf_final')}")
    parts.append(f"metrics {os.path.join(out, 'metrics.jsonl')}")
    curves = f"curves: python scripts/plot_metrics.py {out}"
    if run.logger.writer is not None or "tensorboard" in run.cfg.logging.enabled_trackers:
        curves += f" or tensorboard --logdir {os.path.join(out, 'tensorboard')}"
    return " | ".join(parts + [curves])
