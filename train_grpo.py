"""Colocated GRPO: every rank runs this same program.

    torchrun --nproc_per_node=N train_grpo.py --config cfg.yaml [--section.key value ...]
"""

from __future__ import annotations

import os

for _key, _value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
    "VEOMNI_VERBOSITY": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
    # No network at run time: vLLM otherwise posts usage statistics to stats.vllm.ai from its workers.
    "HF_DATASETS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_key, _value)

import sys  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from rlcore import checkpoint, grpo, preempt, rewards, validation  # noqa: E402
from rlcore.config import Config, ConfigError, fail, parse_config, validate_against_world  # noqa: E402
from rlcore.data import PromptSampler, load_prompts  # noqa: E402
from rlcore.dist import DistInfo, all_reduce_sum, init_distributed  # noqa: E402
from rlcore.metrics import MetricsLogger, Timer  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    stop = preempt.StopRequest(cfg.trainer.preempt_grace_s).install()  # before the slow start-up
    info = init_distributed(cfg.parallel.device, cfg.parallel.timeout_s)
    stop.rank = info.rank
    watchdog = preempt.Watchdog(info.rank, cfg.trainer.watchdog_s, cfg.parallel.timeout_s)
    with watchdog.phase("build"):
        run = build(cfg, info)
    run.stop, run.watchdog = stop, watchdog
    with watchdog.phase("resume"):
        resume(run)
    if stop.agreed():
        stop_preempted(run, None)
    if cfg.trainer.val_before_train:
        validate(run)
    while run.step < cfg.trainer.total_steps:
        run.step += 1
        step_start = time.perf_counter()
        at_start = step_snapshot(run)  # the state of step - 1, should this step be abandoned
        with watchdog.phase("generate"):
            batch, scores, reward_metrics = sample_batch(run)  # prompts -> generate -> score (DAPO refills)
            adv = grpo.advantages_for(batch, scores, cfg.algorithm)  # (N, T)
            _test_fault_signal(run)
        if stop.agreed():  # phase boundary, collective: drop this step's samples, keep step - 1
            stop_preempted(run, at_start)
        batch, adv, scores = shard_for_training(run, batch, adv, scores)
        with watchdog.phase("train"):
            run.switch.to_training()
            train_metrics = train(run, batch, adv)
        with watchdog.phase("weight_sync"):
            run.switch.to_generation()
        train_metrics.update(count_skips(run, train_metrics))
        log_step(run, batch, scores, adv, {**reward_metrics, **train_metrics}, step_start)
        with watchdog.phase("checkpoint"):
            maybe_save(run)
        stop_if_diverged(run)
        if val_due(run):
            validate(run)
        if run.step < cfg.trainer.total_steps and stop.agreed():  # phase boundary, collective
            stop_preempted(run, None)
    teardown(run)


def build(cfg: Config, info: DistInfo) -> Run:
    """Everything cheap and checkable first (config, files, data), then the two engines."""
    tokenizer, prompts, resume_from = preflight(cfg, info.rank, info.world_size)
    scorer, val_prompts = prepare_scoring(cfg, tokenizer, info.rank)
    if cfg.rollout.weight_load == "direct" and info.device_type == "cpu":
        fail("rollout.weight_load='direct' is invalid: vLLM repacks linear weights on CPU, so "
             "model.load_weights fails there; use auto or reload")
    torch.manual_seed(cfg.trainer.seed)
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.engine_veomni import VeOmniPolicy
    from rlcore.switch import PhaseSwitcher

    o = cfg.optim
    policy = VeOmniPolicy(
        cfg.model.path, info, dtype=cfg.model.dtype, gradient_checkpointing=cfg.model.gradient_checkpointing,
        attn_implementation=cfg.model.attn_implementation, lr=o.lr, weight_decay=o.weight_decay,
        betas=tuple(o.betas), adam_eps=o.eps, lr_schedule=o.lr_schedule, warmup_steps=o.warmup_steps,
        min_lr_ratio=o.min_lr_ratio, total_steps=cfg.trainer.total_steps * _optim_steps_per_step(cfg),
        grad_clip=o.grad_clip)
    ref = None
    if cfg.algorithm.kl_loss_coef > 0:
        ref = VeOmniPolicy(cfg.model.path, info, dtype=cfg.model.dtype, trainable=False,
                           attn_implementation=cfg.model.attn_implementation)
    r = cfg.rollout
    rollout = ColocateRollout(
        cfg.model.path, info, tp_size=r.tensor_parallel_size, seed=cfg.trainer.seed,
        max_model_len=r.max_model_len, dtype=cfg.model.dtype, kv_cache_gb=r.kv_cache_gb,
        gpu_memory_utilization=r.gpu_memory_utilization, sleep_level=r.sleep_level, weight_load=r.weight_load)
    timer = Timer()
    offload_params, offload_optimizer = cfg.offload.resolve(info.device_type)
    switch = PhaseSwitcher(policy, rollout, timer, info.device_type, offload_params=offload_params,
                           offload_optimizer=offload_optimizer, free_kv_cache=r.free_kv_cache,
                           rollout_dtype=cfg.model.dtype, sync_bucket_mb=r.sync_bucket_mb, rank=info.rank)
    if cfg.logging.switch_trace:
        switch.trace_to_stderr()
    if info.is_main:
        print(switch.describe(), flush=True)
    logger = MetricsLogger(cfg.trainer.output_dir, info.is_main, cfg.logging.tensorboard,
                           cfg.logging.console_every)
    sampler = PromptSampler(prompts, cfg.data.seed, cfg.data.shuffle)
    return Run(cfg, info, tokenizer, sampler, policy, ref, rollout, switch, timer, logger, resume_from=resume_from,
               scorer=scorer, val_prompts=val_prompts)


def preflight(cfg: Config, rank: int, world_size: int):
    """Every check that needs no model, on every rank: config against the world size, files, the
    checkpoint to resume, the tokenizer, every data row. A mistake exits with code 2 here."""
    try:
        validate_against_world(cfg, world_size)
        resume_from = checkpoint.find_resume(cfg.trainer.output_dir, cfg.checkpoint.resume)
        if resume_from is not None:
            checkpoint.validate_resume(resume_from, rank, world_size)
        tokenizer = load_tokenizer(cfg.model.path)
        prompts, stats = load_prompts(cfg.data.train_files, cfg.data, tokenizer)
    except ConfigError as e:
        fail(str(e))
    if rank == 0:
        print(f"train data: {stats['data/prompts']} prompts ({stats['data/bad_rows']} bad rows skipped, "
              f"{stats['data/filtered_too_long']} over data.max_prompt_length filtered)", flush=True)
    return tokenizer, prompts, resume_from


def prepare_scoring(cfg: Config, tokenizer, rank: int):
    """The reward scorer and the tokenized validation prompts (None without data.val_files)."""
    try:
        scorer = rewards.Scorer(cfg.reward)
        val_prompts = load_prompts(cfg.data.val_files, cfg.data, tokenizer)[0] if cfg.data.val_files else None
    except (ConfigError, ValueError) as e:
        fail(str(e))
    if rank == 0 and val_prompts:
        print(f"validation data: {len(val_prompts)} prompts", flush=True)
    return scorer, val_prompts


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    fix = "the folder needs the model's tokenizer files (tokenizer.json and tokenizer_config.json)"
    # transformers 5 builds an empty tokenizer (vocabulary of 1) from a folder without these files.
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer there; {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer loads from it ({type(e).__name__}); {fix}") from e
    if len(tokenizer) < 2:
        raise ConfigError(f"model.path={path!r} is invalid: its tokenizer has an empty vocabulary; {fix}")
    return tokenizer


def _optim_steps_per_step(cfg: Config) -> int:
    return cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches


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


def sample_batch(run: Run) -> tuple[grpo.RolloutBatch, torch.Tensor, dict]:
    """One step's samples for this replica. With DAPO dynamic sampling, groups whose rewards are
    all equal are dropped and more prompts are sampled (at most max_sampling_rounds rounds, in
    lockstep over all replicas); a replica still short then pads with dropped groups masked out."""
    a = run.cfg.algorithm
    batch = generate(run, next_prompts(run))
    scores, metrics = score(run, batch)
    if not a.dynamic_sampling:
        return batch, scores, metrics
    n, target = batch.group_size, len(batch) // batch.group_size
    kept, dropped, seen = [], [], 0
    for round_ in range(a.max_sampling_rounds):
        if round_ > 0:
            batch = generate(run, next_prompts(run))
            scores, _ = score(run, batch)
        good = set(grpo.informative_groups(scores, n))
        seen += len(scores) // n
        for g in range(len(scores) // n):
            (kept if g in good else dropped).append((batch.select(list(range(g * n, (g + 1) * n))),
                                                     scores[g * n: (g + 1) * n]))
        short, total_seen, total_kept = all_reduce_sum([float(len(kept) < target), seen, len(kept)])
        if short == 0:
            break
    for part, _ in dropped[: max(0, target - len(kept))]:
        part.keep = [0.0] * len(part)
    chosen = (kept + dropped)[:target]
    metrics["rollout/filtered_groups_frac"] = 1.0 - total_kept / max(total_seen, 1)
    metrics["rollout/sampling_rounds"] = round_ + 1
    return grpo.concat([b for b, _ in chosen]), torch.cat([s for _, s in chosen]), metrics


def next_prompts(run: Run) -> list:
    """This rollout replica's share of the step's global prompt batch."""
    dp_rank, dp_size = run.rollout.dp_rank, run.rollout.dp_size
    batch = run.sampler.next_batch(run.cfg.trainer.prompts_per_step)
    per = len(batch) // dp_size
    return batch[dp_rank * per: (dp_rank + 1) * per]


def generate(run: Run, prompts: list) -> grpo.RolloutBatch:
    r = run.cfg.rollout
    with run.timer("generate"):
        out = run.rollout.generate([p.ids for p in prompts], n=r.n, temperature=r.temperature,
                                   top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_response_length,
                                   seed=run.cfg.trainer.seed * 1_000_003 + run.step)
    flat = [(p, s) for p, samples in zip(prompts, out) for s in samples]
    return grpo.RolloutBatch(
        prompt_ids=[p.ids for p, _ in flat], response_ids=[s.response_ids for _, s in flat],
        rollout_logp=[s.logprobs for _, s in flat], answers=[p.answer for p, _ in flat],
        finish_reasons=[s.finish_reason for _, s in flat], group_size=r.n)


def score(run: Run, batch: grpo.RolloutBatch) -> tuple[torch.Tensor, dict]:
    """Rule-based rewards (N,), then DAPO overlong shaping / truncation masking when configured."""
    with run.timer("reward"):
        texts = run.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        values, metrics = run.scorer.score(texts, batch.answers)
        shaped, shape_metrics = grpo.shape_rewards(torch.tensor(values, dtype=torch.float32), batch,
                                                   run.cfg.algorithm, run.cfg.rollout.max_response_length)
    return shaped, {**metrics, **shape_metrics}


def shard_for_training(run: Run, batch: grpo.RolloutBatch, adv: torch.Tensor, scores: torch.Tensor):
    """Ranks of one TP group hold the same samples: each trains on (and logs) its own slice."""
    tp, tp_rank = run.rollout.tp_size, run.rollout.tp_rank
    if tp == 1:
        return batch, adv, scores
    per = len(batch) // tp
    idx = list(range(tp_rank * per, (tp_rank + 1) * per))
    return batch.select(idx), adv[idx], scores[idx]


def train(run: Run, batch: grpo.RolloutBatch, adv: torch.Tensor) -> dict[str, float]:
    a, dev, temp = run.cfg.algorithm, run.info.device, run.cfg.rollout.temperature
    adv = _test_fault_nan(run, adv)
    with run.timer("train"):
        on_policy = a.ppo_epochs == 1 and a.mini_batches == 1
        old = None if on_policy else grpo.compute_logprobs_in_chunks(run.policy, batch, temp, a.micro_batch_size, dev)
        ref = None
        if run.ref is not None:
            ref = grpo.compute_logprobs_in_chunks(run.ref, batch, temp, a.micro_batch_size, dev)
        return grpo.ppo_update(run.policy, batch, adv.to(dev), old, ref, a, temp, run.info.world_size, dev,
                               norm_len=run.cfg.rollout.max_response_length)


def _test_fault_nan(run: Run, adv: torch.Tensor) -> torch.Tensor:
    """Testing hook: RLCORE_TEST_NAN_STEPS=2,3 makes the last rank's loss NaN at those steps."""
    steps = os.environ.get("RLCORE_TEST_NAN_STEPS", "")
    if str(run.step) in steps.split(",") and run.info.rank == run.info.world_size - 1:
        return adv * float("nan")
    return adv


def _test_fault_signal(run: Run) -> None:
    """Testing hook: RLCORE_TEST_SIGNAL_STEP=N makes the last rank send itself SIGUSR1 during step N's
    generation phase (a preemption that lands mid-step, deterministically)."""
    if os.environ.get("RLCORE_TEST_SIGNAL_STEP") == str(run.step) and run.info.rank == run.info.world_size - 1:
        import signal

        os.kill(os.getpid(), signal.SIGUSR1)


def log_step(run: Run, batch, scores, adv, metrics: dict, step_start: float) -> None:
    """Global (all-rank) statistics of the step's samples, then one row to every sink."""
    mask = batch.response_mask()
    lens = [len(r) for r in batch.response_ids]
    local = [scores.sum().item(), (scores ** 2).sum().item(), len(scores), sum(lens),
             float(sum(f == "length" for f in batch.finish_reasons)), mask.sum().item(),
             (adv * mask).sum().item(), (adv ** 2 * mask).sum().item()]
    s, s2, cnt, ntok, trunc, ntok_loss, a1, a2 = all_reduce_sum(local)
    # Per-rank means of equal-sized shares: their average is the global mean.
    keys = sorted(k for k in metrics if k.startswith(("reward/", "rollout/filtered")))
    world = run.info.world_size
    metrics.update({k: v / world for k, v in zip(keys, all_reduce_sum([metrics[k] for k in keys]))})
    if "reward/errors" in metrics:  # a count: the sum over replicas (TP ranks score the same samples)
        metrics["reward/errors"] *= world / run.rollout.tp_size
    mean, a_mean = s / cnt, a1 / max(ntok_loss, 1)
    metrics.update({
        "reward/mean": mean, "reward/std": max(s2 / cnt - mean ** 2, 0.0) ** 0.5,
        "rollout/response_len_mean": ntok / cnt, "rollout/truncated_frac": trunc / cnt,
        "advantage/mean": a_mean, "advantage/std": max(a2 / max(ntok_loss, 1) - a_mean ** 2, 0.0) ** 0.5,
    })
    metrics.update(run.timer.pop_metrics())
    metrics.update(run.switch.pop_metrics())
    metrics["timing/step_s"] = time.perf_counter() - step_start
    metrics["perf/tokens_per_s"] = ntok / max(metrics.get("timing/generate_s", 0.0), 1e-9)  # all ranks
    run.logger.log(run.step, metrics)


def val_due(run: Run) -> bool:
    every = run.cfg.trainer.val_every
    return bool(every) and (run.step % every == 0 or run.step == run.cfg.trainer.total_steps)


def validate(run: Run) -> None:
    """Every rank: generate on the validation set with the colocated engine (greedy pass@1, plus
    mean@n with sampling when val.n > 1), log val/* as a row of this step, write a few samples."""
    v = run.cfg.val
    settings = validation.ValSettings(
        n=v.n, temperature=v.temperature, top_p=v.top_p, max_samples=v.max_samples, num_examples=v.num_examples,
        max_tokens=v.max_response_length or run.cfg.rollout.max_response_length,
        seed=run.cfg.trainer.seed * 1_000_003 + 500_009 + run.step)  # apart from the training seeds
    start = time.perf_counter()
    with run.watchdog.phase("validate") if run.watchdog is not None else nullcontext():
        metrics, examples = validation.validate(run.rollout, run.tokenizer, run.scorer, run.val_prompts, settings)
    metrics["timing/val_s"] = time.perf_counter() - start
    if run.info.is_main:
        path = validation.write_examples(run.cfg.trainer.output_dir, run.step, examples)
        print(f"val step {run.step}: accuracy {metrics['val/accuracy']:.3f} | reward {metrics['val/reward_mean']:.3f}"
              f" | len {metrics['val/response_len_mean']:.1f} | {int(metrics['val/num_prompts'])} prompts"
              f" | {metrics['timing/val_s']:.1f} s | samples {path}", flush=True)
    run.logger.log(run.step, metrics)


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


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
