"""verl's own defaults, read from verl's generated trainer configs (copied into rlcore/verl/defaults/
with their provenance): what a key is when a script leaves it unset, and which keys verl has.

Hydra's ``--config-name`` or a ``model_engine=`` override picks the set: ``ppo_trainer`` (the FSDP
engine, ``model_engine: dp``), ``ppo_veomni_trainer``, ``ppo_megatron_trainer``,
``ppo_torchtitan_trainer``; a recipe's config (DAPO's ``dapo_trainer``) layers its own keys on one
of them (RECIPE_CONFIGS, from the recipe's yaml). Interpolations (``${a.b}``, ``${.sibling}``,
``${oc.select:a.b,default}``) resolve against the script's overrides first, as Hydra resolves them.
"""

from __future__ import annotations

import functools
import os
import re

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "defaults")
ENGINE_CONFIGS = {"dp": "ppo_trainer", "fsdp": "ppo_trainer", "veomni": "ppo_veomni_trainer",
                  "megatron": "ppo_megatron_trainer", "torchtitan": "ppo_torchtitan_trainer"}
# verl-recipe e7f889574b (the submodule verl 1dda039 pins): dapo/config/dapo_trainer.yaml and
# dapo_megatron_trainer.yaml, the keys they add to ppo_trainer / ppo_megatron_trainer
_DAPO = {"data.gen_batch_size": "${data.train_batch_size}", "reward.reward_manager.name": "dapo",
         "reward.reward_kwargs.overlong_buffer_cfg.enable": False, "reward.reward_kwargs.overlong_buffer_cfg.len": 0,
         "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.0,
         "reward.reward_kwargs.overlong_buffer_cfg.log": False, "reward.reward_kwargs.max_resp_len": None,
         "algorithm.filter_groups.enable": False, "algorithm.filter_groups.metric": None,
         "algorithm.filter_groups.max_num_gen_batches": 0, "trainer.project_name": "verl-dapo"}
RECIPE_CONFIGS = {"dapo_trainer": ("ppo_trainer", _DAPO), "dapo_megatron_trainer": ("ppo_megatron_trainer", _DAPO)}
CONFIG_NAMES = tuple(sorted(set(ENGINE_CONFIGS.values()) | set(RECIPE_CONFIGS)))
_REF = re.compile(r"\$\{([^${}]*(?:\$\{[^{}]*\}[^${}]*)*)\}")


@functools.cache
def flat(name: str) -> dict[str, object]:
    """Every leaf of verl's generated config ``name`` as dotted key -> value (interpolations as text)."""
    import yaml

    with open(os.path.join(FOLDER, f"{name}.yaml")) as f:
        tree = yaml.safe_load(f)
    out: dict[str, object] = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(tree, "")
    return out


class Defaults:
    """verl's value of each key for one script: its override, else the config's default resolved."""

    def __init__(self, config: str, overrides: dict[str, object]):
        base, extra = RECIPE_CONFIGS.get(config, (config, {}))
        self.config = config
        self.table = {**flat(base), **extra}
        self.overrides = overrides

    def known(self, key: str) -> bool:
        """A key of verl's config (a leaf, a section, or inside a free-form mapping such as engine_kwargs)."""
        if key in self.table or any(k.startswith(key + ".") for k in self.table):
            return True
        parts = key.split(".")
        return any(self.table.get(".".join(parts[:i]), 0) in ({}, None) for i in range(1, len(parts)))

    def value(self, key: str, default=None):
        """The override, else verl's default (resolved), else ``default`` for a key verl lacks."""
        if key in self.overrides:
            return self.overrides[key]
        if key not in self.table:
            return default
        return self._resolve(self.table[key], key)

    def _resolve(self, value, key: str, depth: int = 0):
        if not isinstance(value, str) or "${" not in value or depth > 8:
            return value
        whole = _REF.fullmatch(value.strip())
        if whole:
            return self._reference(whole.group(1), key, depth)
        return _REF.sub(lambda m: str(self._reference(m.group(1), key, depth)), value)

    def _reference(self, body: str, key: str, depth: int):
        if body.startswith("oc.select:"):
            target, _, fallback = body[len("oc.select:"):].partition(",")
            target = _absolute(target.strip(), key)
            if target in self.overrides or target in self.table:
                return self._resolve(self.value(target), target, depth + 1)
            return self._resolve(_literal(fallback.strip()), key, depth + 1) if fallback else None
        target = _absolute(body.strip(), key)
        return self._resolve(self.value(target), target, depth + 1)


def _absolute(ref: str, key: str) -> str:
    """``.sibling`` relative to ``key``'s parent; an absolute key as is."""
    if not ref.startswith("."):
        return ref
    return key.rsplit(".", 1)[0] + ref if "." in key else ref[1:]


def _literal(text: str):
    import yaml

    if "${" in text:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
