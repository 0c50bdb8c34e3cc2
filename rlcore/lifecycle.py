"""The run's state and its lifecycle around the loop: resume, checkpoints (periodic, on preemption,
after divergence), skipped-step accounting, fault-injection hooks for tests, and teardown."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from rlcore import checkpoint, preempt, rewards
from rlcore.config import Config
from rlcore.data import PromptSampler
from rlcore.dist import DistInfo
from rlcore.metrics import MetricsLogger, Timer


@dataclass
class Run:
    cfg: Config
    info: DistInfo
    tokenizer: object
    sampler: PromptSampler
    policy: object
    ref: object | None
    rollout: object
    switch: object
    timer: Timer
    logger: MetricsLogger
    step: int = 0
    resume_from: str | None = None  # checkpoint folder found and checked before any model loaded
    saved_step: int = -1  # step of the newest checkpoint this process wrote or resumed from
    skips_total: int = 0  # optimizer steps skipped for a non-finite loss / grad norm (actor/skipped_steps)
    skips_consecutive: int = 0  # trainer steps in a row with a skipped optimizer step
    stop: preempt.StopRequest | None = None
    watchdog: preempt.Watchdog | None = None
    scorer: rewards.Scorer | None = None  # cfg.reward made callable (custom fn imported once)
    val_prompts: list | None = None  # data.val_files, tokenized


def resume(run: Run) -> None:
    path = run.resume_from
    if path is None:
        if run.info.is_main:
            print(f"starting fresh (checkpoint.resume={run.cfg.checkpoint.resume}: no checkpoint to resume)", flush=True)
        return
    state = checkpoint.load(run.policy, path, run.info.rank)
    run.step = run.saved_step = state["step"]
    run.sampler.load_state_dict(state["data"])
    skips = state.get("skips", {})
    run.skips_total, run.skips_consecutive = skips.get("total", 0), skips.get("consecutive", 0)
    run.switch.phase = "training"
    run.switch.to_generation()  # the engine still holds the initial weights: push the resumed ones
    if run.info.is_main:
        # Rows and events a killed run wrote after this checkpoint are written again below.
        dropped = checkpoint.trim_metrics(run.cfg.trainer.output_dir, run.step)
        checkpoint.purge_tensorboard(run.logger, run.step)
        note = f"; dropped {dropped} metrics.jsonl row(s) written after it" if dropped else ""
        print(f"resumed from {path} at step {run.step}{note}", flush=True)
        if run.policy.lr_schedule_changes:
            print(f"LR schedule follows this run's config from step {run.step} on, not the checkpoint's: "
                  + "; ".join(run.policy.lr_schedule_changes), flush=True)


def trainer_state(run: Run) -> dict:
    """What a checkpoint needs beyond the policy, optimizer, scheduler and RNG."""
    return {"step": run.step, "data": run.sampler.state_dict(),
            "skips": {"total": run.skips_total, "consecutive": run.skips_consecutive}}


def step_snapshot(run: Run) -> dict:
    """The state at the start of a step (= the end of step - 1): cheap, taken every step."""
    run.step -= 1
    state = trainer_state(run)
    run.step += 1
    return {"step": run.step - 1, "trainer": state, "rng": checkpoint.rng_state()}


def stop_preempted(run: Run, at_start: dict | None) -> None:
    """Every rank, after a collective stop decision: checkpoint the last complete step (unless that
    is saved already), then exit with EXIT_PREEMPTED. ``at_start``: the current step is abandoned."""
    step = run.step if at_start is None else at_start["step"]
    if step > 0 and run.saved_step != step:
        state, rng = (trainer_state(run), None) if at_start is None else (at_start["trainer"], at_start["rng"])
        with run.watchdog.phase("checkpoint"):
            checkpoint.save(run.policy, run.cfg.trainer.output_dir, step, state, run.info.rank,
                            run.cfg.checkpoint.keep_last, rng=rng)
        run.saved_step = step
    run.stop.cancel_deadline()
    since = run.stop.seconds_since_signal()
    origin = f"{since:.1f} s after the signal reached this rank" if since is not None else "signal on another rank"
    saved = f"checkpoint step_{step} is complete" if step > 0 else "no step completed, nothing to save"
    print(f"rank {run.info.rank}: preempted at step {step} ({origin}); {saved}; exiting with code "
          f"{preempt.EXIT_PREEMPTED} (resume with checkpoint.resume=auto)", file=sys.stderr, flush=True)
    # The grace period is short: skip the engine shutdown and interpreter teardown (~10 s on CPU).
    # The checkpoint ended with a barrier, logs are flushed, and no collective follows.
    run.watchdog.close()
    run.logger.close()
    sys.stdout.flush()
    os._exit(preempt.EXIT_PREEMPTED)


def count_skips(run: Run, metrics: dict) -> dict:
    """The engine skipped the optimizer step on a non-finite grad norm (global, so every rank agrees)."""
    skipped = int(metrics.get("actor/skipped", 0))
    run.skips_total += skipped
    run.skips_consecutive = run.skips_consecutive + 1 if skipped else 0
    if skipped and run.info.is_main:
        print(f"step {run.step}: non-finite loss or grad norm (actor/grad_norm={metrics.get('actor/grad_norm')}); "
              f"{skipped} optimizer step(s) skipped, {run.skips_consecutive} step(s) in a row "
              f"(trainer.max_consecutive_skips={run.cfg.trainer.max_consecutive_skips})", file=sys.stderr, flush=True)
    return {"actor/skipped_steps": run.skips_total}


def stop_if_diverged(run: Run) -> None:
    """After max_consecutive_skips skipped steps: checkpoint (model and optimizer are those of the last
    good update, as skipped steps change neither) and exit with EXIT_NON_FINITE."""
    limit = run.cfg.trainer.max_consecutive_skips
    if run.skips_consecutive < limit:
        return
    if run.saved_step != run.step:
        checkpoint.save(run.policy, run.cfg.trainer.output_dir, run.step, trainer_state(run), run.info.rank,
                        run.cfg.checkpoint.keep_last)
        run.saved_step = run.step
    if run.info.is_main:
        print(f"error: training stopped at step {run.step}: {limit} steps in a row had a non-finite loss or "
              f"gradient norm (trainer.max_consecutive_skips={limit}), and their optimizer steps were skipped. "
              f"Checkpoint step_{run.step} holds the model and optimizer of the last good update. Lower optim.lr, "
              f"check rewards and data for NaN/inf, or raise trainer.max_consecutive_skips, then resume with "
              f"checkpoint.resume=auto.", file=sys.stderr, flush=True)
    teardown(run)
    raise SystemExit(preempt.EXIT_NON_FINITE)


def maybe_save(run: Run) -> None:
    c, out, step = run.cfg.checkpoint, run.cfg.trainer.output_dir, run.step
    last = step == run.cfg.trainer.total_steps
    if last or (c.save_every and step % c.save_every == 0):
        path = checkpoint.save(run.policy, out, step, trainer_state(run), run.info.rank, c.keep_last)
        run.saved_step = step
        if run.info.is_main:
            print(f"saved checkpoint {path}", flush=True)
    if c.hf_every and step % c.hf_every == 0:
        checkpoint.export_hf(run.policy, os.path.join(out, "hf", f"step_{step}"), c.hf_dtype, run.info.is_main)
    if last and c.save_hf_final:
        checkpoint.export_hf(run.policy, os.path.join(out, "hf_final"), c.hf_dtype, run.info.is_main)


def teardown(run: Run) -> None:
    import torch.distributed as dist

    if run.watchdog is not None:
        run.watchdog.close()
    run.logger.close()
    run.rollout.shutdown()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def inject_test_nan(run: Run, adv: torch.Tensor) -> torch.Tensor:
    """Testing hook: RLCORE_TEST_NAN_STEPS=2,3 makes the last rank's loss NaN at those steps."""
    steps = os.environ.get("RLCORE_TEST_NAN_STEPS", "")
    if str(run.step) in steps.split(",") and run.info.rank == run.info.world_size - 1:
        return adv * float("nan")
    return adv


def inject_test_signal(run: Run) -> None:
    """Testing hook: RLCORE_TEST_SIGNAL_STEP=N makes the last rank send itself SIGUSR1 during step N's
    generation phase (a preemption that lands mid-step, deterministically)."""
    if os.environ.get("RLCORE_TEST_SIGNAL_STEP") == str(run.step) and run.info.rank == run.info.world_size - 1:
        import signal

        os.kill(os.getpid(), signal.SIGUSR1)

