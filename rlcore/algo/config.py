"""The algorithm's config sections: advantages and the policy loss, rollout correction, exploration.

They live with the wing that reads them (rlcore.config re-exports them, as it does the agent's, the
judges' and distillation's sections); the same rules hold as for every section: ``__post_init__``
only checks, and a failed check names the key, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from rlcore import advantage
from rlcore.algo.rollout_correction import IS_LEVELS, IS_MASK_NORMALIZERS, IS_MODES, RS_MODES
from rlcore.errors import check, check_positive


@dataclass
class AlgorithmConfig:
    """Advantages and the policy loss (rlcore/advantage.py)."""

    adv_estimator: str = "grpo"
    """grpo, rloo, reinforce_pp, reinforce_pp_baseline or gpg (GPG: r - group mean, times the
    batch's count over its non-zero rewards, as verl's)."""
    norm_by_std: bool = True
    """Divide GRPO advantages by the group's std; false = Dr.GRPO."""
    policy_loss: str = "vanilla"
    """vanilla (PPO clip with dual clip), gspo, or verl's gpg (-A log p), cispo (clipped ratio as a
    detached weight), sapo (a smooth gate: sapo_tau_pos/neg), geo_mean (GMPO, one loss per
    sequence), dppo_tv / dppo_kl (tokens past a divergence bound get no gradient; dual_clip_c
    truncates the ratio): docs/algorithms.md."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (>= 1: no lower bound, as verl's cispo example uses 10)."""
    clip_high: float = 0.2
    """PPO ratio clip above 1; > clip_low is DAPO's clip-higher."""
    dual_clip_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss to a frozen reference policy; > 0 builds the reference."""
    kl_loss_type: str = "low_var_kl"
    """k1, abs, k2, k3 or low_var_kl; with a + (k3+, low_var_kl+, k1+, abs+) its value with k2's
    gradient (straight-through, as verl's)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    sapo_tau_pos: float = 1.0
    """policy_loss sapo: the gate's temperature for tokens with A > 0."""
    sapo_tau_neg: float = 1.05
    """policy_loss sapo: the gate's temperature for tokens with A <= 0."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    mini_batches: int = 1
    """Optimizer steps per epoch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on each rank (the gradient does not depend on it)."""
    micro_batch_tokens: Optional[int] = None
    """Pack micro-batches up to this many tokens instead of micro_batch_size sequences, balanced
    so every rank runs the same number of micro-batches with similar token counts; null = off."""
    log_prob_micro_batch_size: Optional[int] = None
    """Sequences per no-gradient forward (the old-policy and reference log-probs) on each rank, or
    Ulysses group: no activations are kept for a backward, so it can be larger than
    micro_batch_size; the log-probs do not depend on it. verl's
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu and
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu. null = micro_batch_size."""
    log_prob_micro_batch_tokens: Optional[int] = None
    """Token budget of one no-gradient micro-batch, packed as micro_batch_tokens packs; set, it
    makes those forwards token-budgeted even when training is not (then log_prob_micro_batch_size
    is unused); at least the longest sequence (data.max_prompt_length + the response's maximum).
    verl's log_prob_use_dynamic_bsz + log_prob_max_token_len_per_gpu. null = micro_batch_tokens."""
    gamma: float = 1.0
    """reinforce_pp discount."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: past max_response_length - buffer, the reward drops linearly by up to
    overlong_penalty_factor; 0 = off."""
    overlong_penalty_factor: float = 1.0
    """Maximum overlong penalty."""
    mask_truncated: bool = False
    """Drop responses cut at rollout.max_response_length from the loss."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""
    max_sampling_rounds: int = 3
    """Generation rounds per step at most with dynamic_sampling."""
    dynamic_sampling_metric: Literal["reward", "score"] = "reward"
    """What dynamic sampling compares within a group: reward (after DAPO's overlong shaping: verl's
    seq_reward / seq_final_reward) or score (before it: verl's score / acc filter)."""
    oversample: Optional[bool] = None
    """With dynamic_sampling: size the step's first round from a running estimate of the kept
    fraction, so one generate call usually yields enough groups; extra rounds only as fallback.
    null = on for cuda/npu (a round costs its longest sequence's decode, whatever the batch), off
    on CPU (generation cost grows with the batch: measured in docs/learning.md)."""
    oversample_max: float = 4.0
    """The first round samples at most this many times the prompts it needs."""
    share_prompt: Optional[bool] = None
    """Compute each group's prompt once per micro-batch: the group is packed as [prompt, r1, ...,
    rn] with an attention mask that lets each response see the prompt and itself only. The
    gradient is unchanged. Needs sdpa or eager attention (a dense (L x L) mask); null = on where
    model.attn_implementation resolves to one of them (CPU), off with flash kernels and under
    Ulysses sequence parallelism (which attends sequence by sequence without a mask)."""
    response_only_logits: bool = True
    """Project only the hidden states that predict response tokens to the vocabulary (the LM
    head's cost then scales with response tokens, not prompt tokens). False only for benchmarks."""
    routing_replay: Optional[Literal["r2", "r3"]] = None
    """Mixture-of-experts routing replay: every forward of the update uses recorded experts for
    each token, recomputing only the gate weights (a family VeOmni's replay hook is wired into:
    qwen3_moe, qwen3_5_moe, deepseek_v4). r3: the experts vLLM routed each token to while
    sampling (vLLM returns them: CUDA with its V2 model runner, Ascend; vLLM refuses on CPU), so
    the trained policy routes like the one that sampled. r2: the step's first training forward
    records them (needs ppo_epochs > 1 or mini_batches > 1). null = off."""
    use_rollout_logprobs: bool = False
    """Take vLLM's sampling log-probs as the PPO ratio's old log-probs and skip the trainer's
    recompute (only with ppo_epochs 1 and mini_batches 1)."""

    def __post_init__(self):
        for key, value, valid in (
            ("adv_estimator", self.adv_estimator, advantage.ADV_ESTIMATORS),
            ("policy_loss", self.policy_loss, advantage.POLICY_LOSSES),
            ("loss_agg_mode", self.loss_agg_mode, advantage.AGG_MODES),
            ("kl_loss_type", self.kl_loss_type, advantage.KL_KINDS),
        ):
            check(value in valid, f"algorithm.{key}", value, f"choose one of {', '.join(valid)}")
        check_positive("algorithm", self, "ppo_epochs", "mini_batches", "micro_batch_size", "micro_batch_tokens",
                       "log_prob_micro_batch_size", "log_prob_micro_batch_tokens")
        check(self.clip_low >= 0, "algorithm.clip_low", self.clip_low, "it must be >= 0 (>= 1: no lower bound)")
        check(self.clip_high >= 0, "algorithm.clip_high", self.clip_high, "it must be >= 0")
        check(self.dual_clip_c > 1, "algorithm.dual_clip_c", self.dual_clip_c, "it must be > 1 (3.0 is usual)")
        check(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0, "algorithm.sapo_tau_pos/neg",
              (self.sapo_tau_pos, self.sapo_tau_neg), "both must be > 0 (verl's defaults: 1.0 and 1.05)")
        check(self.kl_loss_coef >= 0, "algorithm.kl_loss_coef", self.kl_loss_coef, "it must be >= 0")
        check(self.overlong_buffer_len >= 0, "algorithm.overlong_buffer_len", self.overlong_buffer_len,
              "it must be >= 0 (0 disables overlong shaping)")
        check(self.oversample_max >= 1, "algorithm.oversample_max", self.oversample_max,
              "it must be >= 1 (1 = no oversampling)")
        check(self.routing_replay != "r2" or self.ppo_epochs * self.mini_batches > 1, "algorithm.routing_replay",
              self.routing_replay, "r2 replays the old log-prob forward's routing in the later forwards of a "
              "step; with ppo_epochs 1 and mini_batches 1 the update is that forward: raise one of them, or null")
        check(self.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", self.max_sampling_rounds,
              "it must be >= 1")
        check(not self.use_rollout_logprobs or (self.ppo_epochs == 1 and self.mini_batches == 1),
              "algorithm.use_rollout_logprobs", self.use_rollout_logprobs,
              "it needs ppo_epochs=1 and mini_batches=1 (later updates need the trainer's old log-probs)")

    @property
    def optim_steps_per_step(self) -> int:
        return self.ppo_epochs * self.mini_batches


@dataclass
class RolloutCorrectionConfig:
    tis_cap: Optional[float] = None
    """Truncated importance sampling against the rollout/trainer mismatch: each token's loss is
    weighted by min(exp(old_logp - rollout_logp), tis_cap), detached; null = off (2.0 is usual)."""

    is_level: Optional[str] = None
    """Importance weights pi_trainer / pi_rollout per token, sequence (product) or geometric
    (the sequence's geometric mean); off; null = off, or token with rollout.partial (resumed tokens
    were sampled by older policies: docs/partial_rollouts.md). Needs the trainer's old log-probs:
    with one PPO epoch and mini-batch they cost one extra forward per step."""
    is_mode: str = "truncate"
    """truncate (TIS: min(w, is_high)) or mask (MIS / IcePop: tokens or sequences with w outside
    [is_low, is_high] get weight 0; is_mask_normalizer says whether they still count in the
    loss's normaliser)."""
    is_mask_normalizer: Literal["all", "kept"] = "all"
    """is_mode mask only. all: the out-of-band tokens stay in the normaliser, contributing 0, as
    IcePop's objective (arXiv:2510.18855: its mean over all |y| tokens of M(w) * the PPO term) and
    verl 0.9.1's compute_rollout_correction_weights (weight 0, response mask unchanged) define it.
    kept: they also leave the normaliser, so the remaining tokens' mean sets the step (larger when
    many are masked; the earlier default here). Rejection (rs) always shrinks it."""
    is_batch_normalize: bool = False
    """Divide the importance weights by their mean over the step's batch (every rank's samples), so
    they average 1 (self-normalised IS, verl's rollout_is_batch_normalize): token level over every
    response token, sequence/geometric over the sequences; after is_mode, before rejection. The
    metric rollout_corr/is_batch_norm_factor is the mean divided by."""
    is_high: float = 2.0
    """Upper bound of the importance weight."""
    is_low: Optional[float] = None
    """Lower bound for is_mode mask; null = 1 / is_high."""
    rs: Optional[str] = None
    """Rejection of tokens or whole sequences by divergence: token_k1..3, seq_sum_k1..3,
    seq_mean_k1..3, seq_max_k2, seq_max_k3 (k1: bounds on the ratio, k2/k3: an upper bound);
    null = off. Rejected tokens leave the loss and its normaliser."""
    rs_threshold: Optional[float] = None
    """k2/k3: the largest divergence kept (e.g. 0.005 for seq_mean_k3); k1: the upper ratio bound."""
    rs_low: Optional[float] = None
    """k1 only: the lower ratio bound; null = 1 / rs_threshold."""

    def __post_init__(self):
        check(self.tis_cap is None or self.tis_cap >= 1, "rollout_correction.tis_cap", self.tis_cap,
              "it must be >= 1 (e.g. 2.0), or null to turn truncated importance sampling off")
        check(self.is_level is None or self.is_level in (*IS_LEVELS, "off"), "rollout_correction.is_level",
              self.is_level, f"choose one of {', '.join(IS_LEVELS)}, off, or null")
        check(self.is_mode in IS_MODES, "rollout_correction.is_mode", self.is_mode, f"choose one of {', '.join(IS_MODES)}")
        check(self.is_mask_normalizer in IS_MASK_NORMALIZERS, "rollout_correction.is_mask_normalizer",
              self.is_mask_normalizer, "choose all (masked tokens count in the normaliser, as IcePop and verl) "
              "or kept (they leave it)")
        check(self.tis_cap is None or self.is_level in (None, "off"), "rollout_correction.tis_cap", self.tis_cap,
              "tis_cap is token-level TIS, which is_level: token with is_mode: truncate and is_high replaces: set one")
        check(self.is_high > 0 and (self.is_low is None or 0 < self.is_low < self.is_high),
              "rollout_correction.is_low/is_high", (self.is_low, self.is_high), "need 0 < is_low < is_high")
        check(self.rs is None or self.rs in RS_MODES, "rollout_correction.rs", self.rs,
              f"choose one of {', '.join(RS_MODES)}, or null")
        check(self.rs is None or (self.rs_threshold is not None and self.rs_threshold > 0),
              "rollout_correction.rs_threshold", self.rs_threshold,
              "rs needs a threshold > 0 (e.g. 0.005 for seq_mean_k3, 2.0 as a k1 ratio bound)")

    def options(self) -> dict | None:
        """rlcore.algo.rollout_correction.correct's settings; None when neither is_level nor rs is on."""
        level = None if self.is_level == "off" else self.is_level
        if level is None and self.rs is None:
            return None
        return {"is_level": level, "is_mode": self.is_mode, "is_mask_normalizer": self.is_mask_normalizer,
                "is_batch_normalize": self.is_batch_normalize, "is_high": self.is_high,
                "is_low": self.is_low if self.is_low is not None else 1.0 / self.is_high,
                "rs": self.rs, "rs_threshold": self.rs_threshold, "rs_low": self.rs_low}


@dataclass
class ExplorationConfig:
    """Keeping the policy's entropy from collapsing before the task is learned (rlcore/algo/exploration.py)."""

    entropy_target: Optional[float] = None
    """Adaptive entropy bonus (Skywork-OR1): after each step the coefficient (starting at
    algorithm.entropy_coef) moves by entropy_coef_step towards keeping actor/entropy at this value
    (up when below, down when above, within [0, entropy_coef_max]); null = fixed entropy_coef."""
    entropy_coef_step: float = 0.005
    """Change of the adaptive entropy coefficient per step."""
    entropy_coef_max: float = 0.05
    """Upper bound of the adaptive entropy coefficient."""
    clip_cov_ratio: float = 0.0
    """Clip-Cov (Cui et al. 2025): this fraction of a micro-batch's tokens, drawn among those whose
    centred cov(log-prob, advantage) lies in (clip_cov_lb, clip_cov_ub) and not already clipped,
    get no gradient (they drive the entropy down); 0 = off, 2e-4 in the paper's large batches."""
    clip_cov_lb: float = 1.0
    """Lower bound of the covariance band Clip-Cov draws from."""
    clip_cov_ub: float = 5.0
    """Upper bound of the covariance band Clip-Cov draws from."""

    def __post_init__(self):
        check(self.entropy_target is None or self.entropy_target > 0, "exploration.entropy_target",
              self.entropy_target, "it must be > 0 (nats per token), or null for a fixed algorithm.entropy_coef")
        check(self.entropy_coef_step > 0 and self.entropy_coef_max > 0, "exploration.entropy_coef_step/max",
              (self.entropy_coef_step, self.entropy_coef_max), "both must be > 0")
        check(0 <= self.clip_cov_ratio < 1, "exploration.clip_cov_ratio", self.clip_cov_ratio,
              "it must be in [0, 1); 0 turns Clip-Cov off")
        check(self.clip_cov_lb < self.clip_cov_ub, "exploration.clip_cov_lb", self.clip_cov_lb,
              f"it must be below clip_cov_ub ({self.clip_cov_ub})")
