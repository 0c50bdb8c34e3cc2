"""The generative judge run alone: plain ``vllm.LLM`` (one process, no torchrun, no rlcore), greedy,
on the judge inputs the trainer-side judge sent; writes each answer's text.

    python tests/workers/judge_alone.py JUDGE_DIR IN.json OUT.json MAX_TOKENS
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    judge_dir, in_path, out_path, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_path) as f:
        inputs = json.load(f)
    llm = LLM(model=judge_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**25, enforce_eager=True,
              seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in inputs],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(judge_dir)
    with open(out_path, "w") as f:
        json.dump([tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs], f)
    os._exit(0)  # skip vLLM's teardown


if __name__ == "__main__":
    main()
