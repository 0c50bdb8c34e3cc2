"""The run's configuration: typed sections, their checks, and the defaults resolved once.

    sections.py  one dataclass per concern (field docstrings = ``--help``); ``__post_init__`` only checks
    lora.py      the ``lora`` section and its checks against the model folder
    rollout.py   the ``rollout`` section (the vLLM engine) and its ``partial`` sub-section
    resolve.py   dependent defaults (device, model folder), filled in once after parsing
    cli.py       the command line: YAML + ``--section.key value``, ``--help``, ``--print_config``

The algorithm's, data, multi-turn, judge and distillation sections live with the wings that read
them (``rlcore.algo.config``, ``rlcore.task.config``, ``rlcore.agent.config``, ``rlcore.judge.config``,
``rlcore.distill.config``) and are checked from here; no wing imports this package, so the arrows
point one way. Everything a caller needs is importable from ``rlcore.config``. May import: the
ground floor, the sections of algo/, task/, agent/, judge/ and distill/, the pure registries of
rlcore.advantage and rlcore.algo; the engines' device choices only inside ``resolve``.
"""

from rlcore.algo.config import AlgorithmConfig, ExplorationConfig, RolloutCorrectionConfig
from rlcore.config.lora import LoraConfig
from rlcore.config.resolve import resolve
from rlcore.config.sections import (
    CheckpointConfig, Config, LoggingConfig, ModelConfig, OffloadConfig, OptimConfig, ParallelConfig, RewardConfig,
    TrainerConfig, ValConfig,
)
from rlcore.config.rollout import PartialConfig, RolloutConfig
from rlcore.errors import ConfigError, check, fail
from rlcore.hf_folder import model_num_experts
from rlcore.task.config import DataConfig

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ExplorationConfig", "LoggingConfig",
    "LoraConfig", "ModelConfig", "OffloadConfig", "OptimConfig", "ParallelConfig", "PartialConfig", "RewardConfig", "RolloutConfig",
    "RolloutCorrectionConfig", "TrainerConfig", "ValConfig", "check", "fail", "model_num_experts", "resolve",
]
