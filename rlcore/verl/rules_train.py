"""Conversion rules for what is trained: the estimator, the policy loss and its aggregation, the KL
loss, the optimizer and its schedule, LoRA, routing replay, rollout correction, DAPO (dynamic
sampling, overlong shaping), on-policy distillation and partial rollouts.

Each keeps verl's semantics or refuses the key (class 3); verl's lines are cited where the
semantics are not obvious (verl 1dda039).
"""

from __future__ import annotations

from rlcore.verl.keys import A, M, R, REF
from rlcore.verl.rules import rule

KL_NAMES = {"kl": "k1", "mse": "k2"}  # verl's aliases (kl_penalty_forward); the rest keep their name here
ADV = {"grpo": "grpo", "grpo_vectorized": "grpo", "rloo": "rloo", "rloo_vectorized": "rloo", "gpg": "gpg",
       "reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
ADV_REFUSED = {"gae": "PPO with a critic (GAE): GRPO-family estimators only here",
               "remax": "ReMax's baseline is a greedy rollout of each prompt, which the loop here does not generate",
               "gdpo": "GDPO normalises each reward component apart: one scalar reward per sample here",
               "optimal_token_baseline": "a per-token baseline from the policy's own probabilities",
               "tir_optimal_token_baseline": "a per-token baseline from the policy's own probabilities",
               "grpo_passk": "the pass@k advantage", "opo": "OPO's length-weighted baseline"}
LOSSES = ("vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")
# verl's gspo aggregates its policy loss by seq-mean-token-mean whatever loss_agg_mode says
# (core_algos.py:1598-1600); here it follows algorithm.loss_agg_mode (sapo and geo_mean aggregate as
# verl's whatever the mode: rlcore/advantage.py)
SEQ_MEAN_LOSSES = ("gspo",)


@rule({"algorithm.adv_estimator": ("algorithm.adv_estimator", "grpo, rloo (and their _vectorized), gpg, "
                                   "reinforce_plus_plus -> reinforce_pp, reinforce_plus_plus_baseline -> "
                                   "reinforce_pp_baseline; gae, remax, gdpo, ...: unmapped")})
def estimator(c):
    name = c.get("algorithm.adv_estimator")
    if name in ADV:
        c.put("algorithm.adv_estimator", ADV[name], c.said("algorithm.adv_estimator"), "algorithm.adv_estimator")
    else:
        c.refuse("algorithm.adv_estimator", ADV_REFUSED.get(name, f"no estimator {name!r} here (grpo, rloo, gpg, "
                 "reinforce_plus_plus, reinforce_plus_plus_baseline)"))


@rule({A + "use_kl_loss": ("algorithm.kl_loss_coef", "False (verl's default): kl_loss_coef 0, no reference model"),
       A + "kl_loss_coef": ("algorithm.kl_loss_coef", "weight of the KL loss"),
       A + "kl_loss_type": ("algorithm.kl_loss_type", "verl's names: kl -> k1, mse -> k2, low_var_kl / k3, abs, and "
                            "their straight-through + forms (k3+: k3's value, k2's gradient); full: unmapped")})
def kl_loss(c):
    if not c.get(A + "use_kl_loss"):
        c.put("algorithm.kl_loss_coef", 0.0, c.said(A + "use_kl_loss"), A + "use_kl_loss")
        for key in (A + "kl_loss_coef", A + "kl_loss_type"):
            c.ignore(key, "read by verl only with use_kl_loss=True")
        return
    c.put("algorithm.kl_loss_coef", c.get(A + "kl_loss_coef"), c.said(A + "kl_loss_coef"), A + "kl_loss_coef")
    kind = str(c.get(A + "kl_loss_type"))
    base, plus = kind.removesuffix("+"), "+" if kind.endswith("+") else ""
    name = KL_NAMES.get(base, base) + plus
    if name in ("k1", "k2", "k3", "abs", "low_var_kl", "k1+", "k2+", "k3+", "abs+", "low_var_kl+"):
        c.put("algorithm.kl_loss_type", name, c.said(A + "kl_loss_type"), A + "kl_loss_type")
    else:
        c.refuse(A + "kl_loss_type", f"no KL estimator {kind!r} here (k1, k2, k3, abs, low_var_kl, each also with +)")


def _pg_only(c) -> bool:
    """Only the policy loss is aggregated: no KL loss, no entropy bonus, no top-k distillation term."""
    return not c.get(A + "use_kl_loss") and not c.get(A + "entropy_coeff") and not c.get("distillation.enabled")


@rule({A + "policy_loss.loss_mode": ("algorithm.policy_loss", "vanilla, gspo, gpg, cispo, sapo, geo_mean, dppo_tv, "
                                     "dppo_kl; clip_cov -> vanilla + exploration.clip_cov_*; kl_cov, dro, bypass_mode: "
                                     "unmapped"),
       A + "loss_agg_mode": ("algorithm.loss_agg_mode", "the same five modes (token-mean, token-sum, seq-mean-token-sum, "
                             "seq-mean-token-mean, seq-mean-token-sum-norm)"),
       A + "policy_loss.clip_cov_ratio": ("exploration.clip_cov_ratio", "loss_mode clip_cov: the fraction of tokens "
                                          "whose gradient is dropped"),
       A + "policy_loss.clip_cov_lb": ("exploration.clip_cov_lb", "loss_mode clip_cov: the covariance band's lower bound"),
       A + "policy_loss.clip_cov_ub": ("exploration.clip_cov_ub", "loss_mode clip_cov: the covariance band's upper bound"),
       A + "policy_loss.tau_pos": ("(none)", "verl's sapo reads actor.tau_pos, not this key (core_algos.py:1651)"),
       A + "policy_loss.tau_neg": ("(none)", "verl's sapo reads actor.tau_neg, not this key (core_algos.py:1652)")})
def policy_loss(c):
    mode, agg = c.get(A + "policy_loss.loss_mode", "vanilla"), c.get(A + "loss_agg_mode", "token-mean")
    key, agg_key = A + "policy_loss.loss_mode", A + "loss_agg_mode"
    for k in (A + "policy_loss.tau_pos", A + "policy_loss.tau_neg"):
        c.ignore(k, f"verl's sapo reads {k.replace('policy_loss.', '')} (core_algos.py:1651-1652), not this key")
    if mode == "clip_cov":
        c.put("algorithm.policy_loss", "vanilla", c.said(key) + " (PPO clip + Clip-Cov)", key)
        for name in ("ratio", "lb", "ub"):
            k = A + f"policy_loss.clip_cov_{name}"
            c.put(f"exploration.clip_cov_{name}", c.get(k), c.said(k), k)
    elif mode not in LOSSES:
        c.refuse(key, {"kl_cov": "KL-Cov's per-token KL penalty on high-covariance tokens",
                       "dro": "DRO's quadratic log-ratio penalty", "bypass_mode": "verl's rollout-correction bypass loss"}
                 .get(mode, f"no policy loss {mode!r} here ({', '.join(LOSSES)})"))
    else:
        c.put("algorithm.policy_loss", mode, c.said(key), key)
    for k in ("ratio", "lb", "ub"):
        if mode != "clip_cov":
            c.ignore(A + f"policy_loss.clip_cov_{k}", "read by verl's clip_cov loss only")
    if mode in SEQ_MEAN_LOSSES and agg != "seq-mean-token-mean":
        if _pg_only(c):
            c.put("algorithm.loss_agg_mode", "seq-mean-token-mean", f"{mode}: verl aggregates its policy loss by "
                  f"seq-mean-token-mean whatever {c.said(agg_key)} says; nothing else is aggregated here", agg_key)
        else:
            c.refuse(agg_key, f"verl's {mode} aggregates the policy loss by seq-mean-token-mean but the KL/entropy "
                     f"terms by {agg}; one mode here: set loss_agg_mode=seq-mean-token-mean")
    else:
        c.put("algorithm.loss_agg_mode", agg, c.said(agg_key), agg_key)


@rule({A + "clip_ratio": ("algorithm.clip_low / clip_high", "read by verl's losses only where clip_ratio_low/high "
                          "are null; they default to 0.2 (workers/config/actor.py:159-161)")})
def clip_ratio(c):
    key = A + "clip_ratio"
    for side, target in (("low", "algorithm.clip_low"), ("high", "algorithm.clip_high")):
        k = A + f"clip_ratio_{side}"
        if c.given(k) and c.get(k) is None:  # verl: clip_ratio_low if not None else clip_ratio (core_algos.py:1321)
            c.put(target, c.get(key), f"{c.said(key)} ({k}=null)", key)
            c.done.add(k)
    if c.given(key) and all(not (c.given(A + f"clip_ratio_{s}") and c.get(A + f"clip_ratio_{s}") is None)
                            for s in ("low", "high")):
        c.ignore(key, "no effect in verl: its losses read clip_ratio_low/high, 0.2 by default "
                 "(workers/config/actor.py:159-161, core_algos.py:1321-1322)")


@rule({A + "optim.lr_warmup_steps": ("optim.warmup_steps", "verl counts training steps; here optimizer steps: x "
                                     "ppo_epochs x mini_batches"),
       A + "optim.lr_warmup_steps_ratio": ("optim.warmup_steps", "int(ratio x total steps) training steps, x ppo_epochs "
                                           "x mini_batches; needs the step count"),
       A + "optim.lr_scheduler_type": ("optim.lr_schedule", "constant or cosine; verl's VeOmni engine defaults to "
                                       "cosine, its FSDP engine to constant"),
       A + "optim.warmup_style": ("optim.lr_schedule", "verl's deprecated name of lr_scheduler_type"),
       A + "optim.lr_decay_style": ("optim.lr_schedule", "verl's older name of lr_scheduler_type"),
       A + "optim.lr_min": ("optim.min_lr_ratio", "the VeOmni engine's absolute floor, divided by lr"),
       A + "optim.min_lr": ("optim.min_lr_ratio", "Megatron's absolute floor, divided by lr"),
       A + "optim.optimizer": ("optim.optimizer", "AdamW -> adamw, anyprecision_adamw; others unmapped")})
def optim(c):
    opt = (c.integer(A + "ppo_epochs") or 1) * max(int(c.out.get("algorithm.mini_batches", (1,))[0]), 1)
    warm, ratio = c.get(A + "optim.lr_warmup_steps", -1), c.get(A + "optim.lr_warmup_steps_ratio", 0.0)
    if warm is not None and warm >= 0:
        c.put("optim.warmup_steps", int(warm) * opt, f"{c.said(A + 'optim.lr_warmup_steps')} training steps x {opt} "
              "optimizer steps each", A + "optim.lr_warmup_steps")
    elif ratio and getattr(c, "total_steps", None) is None:
        c.refuse(A + "optim.lr_warmup_steps_ratio", "needs the step count: set trainer.total_training_steps or make "
                 "data.train_files readable here")
    elif ratio:
        c.put("optim.warmup_steps", int(ratio * c.total_steps) * opt, f"{c.said(A + 'optim.lr_warmup_steps_ratio')} x "
              f"{c.total_steps} steps x {opt} optimizer steps each", A + "optim.lr_warmup_steps_ratio")
    schedule_key = next((A + k for k in ("optim.warmup_style", "optim.lr_decay_style") if c.get(A + k)),
                        A + "optim.lr_scheduler_type")
    schedule = c.get(schedule_key, "constant")
    if schedule not in ("constant", "cosine"):
        c.refuse(schedule_key, "constant or cosine here")
    elif schedule != "constant" or c.given(schedule_key):
        c.put("optim.lr_schedule", schedule, c.said(schedule_key), schedule_key)
    for key in (A + "optim.lr_min", A + "optim.min_lr"):
        if c.get(key):
            c.put("optim.min_lr_ratio", float(c.get(key)) / float(c.get(A + "optim.lr")), f"{c.said(key)} / lr", key)
    name = str(c.get(A + "optim.optimizer", "AdamW")).lower()
    name = "adamw" if name == "adam" else name  # Megatron's adam decouples the weight decay: AdamW
    if name in ("adamw", "anyprecision_adamw"):
        if c.given(A + "optim.optimizer"):
            c.put("optim.optimizer", name, c.said(A + "optim.optimizer"), A + "optim.optimizer")
    else:
        c.refuse(A + "optim.optimizer", "AdamW or anyprecision_adamw here")


@rule({M + "lora_rank": ("lora.rank", "LoRA rank (0 = off)"),
       M + "lora_alpha": ("lora.alpha", "LoRA alpha; verl's default 16 is written when lora_rank is set without it "
                          "(workers/config/model.py:125)"),
       M + "lora.rank": ("lora.rank", "LoRA rank of verl's Megatron LoRA config"),
       M + "lora.alpha": ("lora.alpha", "LoRA alpha of verl's Megatron LoRA config (default 32)"),
       M + "lora.dropout": ("lora.dropout", "LoRA dropout"),
       M + "lora.target_modules": ("(none)", "Megatron's module names (linear_qkv, ...): unmapped when set")})
def lora(c):
    experts = (c.integer(A + "veomni.expert_parallel_size", 1) or 1) > 1 or \
        (c.integer(A + "megatron.expert_model_parallel_size", 1) or 1) > 1 or (c.integer(R + "expert_parallel_size") or 1) > 1
    for rank_key, alpha_key in ((M + "lora_rank", M + "lora_alpha"), (M + "lora.rank", M + "lora.alpha")):
        if c.integer(rank_key, 0) > 0 and experts:  # expert parallelism: a mixture-of-experts model
            c.refuse(rank_key, "LoRA on a mixture-of-experts model (the script's expert parallelism says it is one): "
                     "not supported here yet (rlcore/config/lora.py)")
            break
        if c.integer(rank_key, 0) > 0:
            c.put("lora.rank", c.integer(rank_key), c.said(rank_key), rank_key)
            c.put("lora.alpha", float(c.get(alpha_key)), c.said(alpha_key), alpha_key)
            break
    if c.given(M + "lora.dropout"):
        c.put("lora.dropout", c.get(M + "lora.dropout"), c.said(M + "lora.dropout"), M + "lora.dropout")
    if c.given(M + "lora.target_modules"):
        c.refuse(M + "lora.target_modules", "Megatron's module names: lora.target_modules here takes the HF model's")


@rule({A + "veomni.router_replay.mode": ("algorithm.routing_replay", "R2 -> r2, R3 -> r3, disabled -> off"),
       A + "megatron.router_replay.mode": ("algorithm.routing_replay", "R2 -> r2, R3 -> r3, disabled -> off"),
       A + "router_replay.mode": ("algorithm.routing_replay", "R2 -> r2, R3 -> r3, disabled -> off"),
       R + "enable_rollout_routing_replay": ("algorithm.routing_replay", "True: vLLM returns the routed experts (r3)")})
def routing_replay(c):
    for key in (A + "veomni.router_replay.mode", A + "megatron.router_replay.mode", A + "router_replay.mode"):
        mode = str(c.get(key, "disabled")).lower()
        if c.given(key) and mode in ("r2", "r3"):
            c.put("algorithm.routing_replay", mode, c.said(key), key)
            c.ignore(R + "enable_rollout_routing_replay", "verl's switch for R3's rollout side: one key here")
            return
        if c.given(key) and mode not in ("disabled", "none"):
            c.refuse(key, "R2 or R3 here")
    if c.get(R + "enable_rollout_routing_replay"):
        c.put("algorithm.routing_replay", "r3", c.said(R + "enable_rollout_routing_replay"),
              R + "enable_rollout_routing_replay")


@rule({A + "use_prefix_grouper": ("algorithm.share_prompt", "the shared prompt computed once per group: the "
                                  "gradient is unchanged; null here turns it on where the attention takes a dense mask")})
def prefix_grouper(c):
    c.ignore(A + "use_prefix_grouper", "a speed knob (the gradient is unchanged): algorithm.share_prompt, null, "
             "computes each group's prompt once where the attention takes a dense mask")


def _threshold(text) -> tuple[float | None, float]:
    """verl's 'lower_upper' or one upper bound (rollout_corr_helper.py:93-130)."""
    text = str(text).strip("'\"")
    if "_" in text:
        low, high = text.split("_", 1)
        return float(low), float(high)
    return None, float(text)


@rule({"algorithm.rollout_correction.rollout_is": ("rollout_correction.is_level", "token / sequence importance weights"),
       "algorithm.rollout_correction.rollout_is_threshold": ("rollout_correction.is_high", "upper bound (truncate: TIS), "
                                                            "or lower_upper (mask: IcePop, is_low / is_high)"),
       "algorithm.rollout_correction.rollout_rs": ("rollout_correction.rs", "one rejection criterion (token_k1, "
                                                   "seq_mean_k3, ...); several: unmapped"),
       "algorithm.rollout_correction.rollout_rs_threshold": ("rollout_correction.rs_threshold", "its bound (k1: "
                                                             "lower_upper -> rs_low / rs_threshold)"),
       "algorithm.rollout_correction.rollout_is_batch_normalize": ("rollout_correction.is_batch_normalize", "the "
                                                                  "weights divided by their batch mean (with rollout_is)"),
       "algorithm.rollout_correction.bypass_mode": ("(none)", "False only (True: unmapped)"),
       "algorithm.rollout_correction.loss_type": ("(none)", "read by verl only with bypass_mode=True")})
def rollout_correction(c):
    p = "algorithm.rollout_correction."
    level = c.get(p + "rollout_is")
    if level in ("token", "sequence"):
        c.put("rollout_correction.is_level", level, c.said(p + "rollout_is"), p + "rollout_is")
        low, high = _threshold(c.get(p + "rollout_is_threshold"))
        said = c.said(p + "rollout_is_threshold")
        c.put("rollout_correction.is_high", high, said, p + "rollout_is_threshold")
        if low is not None:  # verl: weight 0 outside [low, high], the response mask unchanged
            c.put("rollout_correction.is_mode", "mask", said + " (IcePop)", p + "rollout_is_threshold")
            c.put("rollout_correction.is_low", low, said, p + "rollout_is_threshold")
            c.put("rollout_correction.is_mask_normalizer", "all", said + " (verl keeps masked tokens in the "
                  "normaliser)", p + "rollout_is_threshold")
    elif level not in (None, "null"):
        c.refuse(p + "rollout_is", "token or sequence here")
    else:
        c.ignore(p + "rollout_is_threshold", "read by verl only with rollout_is set")
    norm = p + "rollout_is_batch_normalize"
    if level in ("token", "sequence") and c.get(norm):  # rollout_corr_helper.py:627-656
        c.put("rollout_correction.is_batch_normalize", True, c.said(norm), norm)
    else:
        c.ignore(norm, "False: as here" if not c.get(norm) else "read by verl only with rollout_is set")
    _rejection(c, p)
    if c.get(p + "bypass_mode"):  # core_algos.py:2413-2540, rollout_corr_helper.py:1109-1146
        c.refuse(p + "bypass_mode", "verl's bypass mode: vLLM's log-probs as the old policy, the importance weights "
                 "and rejection recomputed against the current policy in every micro-batch's loss (loss_type "
                 "ppo_clip or reinforce); here they are computed once per step against the old policy")
    else:
        c.ignore(p + "bypass_mode", "False: as here")
    c.ignore(p + "loss_type", "read by verl only with bypass_mode=True")


def _rejection(c, p: str) -> None:
    from rlcore.algo.rollout_correction import RS_MODES

    rs = c.get(p + "rollout_rs")
    if rs in (None, "null", ""):
        c.ignore(p + "rollout_rs_threshold", "read by verl only with rollout_rs set")
        return
    rs = str(rs).strip("'\"")
    if rs not in RS_MODES:
        c.refuse(p + "rollout_rs", f"one criterion here ({', '.join(RS_MODES)})" if "," in rs else
                 f"no criterion {rs!r}: verl 1dda039 has the same ones as here ({', '.join(RS_MODES)})")
        return
    c.put("rollout_correction.rs", rs, c.said(p + "rollout_rs"), p + "rollout_rs")
    low, high = _threshold(c.get(p + "rollout_rs_threshold"))
    c.put("rollout_correction.rs_threshold", high, c.said(p + "rollout_rs_threshold"), p + "rollout_rs_threshold")
    if low is not None:
        c.put("rollout_correction.rs_low", low, c.said(p + "rollout_rs_threshold"), p + "rollout_rs_threshold")


@rule({"algorithm.filter_groups.enable": ("algorithm.dynamic_sampling", "DAPO dynamic sampling: groups whose "
                                          "rewards are all equal are dropped and more prompts sampled"),
       "algorithm.filter_groups.metric": ("algorithm.dynamic_sampling_metric", "acc / score: the score before the "
                                          "overlong penalty; seq_reward / seq_final_reward: the shaped reward"),
       "algorithm.filter_groups.max_num_gen_batches": ("algorithm.max_sampling_rounds", "generation rounds per step at "
                                                       "most (verl's 0, no limit: 100 here)"),
       "data.gen_batch_size": ("algorithm.oversample", "prompts per DAPO round: a speed knob; the rounds here are "
                               "sized from the kept fraction (algorithm.oversample)")})
def dynamic_sampling(c):
    p = "algorithm.filter_groups."
    if not c.get(p + "enable"):
        for k in (p + "metric", p + "max_num_gen_batches", "data.gen_batch_size"):
            c.ignore(k, "read by verl only with filter_groups.enable=True")
        return
    c.put("algorithm.dynamic_sampling", True, c.said(p + "enable"), p + "enable")
    rounds = c.integer(p + "max_num_gen_batches")
    c.put("algorithm.max_sampling_rounds", rounds if rounds > 0 else 100, c.said(p + "max_num_gen_batches")
          + ("" if rounds > 0 else " (no limit in verl)"), p + "max_num_gen_batches")
    metric = c.get(p + "metric")
    if metric in ("acc", "score"):  # before the overlong penalty; acc partitions a group as the score does
        c.put("algorithm.dynamic_sampling_metric", "score", c.said(p + "metric") + " (the score before DAPO's overlong "
              "penalty; verl's scorers' acc keeps the same groups)", p + "metric")
    elif metric in ("seq_reward", "seq_final_reward"):  # the shaped reward (no KL in the reward here)
        c.put("algorithm.dynamic_sampling_metric", "reward", c.said(p + "metric"), p + "metric")
    else:
        c.refuse(p + "metric", "acc, score, seq_reward or seq_final_reward")
    c.ignore("data.gen_batch_size", "prompts per DAPO round (a speed knob): the rounds here are sized from the kept "
             "fraction (algorithm.oversample)")


OVERLONG = ("reward.reward_kwargs.overlong_buffer_cfg.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
            "reward_model.overlong_buffer.")


def overlong_on(c) -> str | None:
    """The prefix of the overlong settings verl's DAPO reward manager applies, or None."""
    manager = c.get("reward.reward_manager.name") or c.get("reward_model.reward_manager")
    for prefix in OVERLONG:
        if c.get(prefix + "enable") and (manager == "dapo" or c.get("reward_model.reward_manager") == "dapo"):
            return prefix
    return None


@rule({"critic.*": ("(no critic)", "verl builds a critic for GAE only (critic.enable null): its keys have no effect "
                    "with a GRPO-family estimator; critic.enable=True: unmapped")})
def critic(c):
    gae = c.get("algorithm.adv_estimator") == "gae"
    for key in [k for k in c.v if k.startswith("critic.")]:
        if key == "critic.enable" and c.get(key):
            c.refuse(key, "a critic (value model): GRPO-family estimators only here")
        elif gae:
            c.refuse(key, "the critic of PPO with GAE: GRPO-family estimators only here")
        else:
            c.ignore(key, f"verl builds no critic for adv_estimator={c.get('algorithm.adv_estimator')} (GAE only)")


@rule({M + "exclude_modules": ("(none)", "a vision-tower pattern (.*visual.*): LoRA here skips the vision tower "
                               "already; another pattern: unmapped")})
def lora_exclude(c):
    pattern = str(c.get(M + "exclude_modules") or "")
    if c.given(M + "exclude_modules") and pattern and all(w in pattern for w in ("visual",)):
        c.ignore(M + "exclude_modules", "LoRA here skips the vision tower already (rlcore/engine/lora.py VISION_EXCLUDE)")
    elif c.given(M + "exclude_modules") and pattern:
        c.refuse(M + "exclude_modules", "LoRA on every target module here (the vision tower excluded)")


@rule({"algorithm.use_kl_in_reward": ("(none)", "False only; True with a fixed kl_ctrl.kl_coef of 0 has no effect; "
                                      "else unmapped (the KL is a loss here: algorithm.kl_loss_coef)")})
def kl_in_reward(c):
    key = "algorithm.use_kl_in_reward"
    if not c.get(key):
        c.ignore(key, "False: the KL is a loss here (algorithm.kl_loss_coef)")
    elif c.get("algorithm.kl_ctrl.type") == "fixed" and not c.get("algorithm.kl_ctrl.kl_coef"):
        c.ignore(key, "True with a fixed kl_ctrl.kl_coef of 0: nothing is added to the reward")
    else:
        c.refuse(key, "a KL penalty inside the reward (verl's kl_ctrl): the KL is a loss here (algorithm.kl_loss_coef)")
