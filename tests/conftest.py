"""Shared test helpers: tiny offline assets and a real torchrun launcher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Quiet, offline, and deterministic thread counts for every process the tests start.
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VEOMNI_VERBOSITY": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
}
os.environ.update(QUIET_ENV)


def _remove_stale_vllm_shm() -> None:
    """A killed tp=2 run's /dev/shm files (rlcore.rollout.cpu_kv.remove_stale_cpu_shm): the trainer clears
    them itself before a CPU TP engine; tests that build engines directly get them cleared here."""
    from rlcore.rollout.cpu_kv import remove_stale_cpu_shm

    remove_stale_cpu_shm()


_remove_stale_vllm_shm()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from rlcore.demo.toy import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory) -> str:
    """The tiny Qwen3 with ``tie_word_embeddings`` (one matrix for the embedding and the LM head)."""
    from rlcore.demo.toy import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_tied_model")), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> tuple[str, str]:
    from rlcore.demo.toy import make_toy_data

    return make_toy_data(str(tmp_path_factory.mktemp("toy_data")), n_train=200, n_val=50)


WORKERS = os.path.join(REPO, "tests", "workers")
TRAIN = os.path.join(REPO, "train_grpo.py")
# Files whose launches start cold under the real torchrun, whatever the script: what they test is
# the launch itself. (Launches a test signals or kills, tests/workers/launch.py, always do.)
COLD_FILES = {
    "test_e2e.py": "the whole loop as a user starts it: a cold start's console, torchrun's failure report",
    "test_resume.py": "exact resume across cold restarts; what a cold rank imports (trainer_probe.py)",
}
_zygote = []  # this pytest process's workers.forklaunch.Zygote, started on first use


def forks(script: str, test_file: str | None = None) -> bool:
    """Whether ``run_torchrun`` forks ``script`` from the pre-imported interpreter
    (tests/workers/forklaunch.py) rather than starting it cold under torchrun: train_grpo.py or a
    harness in tests/workers/, launched from a test file not in ``COLD_FILES``, unless
    RLCORE_TEST_LAUNCHER=torchrun."""
    if test_file is None:
        test_file = os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0]
    script = os.path.abspath(script)
    return (os.environ.get("RLCORE_TEST_LAUNCHER", "fork") != "torchrun"
            and (script == TRAIN or os.path.dirname(script) == WORKERS)
            and os.path.basename(test_file) not in COLD_FILES)


def run_torchrun(script: str, nproc: int, *args: str, timeout: int = 600, env: dict | None = None):
    """Run ``script`` with ``nproc`` CPU ranks under torchrun, or where ``forks`` says so under
    tests/workers/forklaunch.py (the same ranks, torchrun's environment and gloo, forked from
    pre-imported modules); return the CompletedProcess.

    Fails the test with both output streams when the launch fails.
    """
    full_env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO, **(env or {})}
    if forks(script):
        if not _zygote:
            from workers.forklaunch import Zygote

            _zygote.append(Zygote(REPO, {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}))
        proc = _zygote[0].run(script, nproc, list(args), full_env, REPO, timeout)
        how = "forklaunch"
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args,
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        how = "torchrun"
    if proc.returncode != 0:
        pytest.fail(
            f"{how} {os.path.basename(script)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def tiny_vl_model(tmp_path_factory) -> str:
    """A tiny random Qwen3-VL with its processor (rlcore.demo.vl)."""
    from rlcore import quiet
    from rlcore.demo.vl import make_tiny_vl_model

    with quiet.filtered_output():
        return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl_model")))


@pytest.fixture(scope="session")
def tiny_vl25_model(tmp_path_factory) -> str:
    """A tiny random Qwen2.5-VL with its processor (rlcore.demo.vl, module-name weight layout)."""
    from rlcore import quiet
    from rlcore.demo.vl import make_tiny_vl_model

    with quiet.filtered_output():
        return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl25_model")), family="qwen2_5_vl")


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory) -> tuple[str, str]:
    """The shapes task as JSONL + PNG files (train 64 rows, val 16)."""
    from rlcore.demo.vl import make_shapes_data

    return make_shapes_data(str(tmp_path_factory.mktemp("shapes")), n_train=64, n_val=16)


# ----------------------------------------------------------------------------- file order

# Seconds each file takes on one worker of the 2-core CI machine (tests/durations.json). The
# parallel phase runs files longest first (scripts/run_tests.sh passes --no-loadscope-reorder, so
# xdist hands files out in this order; its default sorts by test count, which sends the few-test,
# multi-minute launch files last and leaves one worker idle while the other finishes them).
# Refresh: RLCORE_TEST_DURATIONS_OUT=tests/durations.json bash scripts/run_tests.sh
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _load_durations(path: str) -> dict[str, float]:
    import json

    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config, items):
    """Longest files first; a file not in the table before all of them (a new file is more often
    a launch than a unit file, and a short one started early costs nothing). Stable: a file's
    tests keep their order, so module fixtures are built once."""
    seconds = _load_durations(DURATIONS)
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), float("inf")))


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("RLCORE_TEST_DURATIONS_OUT"):
        _measured[_file_of(report.nodeid)] = _measured.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    """The launch zygote ends. With RLCORE_TEST_DURATIONS_OUT: each file's setup + call + teardown
    seconds, merged into that table (the controller sees every worker's reports; a worker writes nothing)."""
    for zygote in _zygote:
        zygote.close()
    out = os.environ.get("RLCORE_TEST_DURATIONS_OUT")
    if not out or hasattr(session.config, "workerinput") or not _measured:
        return
    import json

    table = {**_load_durations(out), **{k: round(v, 1) for k, v in _measured.items()}}
    with open(out, "w") as f:
        json.dump(dict(sorted(table.items(), key=lambda kv: -kv[1])), f, indent=1)
        f.write("\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RLCORE_TEST_CPU_OUT=DIR: one line per test (wall s, CPU s of this process and of the
    children it waited for: torchrun launches, interpreters) appended to DIR/<worker>.tsv, to see
    where the suite's CPU goes (the suite is CPU-bound on 2 cores: wall time alone hides it)."""
    out = os.environ.get("RLCORE_TEST_CPU_OUT")
    if not out:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

    t0, (s0, c0) = time.perf_counter(), cpu()
    yield
    t1, (s1, c1) = time.perf_counter(), cpu()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{worker}.tsv"), "a") as f:
        f.write(f"{item.nodeid}\t{t1 - t0:.2f}\t{s1 - s0:.2f}\t{c1 - c0:.2f}\n")
