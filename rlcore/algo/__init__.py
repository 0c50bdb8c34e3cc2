"""The algorithm as tensor math: what a step does with samples, log-probs and rewards.

    grpo.py                the batch type, packing, DAPO shaping, the R3 replay rows and the
                           PPO/GRPO update with global loss normalisation
    advantage.py           advantage estimators, KL penalties, loss aggregation, policy losses
    rollout_correction.py  importance weights and rejection between vLLM's and the trainer's log-probs
    exploration.py         entropy control and clip-cov options

May import: torch, numpy, rlcore.dist (the collective sums of metrics). Not vLLM, not VeOmni, and
no config at run time (``AlgorithmConfig`` only for annotations): the policy arrives as the
``rlcore.protocols.Policy`` the caller passes.
"""
