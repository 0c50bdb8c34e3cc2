"""verl's launch scripts in, this project's config out (``scripts/from_verl.py``; docs/from_verl.md).

    shell.py     bash's words and expansions, as far as verl's scripts use them (read, never run)
    script.py    the script's statements: variables, branches, the training command it reaches
    defaults.py  verl's own defaults (its generated trainer configs, copied in defaults/)
    keys.py      verl's keys in three classes: mapped, no effect here, no equivalent
    rules*.py    the conversions that are more than a copy (rules_run, rules_train, rules_recipes, rules_reward)
    convert.py   one override list through the classes and rules, checked by this project's parse
    launch.py    the launch line (absolute paths, device, the script's environment sorted)
    cli.py       the command line

Owns the conversion only: nothing in the trainer imports this wing. May import: the ground floor,
rlcore.config (the project's keys, defaults and parse), rlcore.rollout.engine_keys (the vLLM
arguments the rollout owns) and rlcore.algo.rollout_correction (its criteria's names).
"""
