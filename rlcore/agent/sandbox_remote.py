"""The ``remote`` backend: the code goes to the user's own code-execution service over HTTP, in the
SandboxFusion ``run_code`` shape (what verl's code rewards call): POST ``{url}/run_code`` with
``{"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB", "stdin",
"files", "fetch_files"}``; the answer is ``{"status": "Success" | "Failed" | "SandboxError",
"message", "compile_result", "run_result": {"status": "Finished" | "TimeLimitExceeded" | ...,
"return_code", "stdout", "stderr", "execution_time"}}``. The service is the boundary; the trainer
only bounds the wait (timeout plus a margin) and the output kept.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from rlcore.agent.sandbox_backends import Result

_MARGIN_S = 10.0  # the service's own queueing and start-up, on top of the run timeout


def request_body(code: str, limits) -> dict:
    return {"code": code, "language": "python", "run_timeout": limits.timeout_s, "compile_timeout": 10,
            "memory_limit_MB": limits.memory_mb, "stdin": "", "files": {}, "fetch_files": []}


def run(code: str, limits):
    req = urllib.request.Request(limits.url.rstrip("/") + "/run_code", data=json.dumps(request_body(code, limits)).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=limits.timeout_s + _MARGIN_S) as resp:
            answer = json.loads(resp.read(max(limits.output_bytes * 8, 1 << 20)))
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, a body that is not JSON
        return Result("", f"sandbox service error: {type(e).__name__}: {e}"[:300])
    return _result(answer, limits, Result)


def _result(answer: dict, limits, Result):
    run_ = answer.get("run_result") or {}
    compiled = answer.get("compile_result") or {}
    text = (run_.get("stdout") or "") + (run_.get("stderr") or "") or (compiled.get("stderr") or "")
    data = text.encode()
    if len(data) > limits.output_bytes:
        return Result(data[: limits.output_bytes].decode(errors="ignore"), "output_limit")
    if run_.get("status") == "TimeLimitExceeded":
        return Result(text, "timeout")
    if answer.get("status") == "SandboxError" or not run_:
        return Result(text, f"sandbox service error: {answer.get('status')}: {answer.get('message', '')}"[:300])
    code = run_.get("return_code")
    if code in (0, None) and answer.get("status") == "Success":
        return Result(text, None)
    return Result(text, f"exit {code}" if code is not None else f"exit ({run_.get('status')})")
