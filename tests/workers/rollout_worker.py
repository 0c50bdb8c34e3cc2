"""torchrun worker for tests/test_rollout.py: ColocateRollout on N CPU ranks.

usage: rollout_worker.py MODEL_DIR OUT_DIR TP_SIZE[,TP_SIZE...]

Each layout runs in turn in this one launch (its engines built and shut down within it) and
writes OUT_DIR/tp<N>.json.

Every rank measures; rank 0 writes all ranks' measurements to OUT_JSON and the pytest side
asserts on them (so each check fails with its own message). Order matters: generate and
compare, push perturbed weights and compare, release/resume, shutdown, then a collective.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_common import as_plain, load_hf, max_logprob_diff, perturb_, toy_prompts  # noqa: E402

from rlcore.dist import init_distributed, memory_stats  # noqa: E402
from rlcore.colocate_rollout import ColocateRollout  # noqa: E402

T = 1.0
T_UPDATE = 0.7
N = 4
MAX_TOKENS = 12


def build(model_dir: str, info, tp: int) -> tuple[ColocateRollout, dict]:
    """Build the engine and record what it did to process state."""
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    env_before = os.environ.get("LOCAL_WORLD_SIZE")
    t0 = time.perf_counter()
    ro = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=256)
    m = {
        "init_s": time.perf_counter() - t0,
        "init_rng_kept": bool(torch.equal(rng_before, torch.get_rng_state())),
        "local_world_size_kept": os.environ.get("LOCAL_WORLD_SIZE") == env_before,
        "dp_rank": ro.dp_rank, "dp_size": ro.dp_size, "tp_rank": ro.tp_rank,
    }
    return ro, m


def sampling_checks(ro, hf, prompts, m: dict) -> list:
    """Seeded sampling: reproducible, seed-dependent, RNG-neutral, logprobs == transformers."""
    rng_before = torch.get_rng_state()
    # seed=None: the rollout still seeds every request, from (engine seed, call count, dp rank), so
    # TP ranks agree and numpy's global RNG is never drawn (see rollout.checks.unseeded_call_seed).
    t0 = time.perf_counter()
    m["unseeded_samples"] = as_plain(ro.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS))
    m["first_generate_s"] = time.perf_counter() - t0
    first = ro.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=7)
    t0 = time.perf_counter()
    again = ro.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=7)
    m["generate_s"] = time.perf_counter() - t0
    other = ro.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=8)
    m["generate_rng_kept"] = bool(torch.equal(rng_before, torch.get_rng_state()))
    m["reproducible"] = as_plain(first) == as_plain(again)
    m["seed_changes_samples"] = as_plain(first) != as_plain(other)
    m["n_per_prompt"] = [len(s) for s in first]
    m["finish_reasons"] = sorted({s.finish_reason for per in first for s in per})
    m["samples"] = as_plain(first)
    m["lp_diff"] = max_logprob_diff(hf, prompts, first, T)
    return first


def update_checks(ro, hf, prompts, before, m: dict) -> None:
    """Push noised weights (streamed from the HF model) and compare with its forward."""
    perturb_(hf, seed=99)
    t0 = time.perf_counter()
    ro.update_weights((name, p.data) for name, p in hf.named_parameters())
    m["update_s"] = time.perf_counter() - t0
    # T != 1 here: raw and processed logprobs differ, so the logprobs_mode is checked too.
    after = ro.generate(prompts, n=N, temperature=T_UPDATE, max_tokens=MAX_TOKENS, seed=7)
    m["lp_diff_updated"] = max_logprob_diff(hf, prompts, after, T_UPDATE)
    # The old samples scored by the new model: proves the update changes logprobs far more
    # than the tolerance, so a no-op update could not pass the check above.
    m["lp_shift_old_samples"] = max_logprob_diff(hf, prompts, before, T)


def memory_checks(ro, hf, prompts, m: dict) -> None:
    """Greedy outputs survive release/resume; generate refuses while released."""
    greedy = dict(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
    samples = ro.generate(prompts, **greedy)
    m["lp_diff_greedy"] = max_logprob_diff(hf, prompts, samples, 1.0)  # greedy: unscaled logits
    before = as_plain(samples)
    kv = ro._model_runner().kv_caches[0].untyped_storage()
    nbytes, rss = kv.nbytes(), memory_stats("cpu")["rss_gb"]
    ro.release_memory()
    m["kv_bytes"], m["kv_bytes_released"] = nbytes, kv.nbytes()
    m["rss_freed_bytes"] = (rss - memory_stats("cpu")["rss_gb"]) * 2**30
    try:
        ro.generate(prompts, **greedy)
        m["generate_while_released"] = "returned"
    except RuntimeError as e:
        m["generate_while_released"] = f"RuntimeError: {e}"
    ro.resume_memory()
    m["kv_bytes_resumed"] = kv.nbytes()
    m["greedy_same_after_resume"] = as_plain(ro.generate(prompts, **greedy)) == before


def prefix_checks(ro, m: dict) -> None:
    """A 70-token prompt's n samples share its two full 32-token blocks (CPU block size:
    rollout.settings.pick_block_size; with vLLM's CPU default of 128 nothing would be shared)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    m["block_size"] = ro.llm.llm_engine.vllm_config.cache_config.block_size
    ro.llm.reset_prefix_cache()
    ids = [3 + i % 20 for i in range(70)]
    params = SamplingParams(n=N, max_tokens=2, seed=3)
    first = ro.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    again = ro.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    m["prefix_cached_tokens"] = [first.num_cached_tokens, again.num_cached_tokens]


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    torch._C.set_num_threads(1)
    for tp in map(int, sys.argv[3].split(",")):
        run_layout(model_dir, os.path.join(out_dir, f"tp{tp}.json"), tp, info)
    dist.destroy_process_group()


def run_layout(model_dir: str, out_json: str, tp: int, info) -> None:
    hf = load_hf(model_dir)  # a fresh copy: update_checks perturbs it
    prompts = toy_prompts(3)
    ro, m = build(model_dir, info, tp)
    m["engine_tp_size"] = ro.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    first = sampling_checks(ro, hf, prompts, m)
    update_checks(ro, hf, prompts, first, m)
    memory_checks(ro, hf, prompts, m)
    prefix_checks(ro, m)
    ro.shutdown()
    # The trainer's default process group must still work after the engine is gone.
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    m["all_reduce_after_shutdown"] = t.item()
    # A rebuilt engine (a resumed run) with the same call seed samples the same completions.
    t0 = time.perf_counter()
    ro = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=256)
    m["rebuild_s"] = time.perf_counter() - t0
    rebuilt = ro.generate(prompts, n=N, temperature=T, max_tokens=MAX_TOKENS, seed=7)
    m["same_after_rebuild"] = as_plain(rebuilt) == as_plain(first)
    ro.shutdown()
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, m)
    if info.rank == 0:
        with open(out_json, "w") as f:
            json.dump({"world_size": info.world_size, "tp": tp, "ranks": gathered}, f)
    dist.barrier()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
