"""One step's phases between the two engines.

    sampling.py    the step's samples: prompts, generation (single- or multi-turn), rewards, DAPO
                   refills, the generation seeds, the training shard
    switch.py      the phase machine: the order of offload, wake-up and weight push (timed)
    sync_check.py  after a sync: does vLLM score a probe as the trainer does?
    balance.py     the TP slice each rank trains, and trainer.balance_batch's move of samples
    validation.py  held-out pass@1 / mean@k

May import: rlcore.algo, rlcore.task, rlcore.agent, rlcore.config and the ground floor; the
engines only as the ``rlcore.protocols`` they satisfy. Not rlcore.run.
"""
