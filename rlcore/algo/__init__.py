"""The algorithm as tensor math: what a step does with samples, log-probs and rewards.

    batch.py               the batch type (RolloutBatch), DAPO shaping, advantages, rollout metrics
    packing.py             samples into (1, L) rows without padding, the R3 replay rows, micro-batches
    grpo.py                the PPO/GRPO update with global loss normalisation (log-prob matrices,
                           epochs and mini-batches, rollout-correction weights)
    config.py              the algorithm's config sections (AlgorithmConfig, RolloutCorrectionConfig,
                           ExplorationConfig): dataclasses whose checks name the key and the fix
    rollout_correction.py  importance weights and rejection between vLLM's and the trainer's log-probs
    exploration.py         entropy control and clip-cov options
    distill.py             on-policy distillation's per-token advantage (reverse KL) and its sums
    balance.py             trainer.balance_batch's partition: equal token counts per data-parallel part
    log_prob.py            the old/reference log-prob forwards' own micro-batches (log_prob_micro_batch_*)

The advantage estimators, KL penalties, loss aggregation and policy losses are the design card's
``rlcore/advantage.py``, which this wing builds on (and which imports none of it).

May import: torch, numpy, rlcore.advantage, rlcore.dist (the collective sums of metrics), rlcore.errors
(its sections' checks). Not vLLM, not VeOmni, not the config package (its sections live here, in
config.py, and rlcore.config re-exports them): the policy arrives as the ``rlcore.protocols.Policy``
the caller passes.
"""
