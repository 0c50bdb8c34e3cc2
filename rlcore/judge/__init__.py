"""Model-based rewards: judges served by in-process vLLM engines beside the policy's.

    config.py   reward.models entries (JudgeConfig) and their checks
    prompts.py  templates over the sample and its data row; score parsers
    scorer.py   a judge as a reward component (batched, de-duplicated, parsed, metrics)

A judge's engine is a rollout engine (rlcore.colocate_rollout) wrapped by rlcore.rollout.judge
(JudgeEngine) and its sleep on accelerators, rlcore.rollout.offload. Its memory-plan pieces are in rlcore.plan.

May import: transformers (a tokenizer for the templates), rlcore.task (rows, rewards), rlcore.rollout
and rlcore.colocate_rollout (its engine, built in ``build_judges``) and the ground floor. Not VeOmni.

The phase switch (rlcore.step.switch.PhaseSwitcher.judging) orders the memory: generate -> the
policy's engine sleeps -> the judges wake -> score -> the judges sleep -> train.
"""

from __future__ import annotations


def build_judges(cfg, info, policy_rollout=None) -> dict:
    """name -> rlcore.judge.scorer.Judge for ``reward.models`` (collective: every rank builds each
    engine together, like the policy's); each engine asleep once built. ``policy_rollout``: the
    policy's engine, asleep while they are built (vLLM sizes a new engine from the free memory)."""
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.judge.scorer import Judge
    from rlcore.rollout.judge import JudgeEngine, default_offload, rollout_kwargs

    judges, entries = {}, cfg.reward.judges()
    if entries and policy_rollout is not None:
        policy_rollout.release_memory()
    for j in entries:
        rollout = ColocateRollout(j.path, info, **rollout_kwargs(
            j, info.device_type, seed=cfg.trainer.seed, dtype=j.dtype or cfg.rollout.dtype or cfg.model.dtype,
            tp_size=j.tensor_parallel_size or cfg.rollout.tensor_parallel_size))
        engine = JudgeEngine(j, rollout, offload=default_offload(info.device_type, cfg.rollout.emulate_sleep))
        engine.sleep()
        judges[j.name] = Judge(j, engine, cfg.data.prompt_key, seed=cfg.trainer.seed)
    if entries and policy_rollout is not None and policy_rollout.weights_valid:
        policy_rollout.resume_memory()
    # After a level-2 sleep the policy's weights are gone: it stays asleep, and the phase switch's
    # ensure_generation (before the first generate, validation included) refills it from the trainer.
    return judges


def describe(judges: dict) -> str:
    parts = [f"{j.name} ({j.cfg.kind}, {j.cfg.path}, asleep: "
             f"{'KV buffer freed' if j.engine.offload == 'kv' else f'level {j.engine.sleep_level}'})"
             for j in judges.values()]
    return "judges: " + ", ".join(parts)


def shutdown(judges: dict, exiting: bool = False) -> None:
    for j in judges.values():
        j.engine.shutdown(exiting)
