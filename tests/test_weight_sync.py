"""After a training step and a weight sync, vLLM's log-probs of its sampled tokens equal the
trainer's log-probs of the same tokens (fp32), with tp=1 and tp=2 on 2 ranks."""

import json
import os

import pytest

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "sync_logprobs.py")


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_logprobs_match_trainer_after_sync(tiny_model, tmp_path, tp):
    out = tmp_path / "result.json"
    run_torchrun(WORKER, 2, tiny_model, str(tp), str(out))
    r = json.loads(out.read_text())
    print(f"tp={tp}: {r}")
    assert r["tokens"] > 20
    assert r["before"] < 1e-4, r  # same initial weights on both sides
    assert r["moved"] > 1e-3, r  # the step changed the policy, so a stale engine would fail below
    assert r["after"] < 1e-4, r
