"""Around the loop: what ``train_grpo.py`` (and ``scripts/``) call to start, keep and end a run.

    build.py      the engines from their config sections (policy, reference, rollout, judges, switch)
    preflight.py  every check that needs no model: config against the world, files, tokenizer, data
    dry_run.py    the device dry run (``scripts/check_config.py``): the config, the world, the kernels,
                  vLLM's own engine-config validation, the memory plan, on a login node
    lifecycle.py  resume, the step's bookkeeping, skipped steps, teardown
    checkpoint.py atomic checkpoints and what they hold; preempt.py: stop signals, the watchdog
    ownership.py  the output folder's owner; a rank ends when its launcher does

May import: every wing (the top floor); nothing in rlcore imports it (the entry points do).
"""
