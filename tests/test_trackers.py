"""The trackers behind MetricsLogger (rlcore/trackers.py, logging.trackers): rows logged in-process go
to metrics.jsonl and to each tracker with their step; each tracker's own files are read back (wandb's
offline run log, MLflow's local store through its client) and hold the values metrics.jsonl has;
nothing touches the network; config mistakes exit 2 naming the key and the valid values."""

from __future__ import annotations

import glob
import ipaddress
import json
import math
import os
import socket
import struct
import threading

import pytest

from rlcore.config.sections import Config, LoggingConfig, WandbConfig
from rlcore.errors import ConfigError
from rlcore.metrics import MetricsLogger
from rlcore.trackers import TRACKERS, get_tracker, register_tracker

pytestmark = pytest.mark.unit

ROWS = [(1, {"reward/mean": 0.25, "actor/kl": 0.0125, "actor/pg_loss": -0.5, "actor/grad_norm": float("nan")}),
        (2, {"reward/mean": 0.5, "actor/kl": 0.02, "actor/pg_loss": 0.125}),
        (2, {"val/accuracy": 0.75, "val/mean@4": 0.5}),  # a validation row at the step it follows
        (3, {"reward/mean": 0.625, "actor/kl": 0.03125, "actor/pg_loss": 0.25})]


def drive(out: str, trackers: list[str], **logging) -> None:
    cfg = Config(logging=LoggingConfig(trackers=trackers, **logging))
    logger = MetricsLogger(out, True, console_every=10**6, total_steps=3, trackers=cfg.logging.enabled_trackers,
                           options=cfg.logging, run_config=cfg)
    for step, metrics in ROWS:
        logger.log(step, metrics)
    logger.close()
    logger.close()  # a second close (teardown after an atexit, or the other way round) does nothing


def jsonl_values(out: str) -> dict[tuple[int, str], float]:
    """(step, key) -> value of every finite metric in metrics.jsonl."""
    values = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            values.update({(row["step"], k): v for k, v in row.items() if k != "step" and isinstance(v, float)})
    return values


@pytest.fixture
def no_network(monkeypatch):
    """Records every connection this process makes to a non-loopback address, and points wandb's
    server at a local listener that counts who connects (wandb-core, a separate process, included)."""
    outside, accepted = [], []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def remote(address) -> bool:
        if not isinstance(address, tuple):
            return False  # a Unix socket
        try:
            return not ipaddress.ip_address(address[0]).is_loopback
        except ValueError:
            return address[0] != "localhost"

    def connect(self, address):
        if remote(address):
            outside.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    def connect_ex(self, address):
        if remote(address):
            outside.append(address)
            return 101  # ENETUNREACH
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield outside, accepted
    stop.set()
    thread.join()
    server.close()
    for conn in accepted:
        conn.close()


# --- wandb's offline run file: a LevelDB-style log of protobuf Records (wandb 0.31 ships no reader)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str):
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]  # 7-byte file header: magic, version
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        body = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        chunks = body if kind in (FULL, FIRST) else chunks + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record


def read_wandb_run(folder: str) -> tuple[dict[tuple[int, str], float], dict, object]:
    """(step, key) -> value from the history records, the run's config, the run record."""
    (path,) = glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))
    history, config, run = {}, {}, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            history.update({(step, k): v for k, v in items.items() if not k.startswith("_")})
        elif kind == "run":
            run = record.run
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config, run


def test_wandb_offline_run_holds_the_metrics_jsonl_values(tmp_path, monkeypatch, no_network, capsys):
    """Default logging.wandb (mode offline): the offline run's history has every finite value of
    metrics.jsonl at its step (validation rows merged into their step), the resolved config once,
    project/name/group/tags as configured; no connection left this process and none reached the
    wandb server address."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    outside, accepted = no_network
    out = str(tmp_path / "my_run")
    drive(out, ["tensorboard", "wandb"], wandb=WandbConfig(group="sweep1", tags=["cpu", "test"]))
    assert "wandb: mode offline (from logging.wandb.mode)" in capsys.readouterr().out
    expected = jsonl_values(out)
    assert len(expected) == 11 and (1, "actor/grad_norm") not in expected  # nan stays in metrics.jsonl only
    history, config, run = read_wandb_run(out)
    assert history == pytest.approx(expected)
    assert config["logging"]["trackers"] == ["tensorboard", "wandb"]
    assert config["logging"]["wandb"]["group"] == "sweep1"
    assert set(config) >= {"model", "algorithm", "trainer"}  # every section of the resolved config
    assert (run.project, run.display_name, run.run_group, list(run.tags)) == ("rlcore", "my_run", "sweep1",
                                                                             ["cpu", "test"])
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))  # beside it, as before
    assert outside == [] and accepted == []


def test_wandb_mode_environment_variable_wins(tmp_path, monkeypatch, no_network, capsys):
    """WANDB_MODE overrides logging.wandb.mode and says so at start-up: online in the config,
    offline in the environment -> an offline run, no connection."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    outside, accepted = no_network
    out = str(tmp_path / "run")
    drive(out, ["wandb"], wandb=WandbConfig(mode="online", dir=str(tmp_path / "elsewhere")))
    assert "wandb: mode offline (from the WANDB_MODE environment variable)" in capsys.readouterr().out
    history, _, _ = read_wandb_run(str(tmp_path / "elsewhere"))  # logging.wandb.dir
    assert history == pytest.approx(jsonl_values(out))
    assert not os.path.exists(os.path.join(out, "tensorboard")) and outside == [] and accepted == []

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = str(tmp_path / "run2")
    drive(out, ["wandb"])
    assert "wandb: mode disabled (from the WANDB_MODE environment variable)" in capsys.readouterr().out
    assert not glob.glob(os.path.join(out, "wandb", "offline-run-*")) and len(jsonl_values(out)) == 11


def test_mlflow_local_store_read_back_through_its_client(tmp_path, monkeypatch, no_network):
    """logging.trackers=[mlflow]: the local file store in {output_dir}/mlruns, read back with
    MlflowClient, has every finite metrics.jsonl value at its step (val/mean@4 as val/mean_4: MLflow
    names allow no '@'), the resolved config as params, a finished run; telemetry stays off."""
    for var in ("MLFLOW_DISABLE_TELEMETRY", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)  # what the tracker sets is undone after the test
    outside, _ = no_network
    out = str(tmp_path / "ml_run")
    drive(out, ["mlflow"], mlflow_experiment="exp1")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(out, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("exp1").experiment_id])
    assert run.info.run_name == "ml_run" and run.info.status == "FINISHED"
    got = {}
    for key in run.data.metrics:
        got.update({(m.step, key): m.value for m in client.get_metric_history(run.info.run_id, key)})
    expected = {(step, key.replace("@", "_")): v for (step, key), v in jsonl_values(out).items()}
    assert got == pytest.approx(expected)
    params = run.data.params
    assert params["logging.trackers"] == "['mlflow']" and params["logging.mlflow_experiment"] == "exp1"
    assert params["logging.wandb.mode"] == "offline" and any(k.startswith("trainer.") for k in params)
    from mlflow.telemetry.client import get_telemetry_client

    assert get_telemetry_client() is None and outside == []
    assert not os.path.exists(os.path.join(out, "tensorboard"))


def test_unknown_tracker_and_bad_wandb_mode_are_config_errors(capsys):
    """An unknown name lists the valid ones (registry and config check alike); a bad mode lists the
    modes; both exit 2 through the command line with the key, the value and the fix."""
    import train_grpo

    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord': valid names are .*mlflow, tensorboard"):
        get_tracker("tensorbord")
    with pytest.raises(ConfigError, match=r"logging.trackers=\['wandb', 'neptune'\] is invalid: unknown tracker "
                                          r"'neptune': valid names are mlflow, tensorboard, wandb"):
        LoggingConfig(trackers=["wandb", "neptune"])
    with pytest.raises(ConfigError, match=r"logging.wandb.mode='cloud' is invalid: use one of offline, online, "
                                          r"disabled"):
        WandbConfig(mode="cloud")
    with pytest.raises(ConfigError, match=r"logging.tensorboard=False is invalid: it conflicts with "
                                          r"logging.trackers="):
        LoggingConfig(trackers=["tensorboard", "wandb"], tensorboard=False)
    with pytest.raises(ConfigError, match=r"name each tracker once"):
        LoggingConfig(trackers=["wandb", "wandb"])
    for argv, needle in ((["--logging.trackers", "[tensorboard, nope]"], "valid names are mlflow, tensorboard"),
                         (["--logging.wandb.mode", "cloud"], "use one of offline, online, disabled")):
        with pytest.raises(SystemExit) as e:
            train_grpo.parse_config(argv, device_type="cpu")
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and ("logging.trackers" in err or "logging.wandb.mode" in err), err


def test_the_old_tensorboard_switch_and_a_registered_tracker(tmp_path):
    """logging.tensorboard=false still turns TensorBoard off with the default trackers; a tracker
    registered from outside gets the rows (finite values) and the close without touching the loop."""
    cfg = LoggingConfig(tensorboard=False)
    assert cfg.trackers == ["tensorboard"] and cfg.enabled_trackers == []
    seen = []

    @register_tracker("recording_for_test")
    class Recording:
        def __init__(self, output_dir, options, run_config):
            seen.append(("init", run_config.logging.trackers))

        def log(self, step, metrics):
            seen.append((step, dict(metrics)))

        def close(self):
            seen.append("close")

    try:
        out = str(tmp_path / "run")
        drive(out, ["recording_for_test"])
    finally:
        del TRACKERS["recording_for_test"]
    assert seen[0] == ("init", ["recording_for_test"]) and seen[-1] == "close" and len(seen) == 2 + len(ROWS)
    assert seen[1] == (1, {k: v for k, v in ROWS[0][1].items() if math.isfinite(v)})
    assert not os.path.exists(os.path.join(out, "tensorboard"))
    # Ranks other than 0 build no tracker and write nothing, but an unknown name fails there too.
    other = MetricsLogger(str(tmp_path / "r1"), False, trackers=["wandb"])
    assert other.trackers == {} and not os.path.exists(tmp_path / "r1")
    with pytest.raises(ConfigError):
        MetricsLogger(str(tmp_path / "r1"), False, trackers=["nope"])
