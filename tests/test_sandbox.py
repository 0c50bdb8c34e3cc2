"""The python tool's sandbox backends (rlcore/agent/sandbox*.py) against hostile code: code a
reward-hacking or prompt-injected policy can write, sent through ``run_call`` (the agent loop's path)
from a stand-in trainer process (tests/workers/sandbox_trainer.py) that holds a secret in its
environment. Each case runs under every backend this machine has; a missing one is skipped with the
reason the probe gave. Also: the honest-failure cases under every backend, the remote backend
against a stand-in SandboxFusion server on 127.0.0.1, sandboxed user tools, and the config checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO

WORKER = os.path.join(REPO, "tests", "workers", "sandbox_trainer.py")
HOSTILE = ["outlive", "write_outside", "kill_trainer", "proc_environ", "read_token", "network"]
LOCAL = ["bwrap", "namespaces", "uid"]


def _python_for(backend: str) -> str | None:
    """The uid backend needs an interpreter every uid can read; here the venv's sits under 0700 /root."""
    if backend == "uid" and os.geteuid() == 0 and os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return None


def _need(backend: str) -> str | None:
    from rlcore.agent.sandbox import why_not

    why = why_not(backend, _python_for(backend))
    if why:
        pytest.skip(f"backend {backend} is not available on this machine: {why}")
    return _python_for(backend)


def _trainer_home(tmp_path) -> str:
    """A 0600 token in a 0700 dir (~/.cache/huggingface/token) and a 0755 dir of the trainer's user
    (the checkout or output directory)."""
    home = tmp_path / "home"
    (home / "out").mkdir(parents=True)
    os.chmod(home, 0o755)
    os.chmod(home / "out", 0o755)
    (home / "token").write_text("hf_TESTTOKEN_5ec7e7\n")
    os.chmod(home / "token", 0o600)
    return str(home)


def _run_worker(backend: str, cases: list[str], home: str, python: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLCORE_TRAINER_SECRET": "hunter2-trainer-secret"}
    return subprocess.run([sys.executable, WORKER, backend, ",".join(cases), home, python or ""], env=env,
                          capture_output=True, text=True, timeout=240)


_RESULTS: dict[str, dict] = {}


def _results(backend: str, python: str | None, tmp_path_factory) -> dict:
    """One stand-in trainer per backend runs every case but the kill (which would end it)."""
    if backend not in _RESULTS:
        home = _trainer_home(tmp_path_factory.mktemp(f"hostile_{backend}"))
        out = _run_worker(backend, [c for c in HOSTILE if c != "kill_trainer"], home, python)
        assert out.returncode == 0, out.stderr[-3000:]
        _RESULTS[backend] = {r["case"]: r for r in map(json.loads, out.stdout.strip().splitlines())}
    return _RESULTS[backend]


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_code_stays_inside(case, backend, tmp_path, tmp_path_factory):
    python = _need(backend)
    if case == "kill_trainer":  # its own stand-in trainer: if the code gets out, that process dies
        out = _run_worker(backend, [case], _trainer_home(tmp_path), python)
        assert out.returncode == 0, f"the stand-in trainer died (rc {out.returncode}): the code killed it"
        result = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        result = _results(backend, python, tmp_path_factory)[case]
    assert not result["escaped"], result
    assert "hunter2-trainer-secret" not in result["content"] and "hf_TESTTOKEN" not in result["content"]


from test_agent import SANDBOX_CASES  # noqa: E402  the honest failures of tests/test_agent.py, under every backend


def _python_tool():
    from rlcore.agent.tools import Tool, python

    return Tool("python", python, {"type": "function", "function": {"name": "python"}}, sandboxed=True)


@pytest.mark.parametrize("backend", [*LOCAL, "process"])
@pytest.mark.parametrize("case", list(SANDBOX_CASES))
def test_honest_failures_under_every_backend(case, backend, monkeypatch):
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import run_call

    python = _need(backend) if backend != "process" else None
    monkeypatch.setenv("RLCORE_TEST_SECRET", "hunter2")
    code, expected = SANDBOX_CASES[case]
    limits = Limits(timeout_s=2.0, cpu_s=2, memory_mb=256, output_bytes=4096, backend=backend, python=python)
    start = time.perf_counter()
    result = run_call(_python_tool(), "python", {"code": code}, limits)
    assert result.error is not None and expected in result.content, result
    assert "hunter2" not in result.content and time.perf_counter() - start < 10
    assert not os.path.exists("/tmp/rlcore_sandbox_escape.txt")


@pytest.mark.serial
@pytest.mark.parametrize("backend", LOCAL)
def test_concurrent_calls_each_have_their_own_sandbox(backend):
    """Calls of a turn run side by side in the pool; one call's cleanup (under uid: kill everything
    of its uid) never reaches another's processes."""
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import ToolRunner

    python = _need(backend)
    runner = ToolRunner({"python": _python_tool()}, Limits(timeout_s=6.0, backend=backend, python=python), workers=4)
    slow = "import os, time\ntime.sleep(2)\nopen('a.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), 6 * 7)"
    start = time.perf_counter()
    results = runner.run([("python", {"code": slow})] * 3 + [("python", {"code": "print('quick')"})])
    runner.shutdown()
    assert [r.content for r in results] == ["['a.txt'] 42\n"] * 3 + ["quick\n"], results
    assert time.perf_counter() - start < 6.0


# --------------------------------------------------------------------------- remote


class _FusionStandIn(BaseHTTPRequestHandler):
    """POST /run_code in SandboxFusion's shape; runs the code in a plain child (a stand-in only)."""

    requests: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        try:
            out = subprocess.run([sys.executable, "-I", "-S", "-c", body["code"]], capture_output=True, text=True,
                                 timeout=body["run_timeout"])
            run = {"status": "Finished", "return_code": out.returncode, "stdout": out.stdout, "stderr": out.stderr,
                   "execution_time": 0.01}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        status = "Success" if run["return_code"] == 0 else "Failed"
        data = json.dumps({"status": status, "message": "", "compile_result": None, "run_result": run,
                           "files": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fusion_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FusionStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_backend_speaks_sandbox_fusion(fusion_url):
    from rlcore.agent.sandbox import Limits, run_python
    from rlcore.agent.tools import run_call

    limits = Limits(timeout_s=1.0, backend="remote", url=fusion_url, output_bytes=100)
    assert run_call(_python_tool(), "python", {"code": "print(6 * 7)"}, limits).content == "42\n"
    path, body = _FusionStandIn.requests[-1]
    assert path == "/run_code" and body["language"] == "python" and body["run_timeout"] == 1.0
    failed = run_call(_python_tool(), "python", {"code": "raise ValueError('boom')"}, limits)
    assert failed.error == "raised" and "ValueError: boom" in failed.content
    assert run_python("import time\ntime.sleep(5)", limits).error == "timeout"
    assert run_python("print('x' * 500)", limits).error == "output_limit"
    down = run_python("print(1)", Limits(backend="remote", url="http://127.0.0.1:9"))
    assert down.error.startswith("sandbox service error"), down


# --------------------------------------------------------------------------- user tools, config


@pytest.mark.unit
def test_user_tool_can_opt_into_the_sandbox(tmp_path, monkeypatch):
    from rlcore.agent.sandbox import Limits
    from rlcore.agent.tools import load_tools, run_call
    from rlcore.task.rewards import load_custom_fn

    monkeypatch.setenv("RLCORE_TEST_SECRET", "hunter2")
    f = tmp_path / "my_tools.py"
    f.write_text("import os\n\ndef lookup(key: str) -> dict:\n    print('noise')\n"
                 "    return {'key': key, 'secret': os.environ.get('RLCORE_TEST_SECRET'), 'uid': os.getuid()}\n\n"
                 "def spill(path: str) -> str:\n    open(path, 'w').write('x')\n    return 'wrote'\n")
    schema = {"name": "lookup", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}
    spill = {"name": "spill", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
    tools = load_tools([{"fn": f"{f}:lookup", "schema": schema, "sandboxed": True},
                        {"fn": f"{f}:spill", "schema": spill, "sandboxed": True}], load_custom_fn)
    assert tools["lookup"].sandboxed and tools["lookup"].source == str(f)
    limits = Limits(timeout_s=5.0)
    got = json.loads(run_call(tools["lookup"], "lookup", {"key": "k"}, limits).content)
    assert got["key"] == "k" and got["secret"] is None
    target = tmp_path / "outside.txt"
    res = run_call(tools["spill"], "spill", {"path": str(target)}, limits)
    assert res.error == "raised" and not target.exists(), res


@pytest.mark.unit
def test_config_names_the_field_the_value_and_the_fix():
    from rlcore.agent.config import ToolsSandboxConfig
    from rlcore.agent.sandbox import Limits, SandboxUnavailable, check, describe
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tools_sandbox\.backend='docker' is invalid: choose one of auto"):
        ToolsSandboxConfig(backend="docker")
    with pytest.raises(ConfigError, match=r"tools_sandbox\.url=None is invalid: backend: remote needs"):
        ToolsSandboxConfig(backend="remote")
    with pytest.raises(SandboxUnavailable, match="strict: true refuses the 'process' backend"):
        check(Limits(backend="process", strict=True))
    assert "backend remote at http://x" in describe(Limits(backend="remote", url="http://x"))
    assert "python tool sandbox: backend" in describe(Limits())


@pytest.mark.unit
@pytest.mark.parametrize("extra,expected", [
    (["--rollout.multi_turn.tools_sandbox.backend", "docker"],
     "rollout.multi_turn.tools_sandbox.backend='docker' is invalid: choose one of auto"),
    (["--tools", '["python"]', "--rollout.multi_turn.tools_sandbox.backend", "process",
      "--rollout.multi_turn.tools_sandbox.strict", "true"], "strict: true refuses the 'process' backend"),
], ids=["backend", "strict"])
def test_bad_sandbox_config_exits_2_before_any_model(extra, expected, tmp_path, capsys):
    from rlcore.demo.tool import make_tool_data, make_tool_model

    train, _ = make_tool_data(str(tmp_path / "data"), n_train=8, n_val=2)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_bad_inputs import checks_exit_code

    argv = ["--config", os.path.join(REPO, "configs", "demo_tool_cpu.yaml"),
            "--model.path", make_tool_model(str(tmp_path / "model")), "--data.train_files", json.dumps([train]),
            "--data.val_files", "[]", "--trainer.output_dir", str(tmp_path / "out"), *extra]
    assert checks_exit_code(argv, 2) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_per_call_uids_differ_between_processes():
    """The 8 or 16 ranks of a node each run tool calls: one process's cleanup (kill every process of
    its call's uid) must never reach another process's call (a run of the suite with two pytest
    processes probing and calling at once lost calls to SIGKILL when both used uid_base + slot)."""
    from rlcore.agent import sandbox_backends as sb

    base = 1_000_000_000
    here = [sb.take_uid(base) for _ in range(3)]
    for uid in here:
        sb.give_uid(uid, base)
    assert here == [here[0], here[0] + 1, here[0] + 2] and sb.take_uid(base) == here[0]
    sb.give_uid(here[0], base)
    code = "from rlcore.agent import sandbox_backends as sb; print(sb.take_uid(1_000_000_000))"
    other = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               cwd=REPO).stdout)
    assert abs(other - here[0]) >= sb.SLOTS_PER_PROCESS, "two processes share a block of uids"
    assert base <= min(here[0], other) and max(here[0], other) < base + sb.UID_SPAN
