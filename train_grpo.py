"""Colocated GRPO: every rank runs this same program.

    torchrun --nproc_per_node=N train_grpo.py --config cfg.yaml [--section.key value ...]
    python train_grpo.py --help | --print_config | --print_resolved
"""

from __future__ import annotations

import gc

gc.disable()  # no collections while the stack imports and the engines build (rlcore.heap; main() settles)

from rlcore import heap, quiet  # noqa: E402

quiet.install()  # offline, quiet environment and warning filters: before the heavy imports

import sys  # noqa: E402
import time  # noqa: E402

from rlcore import agent, distill, judge  # noqa: E402
from rlcore.algo import grpo  # noqa: E402
from rlcore.algo.batch import advantages_for, rollout_metrics  # noqa: E402
from rlcore.algo.exploration import EntropyControl  # noqa: E402
from rlcore.config import Config, ConfigError, fail  # noqa: E402
from rlcore.config.cli import parse_config  # noqa: E402
from rlcore.dist import DistInfo, init_distributed, run_then_exit, torchrun_env  # noqa: E402
from rlcore.errors import Exit, deferred  # noqa: E402
from rlcore.run import preempt, storage  # noqa: E402
from rlcore.run.build import build_engines, loss_options  # noqa: E402
from rlcore.step import balance, validation  # noqa: E402
from rlcore.task.prompts import PromptSampler  # noqa: E402
from rlcore.run.lifecycle import (  # noqa: E402
    Run, commit_checkpoint, count_skips, ends_on_storage_failure, record_validation, resume,
    step_snapshot, stop_if_diverged, stop_preempted, teardown, write_due_checkpoint,
)
from rlcore.metrics import MetricsLogger, Timer  # noqa: E402
from rlcore.run.ownership import tie_to_launcher  # noqa: E402
from rlcore.run.preflight import preflight, prepare_scoring, resolve_image_limit  # noqa: E402
from rlcore.step.sampling import StepSampler, generation_seed, response_budget  # noqa: E402
from rlcore.step.sync_check import SyncMismatchError  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    tie_to_launcher(torchrun_env()[0])  # under torchrun: this rank ends when torchrun ends, however killed
    cfg = parse_config(argv)
    stop = preempt.StopRequest(cfg.trainer.preempt_grace_s).install()  # before the slow start-up
    info = init_distributed(cfg.parallel.device, cfg.parallel.timeout_s)
    stop.rank = info.rank
    watchdog = preempt.Watchdog(info.rank, cfg.trainer.watchdog_s, cfg.parallel.timeout_s)
    with ends_on_storage_failure(cfg, info, stop, watchdog) as ending:  # a failed write: one message, exit 74
        with watchdog.phase("build"):
            run = ending.run = build(cfg, info, stop, watchdog)
        heap.settle()  # what the build made lives for the run: out of the collector's walk, collector on
        run.started_at = started
        with watchdog.phase("resume"):
            resume(run)
        if stop.agreed():
            stop_preempted(run, None)
        if cfg.trainer.val_before_train:
            validate(run)
        loop(run)
        teardown(run)


def loop(run: Run) -> None:
    cfg, state, e, stop, watchdog = run.cfg, run.state, run.engines, run.stop, run.watchdog
    while state.step < cfg.trainer.total_steps:
        state.step += 1
        step_start = time.perf_counter()
        at_start = step_snapshot(run)  # the state of step - 1, should this step be abandoned
        with watchdog.phase("generate"):
            batch, scores, reward_metrics = run.sampler.sample(state.step)  # prompts -> generate -> score
            adv = advantages_for(batch, scores, cfg.algorithm, e.rollout.tp_size)  # (N, T)
            adv, distill_metrics = distill.advantages(e.teacher, batch, adv)  # the teacher scores every token
        if stop.agreed():  # phase boundary, collective: drop this step's samples, keep step - 1
            stop_preempted(run, at_start)
        batch, adv, scores = balance.for_training(e.rollout, batch, adv, scores, cfg, reward_metrics)  # TP slice
        with watchdog.phase("train"):
            e.switch.to_training()
            with run.timer("train"):
                train_metrics = grpo.train_on_batch(
                    e.policy, e.ref, batch, adv, run.entropy.algorithm(), cfg.rollout.temperature,
                    run.info.world_size, run.info.device, norm_len=response_budget(cfg.rollout),
                    **run.loss_options)  # rollout correction, Clip-Cov
        train_metrics.update(count_skips(run, train_metrics))
        train_metrics.update(run.entropy.after_step(train_metrics))  # the adaptive coefficient's next value
        with watchdog.phase("checkpoint"):
            saved = write_due_checkpoint(run)  # still in the train phase: vLLM asleep
        with watchdog.phase("weight_sync"):
            e.switch.to_generation()
        log_step(run, rollout_metrics(batch, scores, adv, {**reward_metrics, **distill_metrics, **train_metrics},
                                    run.info.world_size, e.rollout.tp_size), step_start)
        commit_checkpoint(run, saved)  # after its metrics row
        stop_if_diverged(run)
        if val_due(cfg.trainer, state.step):
            validate(run)
        if state.step < cfg.trainer.total_steps and stop.agreed():  # phase boundary, collective
            stop_preempted(run, None)


def build(cfg: Config, info: DistInfo, stop, watchdog) -> Run:
    """Everything cheap and checkable first (config, files, data), then the engines."""
    tokenizer, processor, prompts, resume_from = preflight(cfg, info.rank, info.world_size)
    scorer, val_prompts = prepare_scoring(cfg, tokenizer, info.rank, processor)
    cfg = resolve_image_limit(cfg, prompts, val_prompts)
    with storage.section():  # before the engines: rank 0 opens its files, every rank learns if that failed
        logger = MetricsLogger(cfg.trainer.output_dir, info.is_main, console_every=cfg.logging.console_every,
                               run_config=cfg, total_steps=cfg.trainer.total_steps,
                               trackers=cfg.logging.enabled_trackers, options=cfg.logging)
    timer = Timer()
    engines = build_engines(cfg, info, timer, probe_prompts=[p.ids for p in prompts[:64]])
    scorer.attach_judges(engines.judges, engines.switch.judging, timer)  # reward.models, if any
    tool_agent = agent.build_agent(cfg, tokenizer, engines.rollout)  # None: single-turn
    if info.is_main:
        described = [engines.policy, engines.ref, engines.rollout, engines.switch]
        print(*(x.describe() for x in described if x is not None), grpo.describe_train_phase(cfg.algorithm),
              *([agent.describe(tool_agent)] if tool_agent else []),
              *([judge.describe(engines.judges)] if engines.judges else []),
              *([distill.describe(engines.teacher)] if engines.teacher else []), sep="\n", flush=True)
    t = cfg.trainer
    sampler = StepSampler(engines.rollout, PromptSampler(prompts, cfg.data.seed, cfg.data.shuffle), tokenizer, scorer,
                          cfg.rollout, cfg.algorithm, t.prompts_per_step, t.seed, timer, processor, tool_agent,
                          switch=engines.switch)
    return Run(cfg, info, engines, sampler, logger, timer, stop, watchdog, resume_from=resume_from,
               val_prompts=val_prompts, entropy=EntropyControl(cfg.algorithm, cfg.exploration),
               loss_options=loss_options(cfg))


def log_step(run: Run, metrics: dict, step_start: float) -> None:
    metrics.update(run.timer.pop_metrics())
    metrics.update(run.engines.switch.pop_metrics())
    metrics["timing/step_s"] = time.perf_counter() - step_start
    metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / max(metrics.get("timing/generate_s", 0.0), 1e-9)
    with deferred():  # rank 0's row: a failed write is agreed on right after (commit_checkpoint)
        run.logger.log(run.state.step, metrics)


def val_due(t, step: int) -> bool:
    return bool(t.val_every) and (step % t.val_every == 0 or step == t.total_steps)


def validate(run: Run) -> None:
    """Every rank: generate on the validation set with the colocated engine (greedy pass@1, plus
    mean@n with sampling when val.n > 1), log val/* as a row of this step, write a few samples."""
    v, step = run.cfg.val, run.state.step
    settings = validation.ValSettings(
        n=v.n, temperature=v.temperature, top_p=v.top_p, max_samples=v.max_samples, num_examples=v.num_examples,
        max_tokens=v.max_response_length, seed=generation_seed(run.cfg.trainer.seed, step, validation=True))
    start = time.perf_counter()
    with run.watchdog.phase("validate"):
        metrics, examples = validation.validate(run.engines.rollout, run.sampler.tokenizer,
                                                run.sampler.scorer.for_validation, run.val_prompts, settings,
                                                run.sampler.agent, wake=run.engines.switch.ensure_generation)
    metrics["timing/val_s"] = time.perf_counter() - start
    record_validation(run, step, metrics, examples)  # rank 0: the samples' file, the console line, the row


def entry() -> None:
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    except SyncMismatchError as err:  # rollout.check_sync=strict; every rank raises it together
        fail(str(err), Exit.SYNC_MISMATCH)


if __name__ == "__main__":
    run_then_exit(entry)  # ends without the interpreter's finalization, where gloo can abort a finished run
