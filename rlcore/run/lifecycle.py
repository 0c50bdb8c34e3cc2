"""The run's state and its lifecycle around the loop: resume, checkpoints (periodic, on preemption,
after divergence), skipped-step accounting, teardown, and the end of a run whose storage failed
(``ends_on_storage_failure``; the agreement and the checks are rlcore/run/storage.py's)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from rlcore import distill, judge
from rlcore.algo.exploration import EntropyControl
from rlcore.config import Config
from rlcore.dist import DistInfo, exit_process
from rlcore.errors import ConfigError, Exit, StorageError, describe_errno, writing
from rlcore.metrics import MetricsLogger, Timer, format_duration
from rlcore.run import checkpoint, preempt, run_config, storage
from rlcore.run.build import Engines
from rlcore.step import validation
from rlcore.step.sampling import StepSampler


@dataclass
class RunState:
    """What changes as the run goes and goes into a checkpoint beside the engines' state."""

    step: int = 0
    saved_step: int = -1  # step of the newest checkpoint this process wrote or resumed from
    skips_total: int = 0  # optimizer steps skipped for a non-finite loss / grad norm (actor/skipped_steps)
    skips_consecutive: int = 0  # trainer steps in a row with a skipped optimizer step
    skipped_saves: list = field(default_factory=list)  # steps whose checkpoint did not fit (on_low_space=skip)


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
    with storage.section():
        if run.info.is_main:
            if probe is not None:
                print(f"sync check of the resumed weights: max |d log-prob| {probe:.2e}", flush=True)
            _after_resume(run, path, state.get("num_prompts"))


def _after_resume(run: Run, path: str, saved_prompts: int | None) -> None:
    """Rank 0: rows and events a killed run wrote after the checkpoint go (they are written again),
    and what changed since it is said."""
    dropped = 0
    with writing("metrics.jsonl (rows after the checkpoint removed)", run.logger.path):
        dropped = checkpoint.trim_metrics(run.cfg.trainer.output_dir, run.state.step)
    with writing("the tensorboard tracker's files (events after the checkpoint dropped)"):
        checkpoint.purge_tensorboard(run.logger, run.state.step)
    note = f"; dropped {dropped} metrics.jsonl row(s) written after it" if dropped else ""
    print(f"resumed from {path} at step {run.state.step}{note}", flush=True)
    if run.engines.policy.lr_schedule_changes:
        print(f"LR schedule follows this run's config from step {run.state.step} on, not the checkpoint's: "
              + "; ".join(run.engines.policy.lr_schedule_changes), flush=True)
    now = len(run.sampler.prompts.prompts)
    if saved_prompts is not None and saved_prompts != now:
        print(f"warning: the training data has {now} prompts, the checkpoint's run had {saved_prompts} (a file "
              f"changed, or rows skipped by data.skip_bad_rows since): the data order from here on is not the "
              f"one an uninterrupted run would have used", flush=True)


def record_validation(run: Run, step: int, metrics: dict, examples: list[dict]) -> None:
    """Every rank, after a validation: rank 0 writes the samples' file and the val/* row (every
    rank learns when that failed) and prints the console line."""
    with storage.section():
        if run.info.is_main:
            path = validation.write_examples(run.cfg.trainer.output_dir, step, examples)
            print(f"val step {step}: accuracy {metrics['val/accuracy']:.3f} | reward {metrics['val/reward_mean']:.3f}"
                  f" | len {metrics['val/response_len_mean']:.1f} | {int(metrics['val/num_prompts'])} prompts"
                  f" | {metrics['timing/val_s']:.1f} s | samples {path}", flush=True)
        run.logger.log(step, metrics)


def trainer_state(run: Run) -> dict:
    """What a checkpoint needs beyond the policy, optimizer, scheduler and RNG."""
    return {"step": run.state.step, "data": run.sampler.prompts.state_dict(), "sampling": run.sampler.state_dict(),
            "exploration": run.entropy.state_dict() if run.entropy is not None else {},
            "skips": {"total": run.state.skips_total, "consecutive": run.state.skips_consecutive},
            "num_prompts": len(run.sampler.prompts.prompts)}


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
            require_room(run, step)
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
        require_room(run, run.state.step)
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
    write the checkpoint and the HF exports due at this step, when they fit (``room``). Returns the
    step whose checkpoint ``commit_checkpoint`` must make current once the step's metrics row is
    written, or None."""
    c, out, step = run.cfg.checkpoint, run.cfg.trainer.output_dir, run.state.step
    last = step == run.cfg.trainer.total_steps
    save = checkpoint_due(step, run.cfg.trainer.total_steps, c.save_every)
    exports = ([os.path.join(out, "hf", f"step_{step}")] if c.hf_every and step % c.hf_every == 0 else []) \
        + ([os.path.join(out, "hf_final")] if last and c.save_hf_final else [])
    if not (save or exports) or not room(run, step, save, bool(exports)):
        return None
    pending = None
    if save:
        run.engines.switch.record_checkpoint(f"save step_{step}")
        checkpoint.write(run.engines.policy, out, step, trainer_state(run), run.info.rank, files=run_config.files(run.cfg))
        pending = step
    for path in exports:
        checkpoint.export_hf(run.engines.policy, path, c.hf_dtype, run.info.is_main, output_dir=out)
    return pending


def room(run: Run, step: int, save: bool, export: bool, on_low_space: str | None = None) -> bool:
    """Collective (an agreement point): whether this step's checkpoint and HF export fit in the free
    space of trainer.output_dir, each counted at its last size (the estimate before the first).
    Not: checkpoint.on_low_space=stop (or ``on_low_space``) ends the run (storage.StorageFailed),
    skip warns and returns False."""
    out = run.cfg.trainer.output_dir
    need = last_sizes(run, save, export) if run.info.is_main else 0
    what = " and ".join([f"checkpoint step_{step}"] * save + [f"the HF export of step {step}"] * export)
    short = storage.room_for(out, need, what, run.info.is_main)
    if short is None:
        return True
    if (on_low_space or run.cfg.checkpoint.on_low_space) == "stop":
        storage.mark_failed()
        raise storage.StorageFailed([], short)
    run.state.skipped_saves.append(step)
    if run.info.is_main:
        print(f"warning: skipping {what}: it needs about {storage.mb(short['need'])}, {storage.mb(short['free'])} is "
              f"free on {short['mount']} (checkpoint.on_low_space=skip); newest complete checkpoint: "
              f"{newest(run)}", file=sys.stderr, flush=True)
    return False


def newest(run: Run) -> str:
    """The checkpoint a restart resumes from, for the log."""
    found = checkpoint.find_resume(run.cfg.trainer.output_dir, "auto")
    if found is None and run.resume_from:
        return f"none in trainer.output_dir; this run resumed from {run.resume_from}"
    return found or "none"


def last_sizes(run: Run, save: bool, export: bool) -> int:
    """Rank 0: bytes of the newest complete checkpoint (this run's, or the one it resumed from;
    the estimate before there is one) and of an HF export (estimated: it has no manifest)."""
    try:
        ckpt, hf, _ = storage.estimate_bytes(run.cfg, run.info.world_size)
    except (OSError, ValueError, KeyError):  # no readable model folder: the start-up check said so already
        ckpt = hf = 0
    try:
        last = checkpoint.find_resume(run.cfg.trainer.output_dir, "auto") or run.resume_from
    except OSError:  # the folder cannot even be read: the write after this check says so
        last = None
    return (checkpoint.size(last) if save and last else ckpt * save) + hf * export


def require_room(run: Run, step: int) -> None:
    """Before a save on the way out (preemption, divergence): there is nothing to skip to."""
    room(run, step, True, False, on_low_space="stop")


def commit_checkpoint(run: Run, step: int | None) -> None:
    """Make the checkpoint written for ``step`` the one a resume takes (a checkpoint always has its
    metrics row: a run killed in between resumes from the previous one). Every step, also where
    none was written: the agreement point after the step's metrics row (rank 0's write)."""
    storage.agree()  # the row first: a checkpoint never becomes current without it
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
    with storage.section():  # the trackers' last events
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
    if run.state.skipped_saves:
        parts.append(f"checkpoints skipped for lack of space at steps {run.state.skipped_saves} (newest: "
                     f"{newest(run)})")
    curves = f"curves: python scripts/plot_metrics.py {out}"
    if run.logger.writer is not None or "tensorboard" in run.cfg.logging.enabled_trackers:
        curves += f" or tensorboard --logdir {os.path.join(out, 'tensorboard')}"
    return " | ".join(parts + [curves])


# ----------------------------------------------------------------------------- storage failures


@contextmanager
def ends_on_storage_failure(cfg: Config, info: DistInfo, stop: preempt.StopRequest, watchdog: preempt.Watchdog):
    """Around everything after preflight: a ``storage.StorageFailed`` (raised on every rank
    together) ends the run here. Yields a holder whose ``run`` the caller sets once it is built."""
    holder = SimpleNamespace(run=None)
    try:
        with storage.thread_failures("the run's files", cfg.trainer.output_dir):
            yield holder
    except storage.StorageFailed as failed:
        end_on_storage_failure(failed, cfg, info, holder.run, stop, watchdog)
    except StorageError as err:  # a rank's own write outside any agreement (the LoRA rollout's adapter folder)
        failed = storage.StorageFailed([storage.failure_record(err, info.rank)])
        end_on_storage_failure(failed, cfg, info, holder.run, stop, watchdog, alone=True)


def end_on_storage_failure(failed: storage.StorageFailed, cfg: Config, info: DistInfo, run: Run | None,
                           stop: preempt.StopRequest, watchdog: preempt.Watchdog, alone: bool = False) -> None:
    """Every rank: the message (rank 0, and the first failing rank of another node), the partial
    folders removed where there is room (rank 0), nothing more written, exit ``Exit.STORAGE``.
    ``alone``: only this rank knows (its failure was not agreed on): it says so itself, and the
    others end when torchrun ends them."""
    storage.mark_failed()  # a stop signal from here on writes nothing
    out = cfg.trainer.output_dir
    cleanup = remove_leftovers(out) if info.is_main else []
    if alone or storage.prints_message(failed.failures, info.rank):
        try:
            intact = checkpoint.find_resume(out, "auto")
        except (ConfigError, OSError):
            intact = None
        commands = storage.resume_commands(sys.argv[1:], out, intact, info.local_world_size,
                                           max(1, info.world_size // info.local_world_size))
        text = storage.message(failed, run.state.step if run else 0, out, intact, cleanup, commands)
        if stop.requested:
            text += "\n  a stop signal came too: nothing more was written for it"
        if alone:
            text += f"\n  only rank {info.rank} met it: the other ranks end when torchrun ends them"
        print(text, file=sys.stderr, flush=True)
    storage.print_tracebacks()
    watchdog.close()
    if run is not None:
        try:
            run.logger.close(quiet=True)
            judge.shutdown(run.engines.judges, exiting=True)
            distill.shutdown(run.engines.teacher, exiting=True)
            run.engines.rollout.shutdown(exiting=True)  # a LoRA engine's adapter folder in /dev/shm
        except Exception as e:  # the exit still comes
            print(f"rank {info.rank}: shutting the engines down failed ({type(e).__name__}: {e})", file=sys.stderr)
    exit_process(Exit.STORAGE)


def remove_leftovers(output_dir: str) -> list[str]:
    """Rank 0: remove what the failed save or export left (checkpoint.leftovers); the message's lines."""
    removed, left = [], []
    for path in checkpoint.leftovers(output_dir):
        try:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
            removed.append(os.path.basename(path))
        except OSError as e:
            left.append(f"{os.path.basename(path)} ({describe_errno(e.errno, e.strerror)})")
    lines = [f"removed the partial {', '.join(removed)}"] if removed else []
    if left:
        lines.append(f"left the partial {', '.join(left)}: a resume never loads it, the next save removes it")
    return lines
