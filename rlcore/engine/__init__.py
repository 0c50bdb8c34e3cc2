"""The policy engine's parts: with ``rlcore/engine_veomni.py`` (VeOmniPolicy, LoraPolicy: log-probs on
packed sequences, the optimizer step, checkpoints, HF export, the bucketed hand-over of weights for
the sync), everything that touches VeOmni, FSDP2 or DTensor.

    build.py          how its model is built and sharded (VeOmni's parallel state, CPU shims)
    kernels.py        VeOmni's kernel choices per device; attention.py: the attention choice
    moe.py            experts: EP on CPU, fused/per-expert checkpoint layouts, MoE kernels
    vl.py             the vision tower and its inputs
    replay.py         MoE routing replay on the trainer's side (R2 recording, R3 rows)
    lora.py           LoRA adapters on the policy (VeOmni's wrapper), PEFT names, merged exports
    offload.py        OffloadState: where parameters and optimizer state are, and their moves
    optim.py          the optimizer through VeOmni's build_optimizer: adamw, anyprecision_adamw
    parts.py          the engine's named parts (names, shards, the lr schedule, masks)
    bucket_gather.py  the gather of local shards into full tensors, in buckets
    transformers_compat.py  what VeOmni's VL modeling imports and the NPU pin's transformers 5.5.4 lacks
    transformers_vision.py  transformers 5.19's vision_utils helpers VeOmni imports (for 5.5.4, which has none)

May import: torch, VeOmni, transformers, the ground floor (rlcore.dist, rlcore.hf_folder, ...).
Never rlcore.engine_veomni (the module these parts make up imports them, not the reverse), and
never vLLM: the rollout engine (rlcore.colocate_rollout) is the other side of the sync.
"""
