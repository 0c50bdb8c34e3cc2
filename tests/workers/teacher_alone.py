"""The teacher run alone: plain ``vllm.LLM`` (one process, no torchrun, no rlcore), teacher-forced
log-probs (``prompt_logprobs=0``) of every token after the first of each sequence.

    python tests/workers/teacher_alone.py TEACHER_DIR IN.json OUT.json
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    teacher_dir, in_path, out_path = sys.argv[1:4]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_path) as f:
        sequences = json.load(f)
    llm = LLM(model=teacher_dir, dtype="float32", max_model_len=65, kv_cache_memory_bytes=2**25, enforce_eager=True,
              seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(sequences, outs)], f)
    os._exit(0)  # skip vLLM's teardown


if __name__ == "__main__":
    main()
