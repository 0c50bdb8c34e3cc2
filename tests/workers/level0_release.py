"""The level-0 release sequence of ``ColocateRollout.release_memory`` on a real in-process engine (plain
``vllm.LLM``, one process): generate, ``sleep(level=0)``, then ``release_kv_cache_memory`` without and
with ``rlcore.rollout.checks.drain_paused_engine`` in between, then the level-0 wake-up and the same
greedy tokens. On CPU vLLM's executor cannot discard the KV cache (v1/worker/cpu_worker.py:187-188), so
the released call ends there: what is recorded is which check stopped it.

    python tests/workers/level0_release.py MODEL_DIR OUT.json
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def attempt(llm) -> str:
    try:
        llm.release_kv_cache_memory()
        return "released"
    except Exception as e:  # vLLM raises RuntimeError for both
        return str(e)


def main() -> None:
    model_dir, out_path = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlcore.rollout.checks import drain_paused_engine

    llm = LLM(model=model_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**25, enforce_eager=True,
              seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ([3, 4, 5, 6], [7, 8, 9])]
    params = SamplingParams(temperature=0.0, max_tokens=5)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    first = tokens()
    core = llm.llm_engine.engine_core.engine_core
    out = {"async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
           "batch_queue": None if core.batch_queue is None else len(core.batch_queue),
           "has_requests_after_generate": core.scheduler.has_requests()}
    llm.sleep(level=0)
    out["without_drain"] = attempt(llm)
    out["drain_steps"] = drain_paused_engine(llm)
    out["has_requests_after_drain"] = core.scheduler.has_requests()
    out["with_drain"] = attempt(llm)
    llm.wake_up(tags=["kv_cache"])  # what resume_memory does after a level-0 release
    out["same_after_wake"] = tokens() == first
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)  # skip vLLM's teardown


if __name__ == "__main__":
    main()
