"""The memory plan: what each phase keeps on a device, from a model's config.json and the run's
config, before anything loads (``scripts/plan_memory.py``, the dry run, the trainer's start on
an accelerator).

    inputs.py       what a plan depends on (PlanInputs), the phases and components it reports
    memory.py       the formulas per component, the plan per phase, the fixes it suggests, its report
    model_shape.py  the model's shape it reads: parameters, activations, the vision tower, the
                    processor's image budget
    vision.py       the vision tower's training activations
    judges.py       each judge engine's share and the judging phase's verdict
    sequence.py     the longest sequence the train phase fits per rank, with and without Ulysses

May import: the ground floor (the config.json reader), torch only for a device's size. Pure
arithmetic: no torch.distributed, no vLLM, no VeOmni, no engine wing.
"""
