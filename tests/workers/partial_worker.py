"""Worker (torchrun, 1 rank, or 2 ranks sharing one tensor-parallel engine): partial rollouts
(rlcore.step.partial) on the real vLLM engine over 4 steps, with new weights pushed into the engine between steps (the tiny model's, perturbed: what a sync
does). Three token ids stop a sequence (stop_token_ids), so lengths spread and the early stop suspends
some groups. Every generate call is recorded; for each trained sequence the pytest side's check runs
here: its ids and log-probs are the concatenation of what vLLM returned for it, call by call. Each
rank writes OUT.json.rank<R> (a TP group's ranks must suspend and train the same sequences).

    torchrun --nproc_per_node=TP tests/workers/partial_worker.py MODEL OUT.json [TP]
"""

import json
import os
import sys
import types

import torch

from rlcore.dist import init_distributed

STOP = [3, 5, 7]


def main() -> None:
    model_dir, out_path = sys.argv[1:3]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    info = init_distributed("cpu", 300)
    from safetensors.torch import load_file

    from rlcore.config import PartialConfig, RolloutConfig
    from rlcore.metrics import Timer
    from rlcore.rollout.engine import ColocateRollout
    from rlcore.step.partial import PartialRollouts
    from rlcore.task.prompts import Prompt

    rollout = ColocateRollout(model_dir, info, tp_size=tp, seed=0, kv_cache_gb=0.0625, max_model_len=64)
    calls = []
    generate = rollout.generate

    def spy(prompts, **kw):  # vLLM itself, with three stop tokens; every call recorded
        out = generate(prompts, stop_token_ids=STOP, **kw)
        calls.append([(list(p), list(s[0].response_ids), list(s[0].logprobs)) for p, s in zip(prompts, out)])
        return out

    rollout.generate = spy
    queue = [Prompt(ids=[10 + i % 7, 11, 12 + i % 5], text="", answer="", row={"i": i}) for i in range(64)]
    cfg = RolloutConfig(n=2, max_response_length=16, max_model_len=64)
    sampler = types.SimpleNamespace(per_replica=lambda: 3, cfg=cfg, switch=None, timer=Timer(), seed=0, rollout=rollout)
    sampler.next_prompts = lambda k: [queue.pop(0) for _ in range(k)]
    part = PartialRollouts(PartialConfig(enable=True, chunk_tokens=3, oversample=2.0, max_staleness=3), 2, 16)
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    trained, metrics = [], []
    for step in range(1, 5):
        batch, m = part.sample(sampler, step)
        trained += list(zip(batch.prompt_ids, batch.response_ids, batch.rollout_logp, batch.staleness))
        metrics.append(m)
        g = torch.Generator().manual_seed(step)
        rollout.update_weights(((k, v + 0.02 * torch.randn(v.shape, generator=g)) for k, v in base.items()), full=True)
    mismatched = []
    for prompt, ids, logp, _ in trained:
        got_ids, got_lp = [], []
        for call in calls:  # in order: the call that continued this sequence from where it stood
            for p, r, lp in call:
                room = len(ids) - len(got_ids)
                if r and p == prompt + got_ids and r[:room] == ids[len(got_ids):len(got_ids) + len(r)]:
                    got_ids, got_lp = got_ids + r[:room], got_lp + lp[:room]
                    break
        if got_ids != ids or got_lp != logp:
            mismatched.append({"prompt": prompt, "ids": ids, "returned": got_ids})
    with open(f"{out_path}.rank{info.rank}", "w") as f:
        json.dump({"trained": len(trained), "mismatched": mismatched, "metrics": metrics,
                   "trained_ids": [[p, ids] for p, ids, *_ in trained], "pool_left": len(part.pool),
                   "resumed_samples": sum(any(s > 0 for s in st) for *_, st in trained),
                   "max_staleness_seen": max((max(st, default=0) for *_, st in trained), default=0)}, f)
    rollout.shutdown()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
