"""ColocateRollout under a real 2-rank torchrun on CPU: tp=1 (two DP replicas) and tp=2.

Both layouts run one after the other in one torchrun launch (tests/workers/rollout_worker.py)
held by a module-scoped fixture; the tests below assert on what each layout's ranks measured, so
every property fails with its own message.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "rollout_worker.py")
LOGPROB_TOL = 1e-4  # fp32 vLLM vs fp32 transformers forward; measured ~1e-6


@pytest.fixture(scope="module")
def launch(tiny_model, tmp_path_factory):
    """One 2-rank launch of the worker: tensor_parallel_size 1, then 2."""
    out = tmp_path_factory.mktemp("rollout")
    proc = run_torchrun(WORKER, 2, tiny_model, str(out), "1,2")
    return out, proc


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(request, launch) -> dict:
    """The per-rank results of the layout with tensor_parallel_size=param."""
    out_dir, proc = launch
    out = out_dir / f"tp{request.param}.json"
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # Measurements (timings, logprob diffs) for `pytest -s`; the samples are long.
    skip = ("samples", "unseeded_samples")
    print(json.dumps([{k: v for k, v in r.items() if k not in skip} for r in result["ranks"]]))
    return result


def test_parallel_layout(run):
    """tp=1: two DP replicas sample differently; tp=2: one sharded engine, identical outputs."""
    r0, r1 = run["ranks"]
    assert [r["engine_tp_size"] for r in run["ranks"]] == [run["tp"]] * 2
    if run["tp"] == 1:
        assert (r0["dp_rank"], r1["dp_rank"], r0["dp_size"], r1["tp_rank"]) == (0, 1, 2, 0)
        # Per-request seeds differ per DP replica, and so do the engine seeds (unseeded calls).
        assert r0["samples"] != r1["samples"], "DP replicas sampled identical completions"
        assert r0["unseeded_samples"] != r1["unseeded_samples"], "DP engines share a seed"
    else:
        assert (r0["dp_rank"], r1["dp_rank"], r0["dp_size"], r1["tp_rank"]) == (0, 0, 1, 1)
        assert r0["samples"] == r1["samples"], "TP ranks returned different seeded outputs"
        assert r0["unseeded_samples"] == r1["unseeded_samples"], "TP ranks' engine seeds differ"


def test_sampling_shape(run):
    for r in run["ranks"]:
        assert r["n_per_prompt"] == [4, 4, 4, 4]
        assert r["finish_reasons"] == ["length", "stop"]  # EOS ends some samples
        for per_prompt in r["samples"]:
            for ids, logprobs, reason in per_prompt:
                assert len(ids) == len(logprobs) and 0 < len(ids) <= 12
                assert (ids[-1] == 1) == (reason == "stop")  # eos id 1 kept in the response


def test_seeded_generate_reproducible(run):
    for r in run["ranks"]:
        assert r["reproducible"], "same call + same seed gave different samples"
        assert r["seed_changes_samples"], "the per-call seed had no effect"
        assert r["same_after_rebuild"], "a rebuilt engine with the same seed sampled differently"


def test_training_state_untouched(run):
    """vLLM reseeds the global RNG at build and samples from it; LOCAL_WORLD_SIZE is rewritten."""
    for r in run["ranks"]:
        assert r["init_rng_kept"], "engine construction changed the global torch RNG"
        assert r["generate_rng_kept"], "generate() consumed the global torch RNG"
        assert r["local_world_size_kept"], "LOCAL_WORLD_SIZE was not restored"


def test_logprobs_match_transformers(run):
    for r in run["ranks"]:
        assert r["lp_diff"] < LOGPROB_TOL, f"sampled (T=1) logprob diff {r['lp_diff']:.2e}"
        assert r["lp_diff_greedy"] < LOGPROB_TOL, f"greedy logprob diff {r['lp_diff_greedy']:.2e}"


def test_update_weights(run):
    for r in run["ranks"]:
        # The noise moves logprobs by O(1): a silently skipped update cannot pass the check.
        assert r["lp_shift_old_samples"] > 100 * LOGPROB_TOL
        assert r["lp_diff_updated"] < LOGPROB_TOL, f"after update: {r['lp_diff_updated']:.2e}"


def test_release_resume_memory(run):
    for r in run["ranks"]:
        assert r["kv_bytes"] > 0 and r["kv_bytes_released"] == 0, "KV buffer not freed"
        assert r["rss_freed_bytes"] > 0.5 * r["kv_bytes"], "process memory did not drop"
        assert r["kv_bytes_resumed"] == r["kv_bytes"]
        assert r["generate_while_released"].startswith("RuntimeError"), r["generate_while_released"]
        assert r["greedy_same_after_resume"], "greedy outputs changed across release/resume"


def test_shutdown_keeps_process_group(run):
    for r in run["ranks"]:
        assert r["all_reduce_after_shutdown"] == 3.0  # ranks contribute 1 + 2


def test_cpu_blocks_share_a_prompt(run):
    """32-token KV blocks on CPU: a prompt's full blocks are computed once for its n samples, and
    again served from the cache to the next call (vLLM's CPU default of 128 shares no prompt
    shorter than 128 tokens: rollout.settings.pick_block_size)."""
    for r in run["ranks"]:
        assert r["block_size"] == 32
        # [first call after a cache reset, the same prompt again]: 64 both times, so the first
        # call's samples already shared the blocks one of them computed
        assert r["prefix_cached_tokens"] == [64, 64], r["prefix_cached_tokens"]
