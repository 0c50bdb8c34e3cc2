"""The teacher run alone: plain ``vllm.LLM`` (one process, no torchrun, no rlcore), teacher-forced
log-probs of every token after the first of each sequence, and the top K tokens at each position
(``prompt_logprobs=K``: vLLM returns them with the sequence's own token, ``rank`` 1..K for the top ones).

    python tests/workers/teacher_alone.py TEACHER_DIR IN.json OUT.json K
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    teacher_dir, in_path, out_path, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_path) as f:
        sequences = json.load(f)
    llm = LLM(model=teacher_dir, dtype="float32", max_model_len=65, kv_cache_memory_bytes=2**25, enforce_eager=True,
              seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    own = [[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(sequences, outs)]
    top = [[[[tok for tok, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= k and
              (tok != t or len(d) == k)][:k],
             [lp.logprob for tok, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= k and
              (tok != t or len(d) == k)][:k]]
            for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(sequences, outs)]
    with open(out_path, "w") as f:
        json.dump({"own": own, "top": top}, f)
    os._exit(0)  # skip vLLM's teardown


if __name__ == "__main__":
    main()
