"""Experiment trackers that ``rlcore.metrics.MetricsLogger`` feeds on rank 0: a registry of name ->
class (``logging.trackers`` names them). Each tracker receives every metrics row with its step, the
run's resolved config once at start, and ``close()`` at teardown. A new tracker is a class with
``__init__(output_dir, options, run_config)``, ``log(step, metrics)`` and ``close()``, registered with
``@register_tracker("name")`` in a module imported before the config is parsed; the loop is untouched.

Each tracker imports its library inside ``__init__``, so only the named ones are ever imported.
Nothing here opens a network connection unless the user asks for it (``logging.wandb.mode=online``
or ``WANDB_MODE=online``, or ``logging.mlflow_uri`` naming a server).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable

from rlcore.errors import ConfigError

TRACKERS: dict[str, type] = {}

WANDB_MODES = ("offline", "online", "disabled")


def register_tracker(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        if name in TRACKERS and TRACKERS[name] is not cls:
            raise ValueError(f"tracker {name!r} is already registered ({TRACKERS[name].__qualname__})")
        TRACKERS[name] = cls
        return cls
    return wrap


def get_tracker(name: str) -> type:
    """The class registered under ``name``; a ConfigError naming the valid ones otherwise."""
    if name not in TRACKERS:
        raise ConfigError(f"logging.trackers: unknown tracker {name!r}: valid names are {', '.join(sorted(TRACKERS))}")
    return TRACKERS[name]


def config_dict(run_config: Any) -> dict:
    """The run's config as a nested dict (a dataclass such as rlcore.config.Config, or a dict)."""
    if run_config is None:
        return {}
    if dataclasses.is_dataclass(run_config) and not isinstance(run_config, type):
        return dataclasses.asdict(run_config)
    return dict(run_config)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _option(options: Any, name: str, default: Any = None) -> Any:
    return getattr(options, name, default) if options is not None else default


@register_tracker("tensorboard")
class TensorBoardTracker:
    """TensorBoard events in {output_dir}/tensorboard."""

    def __init__(self, output_dir: str, options: Any = None, run_config: Any = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode(configured: str) -> tuple[str, str]:
    """(mode, where it came from): the ``WANDB_MODE`` environment variable wins over logging.wandb.mode."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env, "the WANDB_MODE environment variable"
    return configured, "logging.wandb.mode"


@register_tracker("wandb")
class WandbTracker:
    """Weights & Biases. Offline by default: the run's files land in {dir}/wandb/offline-run-*
    (``wandb sync`` uploads them later); online only with logging.wandb.mode=online or WANDB_MODE."""

    def __init__(self, output_dir: str, options: Any = None, run_config: Any = None):
        import wandb

        opts = _option(options, "wandb")
        mode, source = wandb_mode(_option(opts, "mode", "offline"))
        folder = _option(opts, "dir") or output_dir
        os.makedirs(folder, exist_ok=True)
        name = _option(opts, "name") or os.path.basename(os.path.abspath(output_dir))
        print(f"wandb: mode {mode} (from {source}), files under {os.path.join(folder, 'wandb')}", flush=True)
        self.run = wandb.init(project=_option(opts, "project", "rlcore"), name=name, group=_option(opts, "group"),
                              tags=list(_option(opts, "tags") or []) or None, mode=mode, dir=folder,
                              config=config_dict(run_config), settings=wandb.Settings(console="off"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb-core has written the run's last records (measured with
        # wandb 0.31.0: 3 of 10 offline runs read back as the 7-byte header right after finish);
        # teardown stops the service, which flushes and closes the run file first.
        wandb.teardown()


def _mlflow_key(key: str) -> str:
    """MLflow names allow letters, digits, _ - . / : and space: val/mean@4 -> val/mean_4."""
    return re.sub(r"[^\w\-./: ]", "_", key)


@register_tracker("mlflow")
class MlflowTracker:
    """MLflow: a local file store in {output_dir}/mlruns unless logging.mlflow_uri names another
    tracking URI. MLflow's usage telemetry is switched off (MLFLOW_DISABLE_TELEMETRY) unless the
    environment sets it."""

    def __init__(self, output_dir: str, options: Any = None, run_config: Any = None):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # else `import mlflow` contacts its server
        uri = _option(options, "mlflow_uri") or "file:" + os.path.join(os.path.abspath(output_dir), "mlruns")
        if uri.startswith("file:"):
            # MLflow 3.x keeps the file store (no database dependency) behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = _option(options, "mlflow_experiment") or "rlcore"
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        name = os.path.basename(os.path.abspath(output_dir))
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in flatten(config_dict(run_config)).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        print(f"mlflow: run {name} ({self.run_id}) in experiment {experiment!r} at {uri}", flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
