"""Benchmark: the train phase of one GRPO step (forward + backward of one optimizer step's
samples) on 2 CPU ranks, with the packing options switched on one after the other.

    .venv/bin/python scripts/bench_train.py [--prompts 8] [--n 8] [--prompt-len 48] [--response-len 12]
        [--micro-batch-tokens 2048] [--repeats 3] [--layers 30] [--vocab 49152] [--nproc 2]
        [--log-prob-factor 4]  (the no-gradient forwards instead: scripts/bench_log_prob.py)

Starts its own ranks (torchrun, gloo). Rank 0 writes a random model with SmolLM2-135M-Instruct's
config (LlamaForCausalLM, 576 wide, 30 layers, 9/3 heads, 49152 vocab, tied embeddings; nothing
is downloaded; ``--layers`` and ``--vocab`` shrink it) and every rank shards it with VeOmni FSDP2
(rlcore.engine_veomni.VeOmniPolicy). The workload is an arithmetic-task GRPO step shaped like
SmolLM2's: ``--prompts`` groups of ``--n`` samples (consecutive samples share their prompt),
prompts of about ``--prompt-len`` tokens (+-1/6), responses of ``--response-len`` / 2 to 3/2 of
it (fixed seed), 0/1 rewards, GRPO advantages; each rank trains on its contiguous share.

Each variant runs ``grpo.accumulate_gradients`` once on that batch (on-policy: old log-probs None;
token-mean, vanilla loss, no KL, no entropy bonus), exactly as the trainer's single mini-batch
does, without ``policy.step()``: the weights stay put, so the gradients must agree. The variants
are cumulative:

  baseline        every position through the LM head, no prompt sharing, 8 sequences per
                  micro-batch (the trainer before these options)
  +response_only  only the positions that predict response tokens reach the LM head
  +shared_prompt  each group's prompt computed once per micro-batch (block attention mask)
  +token_budget   micro-batches packed up to ``--micro-batch-tokens`` tokens

Timing: one warm-up run per variant, then ``--repeats`` rounds, the variants interleaved in each
round (order rotated); a run is the whole ``accumulate_gradients`` call between two barriers,
on the slowest rank. The last line is a JSON object:

  baseline_s, optimized_s  median seconds of ``baseline`` and ``+token_budget`` (all options on)
  speedup                  baseline_s / optimized_s; ``target_speedup`` 2.5, ``meets_target``
  max_grad_rel_diff        max over variants of ||g - g_baseline|| / ||g_baseline||, g the
                           unsharded gradient vector (the warm-up run's)
  variants                 name -> median_s, peak_rss_mib (max over ranks and runs of the peak RSS
                           during a run minus the RSS before it; the warm-up run starts from a
                           trimmed heap, so it shows the run's whole footprint), grad_rel_diff, cpu_s
                           (median process CPU seconds summed over ranks), micro_batches and
                           packed_tokens (per rank, the most of any rank)
  plus the workload (prompts, n, prompt_len, response_len, micro_batch_tokens, layers, vocab,
  params, repeats, ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

# SmolLM2-135M-Instruct's config.json (HuggingFaceTB/SmolLM2-135M-Instruct)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
               tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               hidden_act="silu", attention_bias=False, mlp_bias=False)
VARIANTS = ("baseline", "+response_only", "+shared_prompt", "+token_budget")
TARGET_SPEEDUP = 2.5


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompt groups in the global batch")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--response-len", type=int, default=12)
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="the +token_budget variant's budget")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up)")
    p.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    p.add_argument("--vocab", type=int, default=SMOLLM2["vocab_size"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--log-prob-factor", type=int, default=0,
                   help="instead: time the old + reference log-prob forwards with training's micro-batch vs "
                        "this many times it (algorithm.log_prob_micro_batch_size; scripts/bench_log_prob.py)")
    args = p.parse_args(argv)
    if min(args.prompts, args.n, args.prompt_len, args.response_len, args.micro_batch_tokens, args.repeats,
           args.layers, args.nproc) < 1 or args.vocab < 16:
        p.error("every count must be >= 1 and --vocab >= 16")
    if (args.prompts * args.n) % args.nproc:
        p.error("--prompts x --n must be a multiple of --nproc (every rank trains on as many samples)")
    return args


def variant_fields(args) -> dict[str, dict]:
    """AlgorithmConfig fields per variant: each adds one option to the one before."""
    base = dict(response_only_logits=False, share_prompt=False, micro_batch_size=8, micro_batch_tokens=None)
    steps = [{}, dict(response_only_logits=True), dict(share_prompt=True),
             dict(micro_batch_tokens=args.micro_batch_tokens)]
    out, fields = {}, dict(base)
    for name, change in zip(VARIANTS, steps):
        fields = {**fields, **change}
        out[name] = dict(fields)
    return out


# ----------------------------------------------------------------------------- set-up


def write_model(out_dir: str, layers: int, vocab: int, seed: int) -> str:
    """A randomly initialised SmolLM2-shaped LlamaForCausalLM as an HF safetensors folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers, "vocab_size": vocab}, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def setup(args, info):
    """Rank 0 writes the model into a temp folder every rank gets; the sharded policy."""
    import torch.distributed as dist

    from rlcore.engine_veomni import VeOmniPolicy

    holder = [tempfile.mkdtemp(prefix="bench_train_") if info.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    if info.rank == 0:
        write_model(os.path.join(root, "model"), args.layers, args.vocab, args.seed)
    dist.barrier()
    return root, VeOmniPolicy(os.path.join(root, "model"), info, lr=1e-6, total_steps=1)


def global_batch(args):
    """The step's samples (groups of ``n`` consecutive sequences sharing one prompt) and their
    0/1 rewards, the same on every rank (fixed seed)."""
    import torch

    from rlcore.algo.batch import RolloutBatch

    g = torch.Generator().manual_seed(args.seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    tokens = lambda k: torch.randint(3, args.vocab, (k,), generator=g).tolist()  # noqa: E731
    spread = args.prompt_len // 6
    prompts = [tokens(rand(max(1, args.prompt_len - spread), args.prompt_len + spread)) for _ in range(args.prompts)]
    lo, hi = max(1, args.response_len // 2), max(1, args.response_len * 3 // 2)
    responses = [tokens(rand(lo, hi)) for _ in range(args.prompts * args.n)]
    total = len(responses)
    batch = RolloutBatch([p for p in prompts for _ in range(args.n)], responses,
                              [[0.0] * len(r) for r in responses], ["0"] * total, ["stop"] * total, args.n)
    rewards = torch.bernoulli(torch.full((total,), 0.5), generator=g)
    return batch, rewards


def local_inputs(args, info):
    """This rank's share of the batch and its ``UpdateInputs`` (on-policy, no reference)."""
    from rlcore import advantage
    from rlcore.algo import grpo

    batch, rewards = global_batch(args)
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), args.n)  # (N, T)
    per = len(batch) // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local = batch.select(mine)
    mask = local.response_mask()
    inp = grpo.UpdateInputs(adv[mine][:, : mask.shape[1]].to(info.device), None, None,
                            local.rollout_logp_matrix().to(info.device), mask.to(info.device), 1.0,
                            info.world_size, norm_len=max(len(r) for r in batch.response_ids))
    return local, inp


def configs(args) -> dict:
    from rlcore.config import AlgorithmConfig

    return {name: AlgorithmConfig(loss_agg_mode="token-mean", policy_loss="vanilla", kl_loss_coef=0.0,
                                  entropy_coef=0.0, **fields)
            for name, fields in variant_fields(args).items()}


def packing(local, cfg) -> tuple[int, int]:
    """(micro-batches, packed tokens) of this rank's share under ``cfg`` (collective)."""
    from rlcore.algo.packing import pack, split_micro

    parts = split_micro(local, list(range(len(local))), cfg)
    tokens = 0
    for idx in parts:
        sub = local.select(idx)
        tokens += pack(sub.prompt_ids, sub.response_ids, "cpu", share_prompt=bool(cfg.share_prompt),
                            response_only=cfg.response_only_logits)["input_ids"].shape[1]
    return len(parts), tokens


# ----------------------------------------------------------------------------- measurement


def trim_heap() -> None:
    """Hand the allocator's free pages back to the OS (glibc), so that a run's RSS increase is
    its own and not hidden by memory an earlier run freed but the heap kept."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRss:
    """Peak RSS increase (MiB) over a block (from a trimmed heap with ``trim``): VmHWM reset at
    the start where Linux allows it, else the RSS sampled every 10 ms in a thread."""

    def __init__(self, trim: bool):
        self.trim = trim

    def __enter__(self):
        if self.trim:
            trim_heap()
        self.before = bc.rss_mb()
        self.exact = bc.reset_peak_rss()
        self.samples, self.done = [self.before], threading.Event()
        if not self.exact:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.01):
            self.samples.append(bc.rss_mb())

    def __exit__(self, *exc):
        self.done.set()
        if not self.exact:
            self.thread.join()
        peak = bc.peak_rss_mb() if self.exact else max(self.samples)
        self.peak_mib = max(0.0, peak - self.before)


def run_once(policy, local, inp, cfg, trim: bool = False) -> tuple[float, float, float]:
    """(wall seconds on this rank, process CPU seconds, peak RSS increase MiB) of one
    ``accumulate_gradients`` call from zeroed gradients, barriers on both sides. ``trim``: the
    heap is trimmed first (the warm-up runs: their RSS increase is the run's whole footprint; a
    timed run reuses the heap's free pages, as the trainer's steps do, and is timed so)."""
    import torch.distributed as dist

    from rlcore.algo import grpo

    policy.optimizer.zero_grad(set_to_none=True)
    with PeakRss(trim) as mem:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        grpo.accumulate_gradients(policy, local, list(range(len(local))), inp, cfg)
        dist.barrier()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, mem.peak_mib


def grad_vector(policy):
    """All accumulated gradients, unsharded and flattened in parameter order (collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        parts = []
        for p in policy.model.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append((g.full_tensor() if isinstance(g, DTensor) else g).flatten().float().cpu())
        return torch.cat(parts)


def warm_up(policy, local, inp, cfgs: dict, info) -> tuple[dict[str, float], dict[str, float]]:
    """One run per variant from a trimmed heap: its peak RSS increase, and its gradient against
    the baseline's, ||g - g0|| / ||g0||."""
    reference, diffs, peaks = None, {}, {}
    for name, cfg in cfgs.items():
        peaks[name] = run_once(policy, local, inp, cfg, trim=True)[2]
        g = grad_vector(policy)
        if reference is None:
            reference = g
        diffs[name] = float((g - reference).norm() / reference.norm().clamp_min(1e-30))
        bc.say(info.rank, f"warm-up {name}: grad rel diff {diffs[name]:.2e}")
        del g
    return diffs, peaks


def timed_rounds(args, policy, local, inp, cfgs: dict, info) -> dict[str, dict[str, list]]:
    """``--repeats`` rounds of every variant, order rotated per round: per variant the lists of
    wall seconds, CPU seconds and peak RSS increase of this rank."""
    names = list(cfgs)
    out = {name: {"wall": [], "cpu": [], "rss": []} for name in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            wall, cpu, rss = run_once(policy, local, inp, cfgs[name])
            for key, v in zip(("wall", "cpu", "rss"), (wall, cpu, rss)):
                out[name][key].append(v)
        bc.say(info.rank, f"round {rep + 1}/{args.repeats}: "
                          + ", ".join(f"{n} {out[n]['wall'][-1]:.3f}s" for n in names))
    return out


def reduce_over_ranks(values: list[float], op: str) -> list[float]:
    from rlcore.dist import all_reduce_max, all_reduce_sum

    return all_reduce_max(values) if op == "max" else all_reduce_sum(values)


def summarize(args, policy, measured: dict, diffs: dict, packs: dict, info) -> dict:
    """Per variant: the slowest rank's wall time per run, CPU time summed over ranks, the peak
    RSS increase over ranks and runs (the warm-up's included); then the medians and the headline figures."""
    variants = {}
    for name, m in measured.items():
        wall = reduce_over_ranks(m["wall"], "max")
        cpu = reduce_over_ranks(m["cpu"], "sum")
        micro, tokens = reduce_over_ranks(list(packs[name]), "max")
        variants[name] = {"median_s": bc.median(wall), "peak_rss_mib": reduce_over_ranks([max(m["rss"])], "max")[0],
                          "grad_rel_diff": diffs[name], "cpu_s": bc.median(cpu), "runs_s": wall,
                          "micro_batches": int(micro), "packed_tokens": int(tokens)}
    base, best = variants[VARIANTS[0]]["median_s"], variants[VARIANTS[-1]]["median_s"]
    return {
        "baseline_s": base, "optimized_s": best, "speedup": base / best,
        "max_grad_rel_diff": max(diffs.values()), "target_speedup": TARGET_SPEEDUP,
        "meets_target": base / best >= TARGET_SPEEDUP, "variants": variants,
        "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "response_len": args.response_len,
        "micro_batch_tokens": args.micro_batch_tokens, "layers": args.layers, "vocab": args.vocab,
        "params": policy.num_params, "repeats": args.repeats, "ranks": info.world_size,
    }


def worker(args) -> None:
    import torch.distributed as dist

    from rlcore.dist import init_distributed

    info = init_distributed("cpu")
    if args.log_prob_factor:
        from scripts.bench_log_prob import log_prob_worker

        return log_prob_worker(args, info)
    root, policy = setup(args, info)
    local, inp = local_inputs(args, info)
    cfgs = configs(args)
    packs = {name: packing(local, cfg) for name, cfg in cfgs.items()}
    bc.say(info.rank, f"model {policy.num_params / 1e6:.1f}M params ({args.layers} layers, vocab {args.vocab}), "
                      f"{info.world_size} ranks, {args.prompts} prompts x {args.n} samples, "
                      f"{len(local)} sequences per rank, attention {policy.attn_implementation}")
    diffs, peaks = warm_up(policy, local, inp, cfgs, info)
    measured = timed_rounds(args, policy, local, inp, cfgs, info)
    for name, rss in peaks.items():
        measured[name]["rss"].append(rss)
    result = summarize(args, policy, measured, diffs, packs, info)
    if info.rank == 0:
        bc.write_result(result)
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    r = bc.run_or_relaunch(os.path.abspath(__file__), argv, parse_args, worker)
    if r is None:  # this process was a rank
        return
    if r.get("log_prob"):
        from scripts.bench_log_prob import print_log_prob

        print_log_prob(r)
        print(json.dumps(r))
        return
    for name, v in r["variants"].items():
        print(f"  {name:16s} {v['median_s']:8.3f}s  x{r['baseline_s'] / v['median_s']:5.2f}  "
              f"{v['micro_batches']} micro-batches, {v['packed_tokens']} tokens/rank  "
              f"peak +{v['peak_rss_mib']:.0f} MiB  grad rel diff {v['grad_rel_diff']:.1e}")
    print(f"baseline {r['baseline_s']:.3f}s | optimized {r['optimized_s']:.3f}s | speedup {r['speedup']:.2f}x "
          f"(target {r['target_speedup']}x: {'met' if r['meets_target'] else 'NOT met'}) | "
          f"max grad rel diff {r['max_grad_rel_diff']:.1e}")
    print(json.dumps(r))


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(sys.argv[1:]))
