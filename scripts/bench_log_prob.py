"""``scripts/bench_train.py --log-prob-factor F``: the no-gradient forwards of one step (the
old-policy and the reference log-probs, ``grpo.train_on_batch``'s calls) with their micro-batch equal
to training's (``LOG_PROB_TRAIN_MICRO`` sequences) against F times it
(``algorithm.log_prob_micro_batch_size``), side by side in one run on the same ranks.

Same model and batch as bench_train (its ``--layers``, ``--vocab``, ``--prompts``, ``--n``, lengths);
the reference is a second, frozen copy of the model (kl_loss_coef > 0), prompts shared as on CPU
by default. One warm-up per variant (its log-probs kept, to compare), then ``--repeats`` rounds
with the variants interleaved (order rotated); a run is old + reference between two barriers, the
slowest rank's wall-clock. The last line is a JSON object: ``log_prob`` true, ``variants`` name ->
median_s, runs_s, forwards and packed_tokens (per rank, old + ref), ``ratio`` (the training
micro-batch's median over the larger one's), ``max_logp_diff`` (largest |difference| of a log-prob
between the variants), the workload. With shared prompts a larger micro-batch also packs fewer
prompt copies (packed_tokens says how many), as the trainer's would.
"""

from __future__ import annotations

import os
import shutil
import time

from scripts import bench_common as bc

LOG_PROB_TRAIN_MICRO = 2  # the update's micro-batch in this benchmark (sequences per rank)


def log_prob_configs(factor: int) -> dict:
    from rlcore.algo.log_prob import log_prob_micro
    from rlcore.config import AlgorithmConfig

    base = dict(micro_batch_size=LOG_PROB_TRAIN_MICRO, kl_loss_coef=0.001, share_prompt=True)
    return {"train_micro": log_prob_micro(AlgorithmConfig(**base)),
            f"x{factor}": log_prob_micro(AlgorithmConfig(**base,
                                                         log_prob_micro_batch_size=factor * LOG_PROB_TRAIN_MICRO))}


def no_grad_forwards(policy, ref, local, cfg, device):
    """What train_on_batch computes before the update: old, then reference log-probs (N, T)."""
    from rlcore.algo import grpo

    old = grpo.compute_logprobs_in_chunks(policy, local, 1.0, cfg, device, shared=True)
    with ref.on_device():
        ref_logp = grpo.compute_logprobs_in_chunks(ref, local, 1.0, cfg, device, shared=True)
    return old, ref_logp


def timed(policy, ref, local, cfg, device) -> tuple[float, tuple]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = no_grad_forwards(policy, ref, local, cfg, device)
    dist.barrier()
    return time.perf_counter() - start, out


def log_prob_worker(args, info) -> None:
    import torch
    import torch.distributed as dist

    from rlcore.dist import all_reduce_max
    from rlcore.engine_veomni import VeOmniPolicy
    from scripts.bench_train import global_batch, packing, setup

    root, policy = setup(args, info)
    ref = VeOmniPolicy(os.path.join(root, "model"), info, trainable=False)
    batch, _ = global_batch(args)
    per = len(batch) // info.world_size
    local = batch.select(list(range(info.rank * per, (info.rank + 1) * per)))
    cfgs = log_prob_configs(args.log_prob_factor)
    names = list(cfgs)
    first = {name: timed(policy, ref, local, cfg, info.device)[1] for name, cfg in cfgs.items()}  # warm-up
    diff = max((a - b).abs().max().item() for name in names[1:] for a, b in zip(first[name], first[names[0]]))
    runs = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names[rep % 2:] + names[: rep % 2]:
            runs[name].append(timed(policy, ref, local, cfgs[name], info.device)[0])
        bc.say(info.rank, f"round {rep + 1}/{args.repeats}: " + ", ".join(f"{n} {runs[n][-1]:.3f}s" for n in names))
    variants = {}
    for name in names:
        wall = all_reduce_max(runs[name]) if len(runs[name]) else []
        forwards, tokens = packing(local, cfgs[name])  # a shared prompt is packed once per micro-batch
        variants[name] = {"median_s": bc.median(wall), "runs_s": wall, "forwards": 2 * forwards,
                          "packed_tokens": 2 * tokens}
    result = {"log_prob": True, "variants": variants,
              "ratio": variants[names[0]]["median_s"] / variants[names[1]]["median_s"],
              "max_logp_diff": all_reduce_max([diff])[0], "factor": args.log_prob_factor,
              "train_micro": LOG_PROB_TRAIN_MICRO, "prompts": args.prompts, "n": args.n,
              "prompt_len": args.prompt_len, "response_len": args.response_len, "layers": args.layers,
              "vocab": args.vocab, "params": policy.num_params, "repeats": args.repeats, "ranks": info.world_size,
              "threads": torch.get_num_threads()}
    if info.rank == 0:
        bc.write_result(result)
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def print_log_prob(r: dict) -> None:
    for name, v in r["variants"].items():
        print(f"  {name:12s} {v['median_s']:8.3f}s  {v['forwards']} no-grad forwards and {v['packed_tokens']} "
              f"packed tokens per rank  runs {[round(x, 3) for x in v['runs_s']]}")
    print(f"old + ref log-probs: micro-batch {r['train_micro']} (training's) / {r['factor']}x = {r['ratio']:.2f}x "
          f"wall-clock | max |log-prob difference| {r['max_logp_diff']:.1e}")
