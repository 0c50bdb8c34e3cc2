"""Issue 60, F3: ``rollout.sleep_level: 0`` releases the KV cache after a generate.

``LLM.generate`` returns with the engine core still holding the finished requests' ids (until the next
``schedule()``) and, with async scheduling (on for the external launcher on CUDA), the batch it
scheduled ahead; ``release_kv_cache_memory`` refuses both (vllm 0.32.0 v1/engine/core.py:1021-1033).
``rlcore.rollout.checks.drain_paused_engine`` steps the paused engine until it is idle. The unit tests
drive ``ColocateRollout.release_memory`` on a fake engine core that mirrors vLLM's stepping
(core.py:657-687 ``step``, :698-768 ``step_with_batch_queue``); the last test runs the same sequence on
a real CPU engine (tests/workers/level0_release.py), where async scheduling is off
(platforms/cpu.py:330-331) and the finished ids alone made the release fail.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from conftest import QUIET_ENV, REPO
from rlcore.rollout import checks as rc
from test_rollout_accel import FakeLLM, fake_vllm, make  # noqa: F401  (fake_vllm: the fixture)


class FakeScheduler:
    """vLLM's scheduler as the drain sees it: the finished requests' ids stay until the next schedule()
    (v1/core/sched/scheduler.py:2736 add, :1647 cleared), and they count as requests (:2813-2815,
    :2823-2838). ``stuck``: a request that never finishes."""

    def __init__(self):
        self.finished, self.stuck = set(), False

    def has_requests(self):
        return bool(self.finished) or self.stuck

    def schedule(self):
        out, self.finished = set(self.finished), set()
        return out


class FakeEngineCore:
    """EngineCore's stepping: ``step`` without a batch queue (core.py:657-687: nothing to do without
    requests), ``step_with_batch_queue`` with one (:698-768: schedule while there is room and work, else
    pop the oldest batch and wait for it)."""

    def __init__(self, async_scheduling: bool):
        self.scheduler = FakeScheduler()
        self.batch_queue = collections.deque(maxlen=2) if async_scheduling else None  # config/vllm.py:577-587
        self.paused = False
        self.steps = 0

    def step_fn(self):
        self.steps += 1
        if self.batch_queue is None:
            if self.scheduler.has_requests():
                self.scheduler.schedule()
            return
        assert len(self.batch_queue) < 2
        if self.scheduler.has_requests():
            self.batch_queue.appendleft(self.scheduler.schedule())
            if len(self.batch_queue) < 2 and self.scheduler.has_requests():
                return
        elif not self.batch_queue:
            return
        self.batch_queue.pop()

    def release_kv_cache_memory(self):  # core.py:1021-1033
        if not (self.paused and not self.scheduler.has_requests() and not self.batch_queue):
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")


class FakeInprocClient:
    def __init__(self, core):
        self.engine_core = core

    def get_output(self):  # v1/engine/core_client.py:385-388
        self.engine_core.step_fn()


class AsyncFakeLLM(FakeLLM):
    """vllm.LLM over an in-process engine core: ``generate`` returns once its outputs are finished
    (entrypoints/common/offline.py:610), leaving the finished ids, and with async scheduling one batch
    scheduled ahead, in the core."""

    async_scheduling = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.core = FakeEngineCore(AsyncFakeLLM.async_scheduling)
        self.llm_engine.engine_core = FakeInprocClient(self.core)

    def generate(self, inputs, params, use_tqdm=False):
        out = super().generate(inputs, params, use_tqdm)
        self.core.scheduler.finished = {f"req-{i}" for i in range(len(inputs))}
        if self.core.batch_queue is not None:
            self.core.batch_queue.appendleft({"next decode"})
        return out

    def sleep(self, level=1):
        super().sleep(level)
        self.core.paused = True  # level 0: pause only (core.py:921-949, 959-976)

    def release_kv_cache_memory(self):
        super().release_kv_cache_memory()
        self.core.release_kv_cache_memory()

    def wake_up(self, tags=None):
        super().wake_up(tags)
        self.core.paused = False


@pytest.mark.unit
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_level0_release_after_generate(fake_vllm, monkeypatch, async_scheduling):
    """CUDA, sleep level 0: generate, release, resume, generate, release again. Before the drain the first
    release raised 'requires a completed pause first' (async: a queued batch; both: the finished ids)."""
    monkeypatch.setattr(AsyncFakeLLM, "async_scheduling", async_scheduling)
    fake_vllm.LLM = AsyncFakeLLM
    ro = make("cuda", sleep_level=0)
    core = ro.llm.core
    for _ in range(2):
        ro.generate([[1, 2], [3]], n=1)
        assert core.scheduler.has_requests() and bool(core.batch_queue) == async_scheduling
        core.steps = 0
        ro.release_memory()
        assert ro.released == {"kv_cache"}
        assert core.steps == (2 if async_scheduling else 1)  # the empty step, and the batch in flight
        assert not core.scheduler.has_requests() and not core.batch_queue
        ro.resume_memory()
    assert ro.llm.calls.count("release_kv_cache_memory") == 2


@pytest.mark.unit
def test_drain_names_the_setting_when_the_engine_never_idles():
    core = FakeEngineCore(async_scheduling=True)
    core.scheduler.stuck = True
    llm = type("LLM", (), {})()
    llm.llm_engine = type("Engine", (), {"engine_core": FakeInprocClient(core)})()
    with pytest.raises(RuntimeError, match=r"rollout\.sleep_level=0.*set rollout\.sleep_level to 1 or 2"):
        rc.drain_paused_engine(llm, max_steps=3)
    assert core.steps == 3
    idle = FakeEngineCore(async_scheduling=True)
    llm.llm_engine.engine_core = FakeInprocClient(idle)
    assert rc.drain_paused_engine(llm) == 0 and idle.steps == 0  # an idle engine is not stepped


def test_level0_release_sequence_on_a_real_engine(tiny_model, tmp_path):
    """vLLM's own checks on a real CPU engine (async scheduling off there): after generate + sleep(0) the
    release is refused for the finished ids; one drain step later the release gets past every check (to
    the CPU executor's discard, which CPU lacks); the level-0 wake-up gives the same greedy tokens."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "workers", "level0_release.py"), tiny_model,
                           str(out)], cwd=REPO, env={**os.environ, **QUIET_ENV, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads(out.read_text())
    assert m["async_scheduling"] is False and m["batch_queue"] is None  # CPU: platforms/cpu.py:330-331
    assert m["has_requests_after_generate"] is True
    assert m["without_drain"] == "release_kv_cache_memory() requires a completed pause first"
    assert m["drain_steps"] == 1 and m["has_requests_after_drain"] is False
    assert m["with_drain"] == "Selective discard is not supported on CPU."  # v1/worker/cpu_worker.py:187-188
    assert m["same_after_wake"]
