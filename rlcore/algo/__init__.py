"""The algorithm as tensor math: what a step does with samples, log-probs and rewards.

    batch.py               the batch type (RolloutBatch), DAPO shaping, advantages, rollout metrics
    packing.py             samples into (1, L) rows without padding, the R3 replay rows, micro-batches
    grpo.py                the PPO/GRPO update with global loss normalisation (log-prob matrices,
                           epochs and mini-batches, rollout-correction weights)
    advantage.py           advantage estimators, KL penalties, loss aggregation, policy losses
    rollout_correction.py  importance weights and rejection between vLLM's and the trainer's log-probs
    exploration.py         entropy control and clip-cov options
    distill.py             on-policy distillation's per-token advantage (reverse KL) and its sums

May import: torch, numpy, rlcore.dist (the collective sums of metrics). Not vLLM, not VeOmni, and
no config at run time (``AlgorithmConfig`` only for annotations): the policy arrives as the
``rlcore.protocols.Policy`` the caller passes.
"""
