"""torchrun worker for tests/test_validation.py: rlcore.step.validation.validate on 2 CPU ranks (tp=1:
two replicas, then tp=2: one replica over both ranks) against a recount of the same generations
gathered from every rank, overall and per data_source (the rows get one of two, as verl's rows
carry theirs). Also holds the reward functions the tests load by file path.

    torchrun --nproc_per_node=2 tests/workers/validation_worker.py MODEL VAL_JSONL OUT_JSON
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import sys

N, MAX_SAMPLES, SEED, MAX_TOKENS = 3, 11, 7, 4
SOURCES = ("openai/gsm8k", "lighteval/MATH")  # every third prompt the second


def first_is_digit(response: str, answer: str) -> float:
    """Mixed outcomes on a random model: 1 when the response starts with a digit."""
    words = response.split()
    return float(bool(words) and words[0].isdigit())


def always_raises(response: str, answer: str) -> float:
    raise RuntimeError("this reward always fails")


def recount(rollout, tokenizer, prompts) -> dict:
    """This rank's generations, regenerated with the same calls validate() makes, as plain data."""
    mine = prompts[:MAX_SAMPLES][rollout.dp_rank:: rollout.dp_size]
    ids = [p.ids for p in mine]
    greedy = [g[0] for g in rollout.generate(ids, n=1, temperature=0.0, max_tokens=MAX_TOKENS)]
    sampled = rollout.generate(ids, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=SEED)
    dec = lambda s: tokenizer.decode(s.response_ids, skip_special_tokens=True)  # noqa: E731
    return {"tp_rank": rollout.tp_rank, "answers": [p.answer for p in mine], "sources": [p.row["data_source"] for p in mine],
            "greedy": [dec(s) for s in greedy], "greedy_len": [len(s.response_ids) for s in greedy],
            "sampled": [[dec(s) for s in group] for group in sampled]}


def expected_metrics(parts: list[dict]) -> dict:
    """val/* from the gathered generations of one rank per replica, by direct counting."""
    parts = [p for p in parts if p["tp_rank"] == 0]
    answers = [a for p in parts for a in p["answers"]]
    greedy = [first_is_digit(r, a) for p in parts for r, a in zip(p["greedy"], p["answers"])]
    groups = [[first_is_digit(r, a) for r in g] for p in parts for g, a in zip(p["sampled"], p["answers"])]
    lens = [n for p in parts for n in p["greedy_len"]]
    out = {"val/num_prompts": len(answers), "val/accuracy": sum(greedy) / len(greedy),
           "val/reward_mean": sum(greedy) / len(greedy), "val/response_len_mean": sum(lens) / len(lens),
           f"val/mean@{N}": sum(map(sum, groups)) / (N * len(groups)),
           f"val/pass@{N}": sum(max(g) for g in groups) / len(groups), "val/errors": 0.0}
    sources = [s for p in parts for s in p["sources"]]
    for name in SOURCES:  # the same counts over each source's prompts
        at = [i for i, s in enumerate(sources) if s == name]
        out.update({f"val/{name}/num_prompts": len(at), f"val/{name}/accuracy": sum(greedy[i] for i in at) / len(at),
                    f"val/{name}/reward_mean": sum(greedy[i] for i in at) / len(at),
                    f"val/{name}/mean@{N}": sum(sum(groups[i]) for i in at) / (N * len(at)),
                    f"val/{name}/reward_mean@{N}": sum(sum(groups[i]) for i in at) / (N * len(at)),
                    f"val/{name}/pass@{N}": sum(max(groups[i]) for i in at) / len(at)})
    return out


def main(model: str, val_file: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlcore.config import DataConfig, RewardConfig
    from rlcore.dist import init_distributed
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.step.validation import ValSettings, validate
    from rlcore.task.prompts import load_prompts
    from rlcore.task.rewards import Scorer

    info = init_distributed("cpu")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, _ = load_prompts([val_file], DataConfig(max_prompt_length=16), tokenizer)
    for i, p in enumerate(prompts):
        p.row["data_source"] = SOURCES[i % 3 == 0]
    scorer = Scorer(RewardConfig(fn=f"{__file__}:first_is_digit"))
    settings = ValSettings(n=N, temperature=1.0, max_tokens=MAX_TOKENS, max_samples=MAX_SAMPLES,
                           num_examples=2, seed=SEED)
    results = {"first_prompts": [p.text for p in prompts[:2]]}
    for tp in (1, 2):
        rollout = ColocateRollout(model, info, tp_size=tp, seed=3, max_model_len=64, kv_cache_gb=0.05)
        metrics, examples = validate(rollout, tokenizer, scorer, prompts, settings)
        parts = [None] * info.world_size
        dist.all_gather_object(parts, recount(rollout, tokenizer, prompts))
        every_rank = [None] * info.world_size
        dist.all_gather_object(every_rank, examples)
        assert all(e == examples for e in every_rank), "validate() returned different rows on different ranks"
        results[f"tp{tp}"] = {"metrics": metrics, "expected": expected_metrics(parts), "examples": examples}
        rollout.shutdown()
    if info.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(*sys.argv[1:4]))
