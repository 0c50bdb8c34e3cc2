"""One tp=2 engine on 2 CPU ranks for tests/test_rollout_accel.py and tests/test_vllm_api.py.

Measures: the private vLLM attribute chain the rollout walks (exists on a real engine), the
speed settings in effect (describe()), unseeded sampling with per-rank trainer RNG states
(TP ranks must still sample identical tokens), and the level-2 completeness check on the real
reload path (a push that skips parameters raises naming them; a full push passes).

    torchrun --nproc_per_node=2 tests/workers/accel_worker.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_common import as_plain, load_hf, toy_prompts  # noqa: E402

from rlcore.dist import init_distributed  # noqa: E402
from rlcore.colocate_rollout import ColocateRollout  # noqa: E402

# (path from the LLM object, where the rollout uses it)
CHAIN = [
    ("llm_engine.model_executor.driver_worker.worker", "ColocateRollout._worker"),
    ("llm_engine.model_executor.driver_worker.worker.model_runner", "ColocateRollout._model_runner"),
    ("llm_engine.model_executor.driver_worker.worker.model_runner.get_model", "update_weights (model.load_weights)"),
    ("llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches", "release_memory on CPU"),
    ("llm_engine.model_executor.driver_worker.worker.vllm_config", "_load_direct (set_current_vllm_config)"),
    ("llm_engine.model_executor.driver_worker.worker.reload_weights", "update_weights (weight_load=reload)"),
    ("llm_engine.vllm_config.model_config.enforce_eager", "describe"),
    ("llm_engine.vllm_config.cache_config.enable_prefix_caching", "describe"),
    ("llm_engine.vllm_config.scheduler_config.max_num_seqs", "describe"),
    ("llm_engine.engine_core._finalizer", "shutdown (detach_client_finalizer)"),
    ("llm_engine.engine_core.engine_core.structured_output_manager.clear_backend", "shutdown"),
    ("llm_engine.engine_core.engine_core.model_executor.shutdown", "shutdown"),
    ("llm_engine.engine_core.engine_core.scheduler.shutdown", "shutdown"),
]


def missing_chain(llm) -> list[str]:
    """'path (used by ...)' for every link of CHAIN that is absent on the real engine."""
    missing = []
    for path, used in CHAIN:
        obj = llm
        for part in path.split("."):
            if not hasattr(obj, part):
                missing.append(f"{path}: .{part} missing (used by {used})")
                break
            obj = getattr(obj, part)
    return missing


def unseeded_checks(ro, prompts, rank: int, m: dict) -> None:
    # Per-rank trainer RNG states, as in training (each rank restores its own from checkpoints).
    np.random.seed(1000 + rank)
    torch.manual_seed(2000 + rank)
    random.seed(3000 + rank)
    np_before = np.random.get_state()[1].copy()
    kw = dict(n=3, temperature=1.0, max_tokens=10)
    first, second = ro.generate(prompts, **kw), ro.generate(prompts, **kw)
    m["unseeded_first"], m["unseeded_second"] = as_plain(first), as_plain(second)
    m["np_rng_untouched"] = bool(np.array_equal(np_before, np.random.get_state()[1]))


def completeness_checks(ro, hf, m: dict) -> None:
    """weights_valid=False is the state a level-2 sleep leaves (sleep itself hangs on CPU)."""
    params = list(hf.named_parameters())
    skip = {"model.norm.weight", "model.layers.0.mlp.down_proj.weight"}
    ro.weights_valid = False
    try:
        ro.update_weights(((n, p.data) for n, p in params if n not in skip), full=True)
        m["partial_push"] = "no error"
    except RuntimeError as e:
        m["partial_push"] = str(e)
    m["valid_after_partial"] = ro.weights_valid
    ro.update_weights((n, p.data) for n, p in params)
    m["valid_after_full"] = ro.weights_valid
    m["greedy_after_full"] = as_plain(ro.generate(toy_prompts(1), n=1, temperature=0.0, max_tokens=6))


def main() -> None:
    model_dir, out_json = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    torch._C.set_num_threads(1)
    ro = ColocateRollout(model_dir, info, tp_size=2, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                         max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=True)
    cfg = ro.llm.llm_engine.vllm_config
    m = {
        "rank": info.rank,
        "missing_chain": missing_chain(ro.llm),
        "describe": ro.describe(),
        "in_effect": {"enforce_eager": cfg.model_config.enforce_eager,
                      "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                      "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                      "enable_prefix_caching": cfg.cache_config.enable_prefix_caching},
    }
    unseeded_checks(ro, toy_prompts(3), info.rank, m)
    completeness_checks(ro, load_hf(model_dir), m)
    ro.shutdown()
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, m)
    if info.rank == 0:
        with open(out_json, "w") as f:
            json.dump({"ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
