"""Conversion rules for DAPO's overlong shaping, on-policy distillation (``distillation.*`` ->
``distill.*``) and the partial-rollout recipe (verl 1dda039, verl-recipe); verl's reward itself is
rules_reward.py's."""

from __future__ import annotations

from rlcore.verl.keys import A
from rlcore.verl.rules import rule
from rlcore.verl.rules_train import OVERLONG, overlong_on


@rule({p + k: ("algorithm.overlong_" + ("buffer_len" if k != "penalty_factor" else "penalty_factor"),
               {"enable": "with verl's dapo reward manager: DAPO's overlong shaping (False or another manager: off)",
                "len": "DAPO overlong buffer: the penalty ramps over the last len tokens",
                "penalty_factor": "DAPO overlong penalty at the budget"}[k])
       for p in OVERLONG for k in ("enable", "len", "penalty_factor")}
      | {"reward.reward_kwargs.max_resp_len": ("rollout.max_response_length", "the budget the penalty ramps to: "
                                               "rollout.max_response_length here (another value: unmapped)"),
         "reward_model.reward_kwargs.max_resp_len": ("rollout.max_response_length", "as reward.reward_kwargs.max_resp_len")})
def overlong(c):
    prefix = overlong_on(c)
    used = [k for k in c.v if k.startswith(OVERLONG) and not k.endswith(".log")]
    used += [k for k in ("reward.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len") if c.given(k)]
    if prefix is None:
        for key in used:
            c.ignore(key, "verl applies it only with overlong_buffer_cfg.enable and the dapo reward manager")
        return
    budget = c.out["rollout.max_response_length"][0]
    max_key = "reward_model.reward_kwargs.max_resp_len" if prefix.startswith("reward_model.reward_kwargs") else \
        "reward.reward_kwargs.max_resp_len"
    # the recipe's older reward_model.overlong_buffer ramps to data.max_response_length
    max_len = c.integer("data.max_response_length") if prefix == "reward_model.overlong_buffer." else \
        c.integer(max_key, None)
    if max_len != budget:
        c.refuse(max_key, f"verl's penalty ramps to max_resp_len={max_len}; here to rollout.max_response_length="
                 f"{budget}: make them equal")
        return
    c.put("algorithm.overlong_buffer_len", c.integer(prefix + "len"), c.said(prefix + "len"), prefix + "len")
    c.put("algorithm.overlong_penalty_factor", float(c.get(prefix + "penalty_factor")), c.said(prefix + "penalty_factor"),
          prefix + "penalty_factor")
    for key in used:
        if not key.startswith(prefix) and key != max_key:
            c.ignore(key, f"verl reads the overlong settings at {prefix}* here")


TEACHER = "distillation.teacher_models."
LOSS = "distillation.distillation_loss."


@rule({"distillation.enabled": ("distill.teacher", "True: on-policy distillation from the one teacher set below"),
       TEACHER + "*": ("distill.*", "<name>.model_path -> distill.teacher, inference.gpu_memory_utilization / "
                       "max_model_len / temperature -> distill.*; several teachers: unmapped"),
       "distillation.teacher_key": ("(one teacher)", "which teacher scores a row: one teacher here"),
       LOSS + "*": ("distill.mode", "k1 + use_policy_gradient: reverse_kl (the advantage -(log p - log q)); "
                    "forward_kl_topk: topk with forward_kl (k <= 20); loss_max_clamp: distill.advantage_clamp")})
def distillation(c):
    keys = [k for k in c.v if k.startswith(("distillation.teacher", LOSS))]
    if not c.get("distillation.enabled"):
        for key in keys:
            c.ignore(key, "read by verl only with distillation.enabled=True")
        return
    teachers = sorted({k[len(TEACHER):].split(".")[0] for k in c.v if k.startswith(TEACHER) and k.endswith(".model_path")
                       and c.get(k)})
    if len(teachers) != 1:
        c.refuse("distillation.teacher_models", "one teacher per run here" if teachers else "no teacher model_path set",
                 ", ".join(teachers))
        return
    t = TEACHER + teachers[0] + "."
    c.put("distill.teacher", c.get(t + "model_path"), c.said(t + "model_path"), t + "model_path")
    for name, target in (("gpu_memory_utilization", "distill.gpu_memory_utilization"),
                         ("max_model_len", "distill.max_model_len"), ("temperature", "distill.temperature")):
        if c.given(t + "inference." + name):
            c.put(target, c.get(t + "inference." + name), c.said(t + "inference." + name), t + "inference." + name)
    for key in [k for k in keys if k.startswith(TEACHER) and k not in c.done and k in c.v]:
        if key.endswith((".name", "tensor_model_parallel_size", "num_replicas", ".key", "expert_parallel_size")):
            c.ignore(key, "the teacher's engine layout: it runs in-process beside the policy here")
    c.ignore("distillation.teacher_key", "one teacher here")
    _distill_loss(c)


def _distill_loss(c) -> None:
    mode, pg, task = c.get(LOSS + "loss_mode"), c.get(LOSS + "use_policy_gradient"), c.get(LOSS + "use_task_rewards")
    said = c.said(LOSS + "loss_mode") + ", " + c.said(LOSS + "use_policy_gradient")
    if mode in ("k1", "kl") and pg:  # verl: advantages = -clamp(k1) into a PPO loss (distillation/losses.py:268-283)
        c.put("distill.mode", "reverse_kl", said, LOSS + "loss_mode")
        if c.get(LOSS + "loss_max_clamp") is not None:
            c.put("distill.advantage_clamp", float(c.get(LOSS + "loss_max_clamp")), c.said(LOSS + "loss_max_clamp"),
                  LOSS + "loss_max_clamp")
        for side in ("low", "high"):
            if c.get(LOSS + f"clip_ratio_{side}") != c.get(A + f"clip_ratio_{side}"):
                c.refuse(LOSS + f"clip_ratio_{side}", "verl clips the distillation loss with its own ratio bounds; one "
                         "PPO clip here (algorithm.clip_low/high): make them equal")
        c.ignore(LOSS + "log_prob_min_clamp", "read by verl's top-k losses only")
    elif mode == "forward_kl_topk" and not pg and c.integer(LOSS + "topk") <= 20:
        c.put("distill.mode", "topk", said, LOSS + "loss_mode")
        c.put("distill.divergence", "forward_kl", c.said(LOSS + "loss_mode"), LOSS + "loss_mode")
        c.put("distill.topk", c.integer(LOSS + "topk"), c.said(LOSS + "topk"), LOSS + "topk")
        for key in (LOSS + "loss_max_clamp", LOSS + "log_prob_min_clamp"):
            if c.get(key) is not None:
                c.refuse(key, "the top-k divergence is not clamped here")
    elif mode == "forward_kl_topk" and not pg:
        c.refuse(LOSS + "topk", "vLLM returns at most 20 log-probs per position (max_logprobs): distill.topk <= 20")
        return
    else:
        c.refuse(LOSS + "loss_mode", f"{mode} with use_policy_gradient={pg}: here k1 as a policy-gradient advantage "
                 "(reverse_kl) or forward_kl_topk as a loss (topk)")
        return
    if task:
        c.refuse(LOSS + "use_task_rewards", "verl adds the task's PPO loss and the distillation loss apart; here one "
                 "combined advantage (distill.reward_weight)")
    else:
        c.put("distill.reward_weight", 0.0, c.said(LOSS + "use_task_rewards"), LOSS + "use_task_rewards")
    c.put("distill.coef", 1.0, "distillation_loss_coef applies with use_task_rewards only (losses.py:221-223)",
          LOSS + "distillation_loss_coef")


@rule({"async_training.partial_rollout": ("rollout.partial.enable", "the partial-rollout recipe: long responses "
                                          "continue in later steps (rollout.partial, docs/partial_rollouts.md)")})
def partial_rollout(c):
    if c.get("async_training.partial_rollout") and c.entry == "recipe.partial_rollout.main_ppo":
        c.put("rollout.partial.enable", True, c.said("async_training.partial_rollout") + " (recipe.partial_rollout)",
              "async_training.partial_rollout")
    elif c.get("async_training.partial_rollout"):
        c.refuse("async_training.partial_rollout", "verl's fully asynchronous trainer's partial rollouts")
    else:
        c.ignore("async_training.partial_rollout", "False: off")
