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

import torch  # noqa: E402

from rlcore import grpo, preempt, validation  # noqa: E402
from rlcore.config import Config, ConfigError, fail, parse_config  # noqa: E402
from rlcore.data import PromptSampler  # noqa: E402
from rlcore.dist import DistInfo, all_reduce_sum, init_distributed  # noqa: E402
from rlcore.lifecycle import (  # noqa: E402
    Run, inject_test_nan, inject_test_signal, count_skips, maybe_save, resume, step_snapshot,
    stop_if_diverged, stop_preempted, teardown,
)
from rlcore.metrics import MetricsLogger, Timer  # noqa: E402
from rlcore.preflight import prepare_scoring, preflight  # noqa: E402


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
            inject_test_signal(run)
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


def _optim_steps_per_step(cfg: Config) -> int:
    return cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches


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
            batch = generate(run, next_prompts(run), round_)
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


def generate(run: Run, prompts: list, round_: int = 0) -> grpo.RolloutBatch:
    r = run.cfg.rollout
    # Per step (reproducible across a resume) and per dynamic-sampling round: a round that reused
    # the step's seed would draw the same random stream for its new prompts.
    seed = run.cfg.trainer.seed * 1_000_003 + run.step + round_ * 2**62
    with run.timer("generate"):
        out = run.rollout.generate([p.ids for p in prompts], n=r.n, temperature=r.temperature,
                                   top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_response_length, seed=seed)
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
    adv = inject_test_nan(run, adv)
    with run.timer("train"):
        on_policy = a.ppo_epochs == 1 and a.mini_batches == 1
        old = None if on_policy else grpo.compute_logprobs_in_chunks(run.policy, batch, temp, a.micro_batch_size, dev)
        ref = None
        if run.ref is not None:
            ref = grpo.compute_logprobs_in_chunks(run.ref, batch, temp, a.micro_batch_size, dev)
        return grpo.ppo_update(run.policy, batch, adv.to(dev), old, ref, a, temp, run.info.world_size, dev,
                               norm_len=run.cfg.rollout.max_response_length)


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


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
