"""Real CPU engines for rollout.engine_kwargs and rollout.enable_expert_parallel
(tests/test_engine_keys.py). argv: mode (kwargs | ep), model folder, output JSON.

kwargs (1 rank, the tiny dense Qwen3): a ColocateRollout built with engine_kwargs {max_logprobs: 3};
the built engine's config says 3 (vLLM's default is 20), a request for 4 log-probs is refused by vLLM
and one for 3 is served, and the rollout's own generate (1 log-prob) still matches transformers.

ep (2 ranks, TP 2, the tiny Qwen3-MoE): vLLM's own engine with enable_expert_parallel, the rollout's
CPU refusal bypassed (see ep_mode).
"""

from __future__ import annotations

import json
import sys

import rlcore  # noqa: F401  (torchvision shim first)
import torch

from rlcore.dist import init_distributed
from rollout_common import load_hf, max_logprob_diff, toy_prompts


def build(model_dir: str, info, **vllm):
    from rlcore.colocate_rollout import ColocateRollout

    return ColocateRollout(model_dir, info, tp_size=info.world_size, seed=0, kv_cache_gb=0.0625, max_model_len=256,
                           vllm=vllm)


def kwargs_mode(model_dir: str, info) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ro = build(model_dir, info, engine_kwargs={"max_logprobs": 3})
    out = {"max_logprobs": ro.llm.llm_engine.vllm_config.model_config.max_logprobs}
    prompt = TokensPrompt(prompt_token_ids=toy_prompts(1)[0])
    try:
        ro.llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
        out["four_refused"] = None
    except Exception as e:  # vLLM's own refusal of a request above max_logprobs
        out["four_refused"] = f"{type(e).__name__}: {e}"
    got = ro.llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    out["three_served"] = [len(step) for step in got[0].outputs[0].logprobs]
    prompts = toy_prompts(3)[:3]
    samples = ro.generate(prompts, n=2, max_tokens=6, seed=1)
    out["max_diff"] = max_logprob_diff(load_hf(model_dir), prompts, samples, 1.0)
    return out


def ep_mode(model_dir: str, info) -> dict:
    """vLLM's own engine with enable_expert_parallel at TP 2, built as the rollout builds it but
    without its CPU refusal (rollout.engine_keys.CPU_EP_REFUSAL): the refusal stays only while
    this crashes. A result file is written only if it survives build and generate."""
    import os

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlcore.rollout.settings import llm_kwargs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = llm_kwargs(model_dir, "cpu", tp_size=2, seed=0, max_model_len=256, dtype="float32", kv_cache_gb=0.0625,
                    gpu_memory_utilization=0.5, enforce_eager=True, multimodal=False, speed={})
    llm = LLM(**kw, enable_expert_parallel=True)
    got = llm.generate([TokensPrompt(prompt_token_ids=toy_prompts(1)[0])], SamplingParams(max_tokens=4, seed=1),
                       use_tqdm=False)
    return {"tokens": list(got[0].outputs[0].token_ids),
            "enable_expert_parallel": llm.llm_engine.vllm_config.parallel_config.enable_expert_parallel}


def main() -> None:
    mode, model_dir, out_path = sys.argv[1:4]
    info = init_distributed("cpu")
    torch._C.set_num_threads(1)
    result = {"kwargs": kwargs_mode, "ep": ep_mode}[mode](model_dir, info)
    result["rank"] = info.rank
    with open(f"{out_path}.{info.rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
