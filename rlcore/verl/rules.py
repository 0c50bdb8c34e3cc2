"""The registry of conversion rules: a rule converts the verl keys it names (more than a copy: verl's
semantics turned into this project's), in registration order (rules_run.py, rules_train.py,
rules_recipes.py, then rules_reward.py).

``@rule({verl key: (this key, meaning)})`` registers a function ``f(converter)``; its keys enter
keys.RULE_KEYS (the doc's table) and are settled once it has run. A key ending in ``.*`` names
every key under it.
"""

from __future__ import annotations

from typing import Callable

from rlcore.verl import keys as K

RULES: list[Callable] = []
# the order the rule modules run in, whatever order they were imported in (batch sizes and lengths
# before the optimizer's steps, the rollout budget before DAPO's overlong shaping)
MODULES = ("rlcore.verl.rules_run", "rlcore.verl.rules_train", "rlcore.verl.rules_recipes",
           "rlcore.verl.rules_reward")


def rule(table: dict[str, tuple[str, str]]) -> Callable:
    def register(fn: Callable) -> Callable:
        K.RULE_KEYS.update(table)
        prefixes = tuple(k[:-1] for k in table if k.endswith(".*"))
        exact = {k for k in table if not k.endswith(".*")}

        def run(conv) -> None:
            fn(conv)
            conv.done.update(k for k in conv.v if k in exact or k.startswith(prefixes))
        run.__name__, run.__module__ = fn.__name__, fn.__module__
        RULES.append(run)
        RULES.sort(key=lambda r: MODULES.index(r.__module__))  # stable: registration order within a module
        return fn
    return register
