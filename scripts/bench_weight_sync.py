"""Benchmark: the trainer -> vLLM weight sync on 2 CPU ranks, against a disk round trip and a floor.

    .venv/bin/python scripts/bench_weight_sync.py [--params 100e6] [--bucket-mb 64[,256,...]] [--reps 5] [--moe [--experts 8]]

Starts its own ranks (torchrun). A random Qwen3-shaped model of about ``--params`` parameters is
sharded with VeOmni FSDP2 (one AdamW step moves it away from the checkpoint) next to an
in-process vLLM engine per rank (tp=1). Measured in one run, each a median of ``--reps``
repetitions after one warm-up, methods interleaved, time = the slowest rank (barrier to barrier):

  sync   the project's sync: bucketed all-gather of the FSDP2 shards (rlcore.engine.bucket_gather) streamed
         into vLLM's reload_weights (what PhaseSwitcher runs every step)
  naive  save an HF checkpoint to disk (VeOmniPolicy.save_hf) and reload vLLM's weights from it
  floor  one all_gather_into_tensor of all parameters as one flat, pre-allocated buffer, plus one
         reload_weights of full tensors gathered beforehand (no packing, no streaming); also
         reported with the gather done as one broadcast per rank, the gloo primitive the sync
         uses (floor_bcast_s, ratio_to_floor_bcast: the stricter comparison)
  kernel floor (floor_kernel_s): each rank writes its share of the bytes once, then every
         weight is packed into vLLM's CPU (oneDNN) kernel straight from full tensors: the least
         any sync into vLLM on CPU can cost. naive_s over it (speedup_ceiling_kernel) and over
         vLLM's own load of gathered tensors (speedup_ceiling_reload) bound speedup_vs_naive here

``--moe``: a Qwen3-MoE instead (8 experts, top-2, experts as wide as the model; ``--experts N`` for
N narrower ones) trained with
expert parallelism over all ranks: the experts are gathered over the EP group and handed to
vLLM as one fused tensor per layer and kind (the sync; its CPU MoE re-packed on reload), and,
measured in the same run for comparison, split per expert as the checkpoint names them
(``sync_per_expert``: what the sync did before). ``tensors`` counts what each hands vLLM. The
floors still gather only the FSDP2 buckets (experts travel alone), so they are lower bounds for
the MoE case.

Then vLLM is reset to the checkpoint's weights, synced once more, and its log-probs of fresh
samples are compared with the trainer's (max |diff| over every sampled token of both ranks).
The last line is a JSON object: params, sync_s, naive_s, floor_s, speedup_vs_naive,
ratio_to_floor, peak_extra_rss_mb (max over ranks of VmHWM during a sync minus RSS before it),
max_logprob_diff, and the details (floor parts, bucket sweep, memory per method).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 768, 12, 4, 64, 2048, 32000


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=100e6, help="approximate parameter count (default 100e6)")
    p.add_argument("--bucket-mb", default="64", help="sync bucket MiB; a comma list adds a sweep (first is reported)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE (8 experts, top-2) with expert parallelism")
    p.add_argument("--experts", type=int, default=8, help="--moe: routed experts per layer (default 8)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="also push a LoRA adapter of this rank (all linear layers) on the same model: seconds and "
                        "bytes of the full-weight sync vs the adapter push, one after the other")
    args = p.parse_args(argv)
    args.buckets = [float(x) for x in str(args.bucket_mb).split(",")]
    if args.lora and args.moe:
        p.error("--lora with --moe: LoRA on MoE policies is not supported yet")
    if args.params < 1e6 or args.reps < 1 or args.nproc < 1 or any(b <= 0 for b in args.buckets):
        p.error("need --params >= 1e6, --reps >= 1, --nproc >= 1 and bucket sizes > 0")
    return args


def model_dims(params: float) -> dict:
    """Qwen3 dims giving about ``params`` parameters: 768 wide, 32k vocab, layers to fill."""
    per_layer = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN + 2 * HEAD_DIM
    vocab = VOCAB
    if params < 2 * VOCAB * HIDDEN + 2 * per_layer:  # small: shrink the vocabulary, keep 2 layers
        vocab = max(64, int((params - 2 * per_layer) // (2 * HIDDEN)))
    layers = max(1, round((params - 2 * vocab * HIDDEN) / per_layer))
    return dict(hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                intermediate_size=INTERMEDIATE, vocab_size=vocab, max_position_embeddings=256)


def moe_dims(params: float, experts: int = 8) -> dict:
    """Qwen3-MoE dims giving about ``params`` parameters: ``experts`` experts (width 768 for 8, the
    same total width split finer for more, at least 64), 32k vocab."""
    inter = max(64, HIDDEN * 8 // experts)
    per_layer = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + experts * (3 * HIDDEN * inter + HIDDEN) + 2 * HIDDEN
    vocab = VOCAB if params >= 2 * VOCAB * HIDDEN + per_layer else max(64, int((params - per_layer) // (2 * HIDDEN)))
    layers = max(1, round((params - 2 * vocab * HIDDEN) / per_layer))
    return dict(hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                num_experts=experts, top_k=2, moe_intermediate_size=inter, vocab_size=vocab,
                max_position_embeddings=256)


# ----------------------------------------------------------------------------- worker


CPU_S: dict[int, float] = {}  # id(fn) -> CPU seconds of its last timed() run, summed over ranks


def timed(fn) -> float:
    """Wall time of a collective ``fn`` on the slowest rank (barriers on both sides). Also notes
    its process CPU time summed over ranks in ``CPU_S``: on a shared, overloaded host the wall
    time mostly measures waiting for a core, the CPU time the work done."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    wall = time.perf_counter() - start
    CPU_S[id(fn)] = sum_over_ranks(cpu)
    return wall


def max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sum_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def max_over_ranks_dict(d: dict[str, float]) -> dict[str, float]:
    keys = sorted(d)
    return dict(zip(keys, max_over_ranks([d[k] for k in keys])))


def sync_scratch_bytes(policy, bucket_mb: float) -> int:
    """Bytes of the bucketed export's scratch buffers the engine keeps between syncs (CPU only)."""
    import torch

    return policy._sync_plan(torch.float32, bucket_mb).kept_buffers.nbytes()


def with_peak(fn, kept_mb: float) -> tuple[float, float]:
    """(seconds, peak extra RSS MiB on this rank) of ``fn``. ``kept_mb``: the sync's scratch
    buffers, kept between syncs on CPU; they count as extra though resident before the call."""
    before = bc.rss_mb() - kept_mb
    bc.reset_peak_rss()
    dt = timed(fn)
    return dt, max(0.0, bc.peak_rss_mb() - before)


def setup(args, info):
    """Model folder (rank 0 writes it), the FSDP2 policy moved one AdamW step, the vLLM engine."""
    import torch
    import torch.distributed as dist

    from rlcore.demo.toy import make_tiny_model, make_tiny_moe_model

    holder = [tempfile.mkdtemp(prefix="bench_sync_") if info.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    model_dir = os.path.join(root, "model")
    if info.rank == 0:
        if args.moe:
            make_tiny_moe_model(model_dir, **moe_dims(args.params, args.experts))
        else:
            make_tiny_model(model_dir, **model_dims(args.params))
    dist.barrier()
    from rlcore.engine_veomni import VeOmniPolicy
    from rlcore.colocate_rollout import ColocateRollout

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=10, ep_size=info.world_size if args.moe else 1)
    g = torch.Generator().manual_seed(info.rank)
    ids = torch.randint(3, 26, (1, 64), generator=g)
    logp, _ = policy.forward_logprobs(ids, torch.arange(64)[None], ids.roll(-1, 1), grad=True)
    policy.backward(-logp.mean())
    policy.step()  # every parameter moves: the synced weights differ from the checkpoint's
    rollout = ColocateRollout(model_dir, info, tp_size=1, seed=0, max_model_len=128, kv_cache_gb=0.25)
    return root, model_dir, policy, rollout


def floor_parts(policy, rollout, info) -> dict:
    """The two halves of the floor, each at its best: a pre-touched flat buffer for the gather,
    tensors already gathered for the load."""
    import torch
    import torch.distributed as dist

    gathered_mb = policy.sync_plan_summary("float32", 1e9)["max_bucket_mb"]  # one bucket = all params
    numel = int(gathered_mb * 2**20 / 4) // info.world_size
    send, out = torch.ones(numel), torch.ones(numel * info.world_size)
    full = list(policy.named_hf_weights_bucketed("float32", 1e9, fused_experts=bool(rollout.fused_experts)))  # the sync's
    gather = lambda: dist.all_gather_into_tensor(out, send)  # noqa: E731
    gather_s = timed(gather)
    gather_cpu = CPU_S[id(gather)]

    def broadcasts():  # the primitive the sync itself uses on gloo: one broadcast per rank
        for r in range(info.world_size):
            dist.broadcast(out[r * numel: (r + 1) * numel], src=r)

    bcast_s = timed(broadcasts)
    del send, out
    kernel = lambda: kernel_floor(full, info)  # noqa: E731
    kernel_s = timed(kernel)
    # vLLM's own transient memory while it loads (materialised layers, repacked weights): part
    # of every method's peak, a baseline for the sync's
    load = lambda: rollout.update_weights(iter(full))  # noqa: E731
    load_s, load_peak = with_peak(load, 0.0)
    return {"gather_s": gather_s, "gather_bcast_s": bcast_s, "load_s": load_s, "kernel_s": kernel_s,
            "load_peak_mb": load_peak, "cpu_s": gather_cpu + CPU_S[id(load)]}


def kernel_floor(full: list, info) -> None:
    """The least work any sync into vLLM's CPU kernels can do, with no loader around it: this
    rank writes its 1/N share of the bytes once (into a buffer all ranks could read, as with a
    node-shared gather), then every 2-D weight is packed into a oneDNN handle straight from the
    full tensor and the two vocab matrices are copied in place, which is what vLLM's CPU
    dispatch does after any load. Not a usable sync (no TP slicing, no fused q/k/v): a bound
    on what one could be."""
    import torch
    from vllm import _custom_ops as ops

    shards = [t.view(-1).tensor_split(info.world_size)[info.rank] for _, t in full]
    if not KERNEL_SCRATCH:  # allocated and touched once, like vLLM's resident buffers
        KERNEL_SCRATCH["shards"] = torch.zeros(sum(x.numel() for x in shards))
        KERNEL_SCRATCH.update({n: torch.zeros_like(t) for n, t in full if "embed_tokens" in n or "lm_head" in n})
    torch.cat(shards, out=KERNEL_SCRATCH["shards"])
    handles = []
    for name, t in full:
        if t.ndim != 2:
            continue
        handles.append(ops.create_onednn_mm(t.t(), 32))
        if name in KERNEL_SCRATCH:  # vocab weights stay resident in vLLM next to their handles
            KERNEL_SCRATCH[name].copy_(t)


KERNEL_SCRATCH: dict = {}


def run_methods(args, policy, rollout, root: str, info) -> dict:
    """Interleaved repetitions (the first is a warm-up): times and peak extra memory per method."""
    naive_dir = os.path.join(root, "naive_hf")
    naive_parts: dict[str, float] = {}

    def naive():
        start = time.perf_counter()
        policy.save_hf(naive_dir)  # per-tensor gathers, rank 0 writes; ends in a barrier
        naive_parts["save_s"] = time.perf_counter() - start
        start = time.perf_counter()
        rollout.update_weights_from_path(naive_dir)
        naive_parts["load_s"] = time.perf_counter() - start

    def sync(mb, fused=True):
        # full=False for the per-expert names: the engine guards a full push against naming fewer
        # weights than the previous full one (the fused names), and these are the same weights
        return lambda: rollout.update_weights(policy.named_hf_weights_bucketed("float32", mb, fused_experts=fused),
                                              full=fused)

    times: dict[str, list] = {}
    cpu: dict[str, list] = {}  # CPU seconds summed over ranks
    peaks: dict[str, float] = {}
    for rep in range(args.reps + 1):
        runs = [(f"sync_{mb:g}", sync(mb)) for mb in args.buckets] + [("naive", naive)]
        if args.moe:  # the per-expert push the sync replaced, side by side
            runs.append((f"sync_per_expert_{args.buckets[0]:g}", sync(args.buckets[0], fused=False)))
        runs = runs[rep % len(runs):] + runs[: rep % len(runs)]  # rotate the order per repetition
        for name, fn in runs:
            mb = float(name.rpartition("_")[2]) if name.startswith("sync_") else None
            dt, peak = with_peak(fn, sync_scratch_bytes(policy, mb) / 2**20 if mb else 0.0)
            peaks[name] = max(peaks.get(name, 0.0), peak)  # the warm-up too: first allocations
            if rep > 0:
                times.setdefault(name, []).append(dt)
                cpu.setdefault(name, []).append(CPU_S[id(fn)])
        parts = floor_parts(policy, rollout, info)
        peaks["floor_load"] = max(peaks.get("floor_load", 0.0), parts.pop("load_peak_mb"))
        floor_cpu = parts.pop("cpu_s")
        if rep > 0:
            cpu.setdefault("floor", []).append(floor_cpu)
            for k, v in parts.items():
                times.setdefault(f"floor_{k}", []).append(v)
            for k, v in max_over_ranks_dict(naive_parts).items():
                times.setdefault(f"naive_{k}", []).append(v)
        if rep == 0:
            bc.say(info.rank, "warm-up done")
        else:
            bc.say(info.rank, f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
        if info.rank == 0:
            shutil.rmtree(naive_dir, ignore_errors=True)
    return {"times": times, "peaks": peaks, "cpu": cpu}


def logprob_check(policy, rollout, model_dir: str, bucket_mb: float, info) -> dict:
    """vLLM reset to the checkpoint (stale), synced, then both sides score fresh samples."""
    import torch

    from rlcore.algo import grpo
    from rlcore.algo.batch import RolloutBatch

    g = torch.Generator().manual_seed(100 + info.rank)
    prompts = [torch.randint(3, 26, (16,), generator=g).tolist() for _ in range(8)]

    def worst() -> float:
        out = rollout.generate(prompts, n=2, temperature=1.0, max_tokens=16, seed=7)
        flat = [(p, s) for p, ss in zip(prompts, out) for s in ss]
        batch = RolloutBatch([p for p, _ in flat], [s.response_ids for _, s in flat],
                                  [s.logprobs for _, s in flat], ["0"] * len(flat),
                                  [s.finish_reason for _, s in flat], 2)
        mask = batch.response_mask()
        trainer = grpo.compute_logprobs_in_chunks(policy, batch, 1.0, 8, info.device).cpu()
        diff = ((trainer - batch.rollout_logp_matrix()).abs() * mask).max().item()
        return max_over_ranks([diff])[0]

    rollout.update_weights_from_path(model_dir)
    stale = worst()
    tensors = rollout.update_weights(policy.named_hf_weights_bucketed("float32", bucket_mb,
                                                                      fused_experts=bool(rollout.fused_experts)))
    out = {"stale_logprob_diff": stale, "max_logprob_diff": worst(), "tensors": tensors}
    per_expert = sum(1 for _ in policy.named_hf_weights_bucketed("float32", bucket_mb))
    if per_expert != tensors:  # MoE: the checkpoint's per-expert layout, pushed as the sync once did
        rollout.update_weights_from_path(model_dir)
        out["tensors_per_expert"] = rollout.update_weights(policy.named_hf_weights_bucketed("float32", bucket_mb),
                                                           full=False)
        out["max_logprob_diff_per_expert"] = worst()
    return out


def summarize(args, policy, measured: dict, check: dict) -> dict:
    import torch.distributed as dist

    t = {k: bc.median(v) for k, v in measured["times"].items()}
    names = sorted(measured["peaks"])
    peak = dict(zip(names, max_over_ranks([measured["peaks"][n] for n in names])))
    first = f"sync_{args.buckets[0]:g}"
    floor = t["floor_gather_s"] + t["floor_load_s"]
    return {
        "params": policy.num_params, "sync_s": t[first], "naive_s": t["naive"], "floor_s": floor,
        "speedup_vs_naive": t["naive"] / t[first], "ratio_to_floor": t[first] / floor,
        "peak_extra_rss_mb": peak[first], "max_logprob_diff": check["max_logprob_diff"],
        "stale_logprob_diff": check["stale_logprob_diff"], "bucket_mb": args.buckets[0],
        "tensors": check["tensors"],
        **{k: check[k] for k in ("tensors_per_expert", "max_logprob_diff_per_expert") if k in check},
        **({"sync_per_expert_s": t[f"sync_per_expert_{args.buckets[0]:g}"]} if args.moe else {}),
        "floor_gather_s": t["floor_gather_s"], "floor_load_s": t["floor_load_s"],
        # stricter floor: the gather done with the same gloo primitive as the sync (broadcasts)
        "floor_bcast_s": t["floor_gather_bcast_s"] + t["floor_load_s"],
        "ratio_to_floor_bcast": t[first] / (t["floor_gather_bcast_s"] + t["floor_load_s"]),
        "naive_save_s": t["naive_save_s"], "naive_load_s": t["naive_load_s"],
        # what the speedup could reach on this host: naive / vLLM's own load of tensors already
        # gathered (every sync through reload_weights pays it), and naive / the kernel floor
        "floor_kernel_s": t["floor_kernel_s"], "speedup_ceiling_reload": t["naive"] / t["floor_load_s"],
        "speedup_ceiling_kernel": t["naive"] / t["floor_kernel_s"],
        "sync_s_by_bucket_mb": {k.removeprefix("sync_"): v for k, v in t.items()
                                if k.startswith("sync_") and not k.startswith("sync_per_expert")},
        "peak_extra_rss_mb_by_method": peak,
        "cpu_s_by_method": {k: bc.median(v) for k, v in measured["cpu"].items()}, "plan": policy.sync_plan_summary("float32", args.buckets[0]),
        "reps": args.reps, "ranks": dist.get_world_size(),
    }


def lora_push(args, model_dir: str, info) -> dict:
    """--lora: a LoRA policy (one step taken, so B is not zero) and a LoRA engine on the same
    model; the adapter push timed ``--reps`` times, its bytes, and vLLM vs the trainer after it."""
    import torch

    from rlcore.config.lora import LoraConfig
    from rlcore.engine_veomni import LoraPolicy
    from rlcore.colocate_rollout import ColocateRollout

    policy = LoraPolicy(model_dir, info, lora=LoraConfig(rank=args.lora, alpha=2 * args.lora), lr=1e-3,
                        total_steps=10)
    g = torch.Generator().manual_seed(info.rank)
    ids = torch.randint(3, 26, (1, 64), generator=g)
    logp, _ = policy.forward_logprobs(ids, torch.arange(64)[None], ids.roll(-1, 1), grad=True)
    policy.backward(-logp.mean())
    policy.step()
    rollout = ColocateRollout(model_dir, info, tp_size=1, seed=0, max_model_len=128, kv_cache_gb=0.25,
                              lora_rank=args.lora)
    pushed = {}

    def push():
        pushed["n"], pushed["bytes"] = rollout.update_adapter(policy.adapter_weights(), policy.adapter_config())
    times = max_over_ranks([timed(push) for _ in range(args.reps)])
    out = rollout.generate([[5, 6, 7, 8]], n=2, max_tokens=8, temperature=1.0, seed=1)[0]
    worst = 0.0
    for s in out:
        seq = [5, 6, 7, 8] + s.response_ids
        lp, _ = policy.forward_logprobs(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None],
                                        torch.tensor([seq[1:]]), grad=False)
        worst = max(worst, (lp[0, 3:] - torch.tensor(s.logprobs)).abs().max().item())
    rollout.shutdown()
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return {"lora_rank": args.lora, "lora_push_s": bc.median(times), "lora_tensors": pushed["n"],
            "lora_bytes": pushed["bytes"], "lora_trainable_params": trainable,
            "lora_max_logprob_diff": max_over_ranks([worst])[0]}


def worker(args) -> None:
    import torch

    from rlcore.dist import init_distributed

    info = init_distributed("cpu")
    root, model_dir, policy, rollout = setup(args, info)
    bc.say(info.rank, f"model {policy.num_params / 1e6:.1f}M params, {info.world_size} ranks, "
                      f"buckets {args.buckets} MiB, {args.reps} reps")
    measured = run_methods(args, policy, rollout, root, info)
    check = logprob_check(policy, rollout, model_dir, args.buckets[0], info)
    result = summarize(args, policy, measured, check)
    if args.lora:
        rollout.shutdown()  # one engine at a time: the LoRA engine is built next
        result.update(lora_push(args, model_dir, info), full_bytes=policy.num_params * 4)
        result["lora_speedup"] = result["sync_s"] / result["lora_push_s"]
    if info.rank == 0:
        bc.write_result(result)
        shutil.rmtree(root, ignore_errors=True)
    if not args.lora:
        rollout.shutdown()
    torch.distributed.destroy_process_group()


def main(argv: list[str]) -> None:
    import json

    result = bc.run_or_relaunch(os.path.abspath(__file__), argv, parse_args, worker)
    if result is None:  # this process was a rank
        return
    print(f"params {result['params'] / 1e6:.1f}M | sync {result['sync_s']:.3f}s | naive {result['naive_s']:.3f}s"
          f" | floor {result['floor_s']:.3f}s (gather {result['floor_gather_s']:.3f} + load {result['floor_load_s']:.3f})"
          f" | speedup {result['speedup_vs_naive']:.1f}x | ratio to floor {result['ratio_to_floor']:.2f}"
          f" (broadcast floor {result['floor_bcast_s']:.3f}s: {result['ratio_to_floor_bcast']:.2f})"
          f" | peak extra {result['peak_extra_rss_mb']:.0f} MiB | max logprob diff {result['max_logprob_diff']:.2e}"
          f" | speedup ceiling: {result['speedup_ceiling_reload']:.1f}x through reload_weights,"
          f" {result['speedup_ceiling_kernel']:.1f}x at the kernel floor ({result['floor_kernel_s']:.3f}s)")
    if "tensors_per_expert" in result:
        print(f"experts: fused {result['tensors']} tensors, {result['sync_s']:.3f}s, max logprob diff "
              f"{result['max_logprob_diff']:.2e} | per expert {result['tensors_per_expert']} tensors, "
              f"{result['sync_per_expert_s']:.3f}s, max logprob diff {result['max_logprob_diff_per_expert']:.2e}")
    if "lora_push_s" in result:
        print(f"LoRA rank {result['lora_rank']}: adapter push {result['lora_push_s']:.3f}s, {result['lora_tensors']} "
              f"tensors, {result['lora_bytes'] / 2**20:.2f} MiB vs full sync {result['sync_s']:.3f}s, "
              f"{result['full_bytes'] / 2**20:.1f} MiB ({result['lora_speedup']:.1f}x); max logprob diff "
              f"{result['lora_max_logprob_diff']:.2e}")
    print(json.dumps(result))


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(lambda: main(sys.argv[1:]))
