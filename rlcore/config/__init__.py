"""The run's configuration: typed sections, their checks, and the defaults resolved once.

    sections.py  one dataclass per concern (field docstrings = ``--help``); ``__post_init__`` only checks
    algo.py      the algorithm's sections: advantages and the loss, rollout correction, exploration
    lora.py      the ``lora`` section and its checks against the model folder
    resolve.py   dependent defaults (device, model folder), filled in once after parsing
    cli.py       the command line: YAML + ``--section.key value``, ``--help``, ``--print_config``

The multi-turn, judge and distillation sections live with their wings (``rlcore.agent.config``,
``rlcore.judge.config``, ``rlcore.distill.config``) and are checked from here. Everything a caller needs is importable from
``rlcore.config``. May import: the ground floor, the sections of agent/, judge/ and distill/, the pure
registries of rlcore.algo; the engines' device choices only inside ``resolve``.
"""

from rlcore.config.algo import AlgorithmConfig, ExplorationConfig, RolloutCorrectionConfig
from rlcore.config.lora import LoraConfig
from rlcore.config.resolve import resolve
from rlcore.config.sections import (
    CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OffloadConfig, OptimConfig, ParallelConfig,
    PartialConfig, RewardConfig, RolloutConfig, TrainerConfig, ValConfig,
)
from rlcore.errors import ConfigError, check, fail
from rlcore.hf_folder import model_num_experts

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ExplorationConfig", "LoggingConfig",
    "LoraConfig", "ModelConfig", "OffloadConfig", "OptimConfig", "ParallelConfig", "PartialConfig", "RewardConfig", "RolloutConfig",
    "RolloutCorrectionConfig", "TrainerConfig", "ValConfig", "check", "fail", "model_num_experts", "resolve",
]
