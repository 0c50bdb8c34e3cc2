"""The policy engine: everything that touches VeOmni, FSDP2 or DTensor.

    policy.py         VeOmniPolicy: log-probs on packed sequences, the optimizer step, offload,
                      checkpoints, HF export, the bucketed hand-over of weights for the sync
    build.py          how its model is built and sharded (VeOmni's parallel state, CPU shims)
    kernels.py        VeOmni's kernel choices per device; attention.py: the attention choice
    moe.py            experts: EP on CPU, fused/per-expert checkpoint layouts, MoE kernels
    vl.py             the vision tower and its inputs
    replay.py         MoE routing replay on the trainer's side (R2 recording, R3 rows)
    lora.py           LoRA adapters on the policy, merged exports, the adapter-off reference
    parts.py          the engine's named parts; offload.py: their offload bookkeeping
    bucket_gather.py  the gather of local shards into full tensors, in buckets

May import: torch, VeOmni, transformers, the ground floor (rlcore.dist, rlcore.hf_folder, ...).
Never vLLM: the rollout engine (rlcore.rollout) is the other side of the sync.
"""
