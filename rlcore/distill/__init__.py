"""On-policy distillation: a teacher model scores every token the student samples, and the per-token
reverse KL is the learning signal, alone or beside the reward (``distill`` config section).

    config.py   the ``distill`` section (DistillConfig) and its checks: teacher folder, same tokenizer
    teacher.py  the teacher in the loop: score a step's samples, the advantage, distill/* metrics

The teacher's engine is a rollout engine (rlcore.colocate_rollout, wrapped by rlcore.rollout.teacher:
a judge engine that returns teacher-forced log-probs), asleep except while it scores; the math is rlcore.algo.distill.

May import: transformers (the tokenizer check), rlcore.rollout and rlcore.colocate_rollout (its
engine, built in ``build_teacher``), rlcore.algo and the ground floor. Not the config package: its
sections import this wing's.
"""

from __future__ import annotations


def build_teacher(cfg, info, policy_rollout, switch, timer):
    """rlcore.distill.teacher.Teacher for ``cfg.distill`` or None (collective: every rank builds the
    engine together, like the policy's), asleep once built. ``policy_rollout``: the policy's
    engine, asleep while the teacher's is built (vLLM sizes a new engine from the free memory)."""
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.distill.teacher import Teacher
    from rlcore.rollout.judge import default_offload, rollout_kwargs
    from rlcore.rollout.teacher import TeacherEngine

    d = cfg.distill
    if not d.enabled:
        return None
    policy_rollout.release_memory()
    rollout = ColocateRollout(d.path, info, **rollout_kwargs(
        d, info.device_type, seed=cfg.trainer.seed, dtype=d.dtype or cfg.rollout.dtype or cfg.model.dtype,
        tp_size=cfg.rollout.tensor_parallel_size,
        **({"limit_mm_per_prompt": cfg.rollout.limit_mm_per_prompt}  # image prompts: as the policy's
           if cfg.rollout.limit_mm_per_prompt is not None else {})))
    engine = TeacherEngine(d, rollout, offload=default_offload(info.device_type, cfg.rollout.emulate_sleep))
    engine.sleep()
    if policy_rollout.weights_valid:
        policy_rollout.resume_memory()
    return Teacher(d, engine, d.temperature or cfg.rollout.temperature, switch, timer,
                   tp_size=cfg.rollout.tensor_parallel_size)


def describe(teacher) -> str:
    e = teacher.engine
    asleep = "KV buffer freed" if e.offload == "kv" else f"level {e.sleep_level}"
    return (f"distillation: teacher {teacher.cfg.teacher} ({teacher.cfg.mode}, coef {teacher.cfg.coef:g}, "
            f"reward_weight {teacher.cfg.reward_weight:g}, temperature {teacher.temperature:g}; asleep: {asleep})")


def advantages(teacher, batch, reward_adv):
    """The loss's advantage: the reward's alone without a teacher; else see Teacher.advantages."""
    if teacher is None:
        return reward_adv, {}
    return teacher.advantages(batch, reward_adv)


def shutdown(teacher, exiting: bool = False) -> None:
    if teacher is not None:
        teacher.engine.shutdown(exiting)
