"""Benchmark: Ulysses sequence parallelism in the train phase, with and without, side by side.

    .venv/bin/python scripts/bench_sp.py [--seq-len 2048] [--nproc 2] [--hidden 256] [--layers 4] [--repeats 3]

Writes a random tiny Qwen3 (4 heads, 2 KV heads, ``--hidden`` wide, ``--layers`` deep; nothing is
downloaded), then runs one launch of ``--nproc`` CPU ranks per setting, ``ulysses_size`` 1 and then
``--nproc``. Every rank holds one sequence of ``--seq-len`` tokens (a prompt of 16, the rest
response) and trains on it with ``grpo.accumulate_gradients`` exactly as the trainer's on-policy
mini-batch does (one sequence per micro-batch; the Ulysses group's sequences are gathered as
``grpo.train_on_batch`` gathers them), without an optimizer step.

Per setting (the slowest or largest rank): ``saved_mib``, the bytes autograd keeps for the backward
of one micro-batch's forward (every tensor a ``saved_tensors_hooks`` pack sees, each storage
counted once): the train phase's activation memory, less ``mask_mib``, the (S, S) attention masks
of the whole row that sdpa saves (O(S^2) on every rank with or without sequence parallelism);
``peak_rss_mib``, the process's peak resident memory during the first train call over what it held
before it (the kernel's high-water mark, reset by ``/proc/self/clear_refs`` just before the call:
activations, the sharded gradients, the all-to-all and gather buffers, allocator slack), the
measured per-rank peak; ``tokens_per_rank`` of one forward; ``seconds`` (median of ``--repeats`` runs of the whole call between barriers); the unsharded
gradient vector's norm. The last line is JSON: both settings, ``saved_ratio`` (with / without) and
``grad_rel_diff`` (||g_sp - g|| / ||g||).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from rlcore.algo import grpo
    from rlcore.algo.batch import RolloutBatch
    from rlcore.config import AlgorithmConfig
    from rlcore.dist import init_distributed
    from rlcore.engine_veomni import VeOmniPolicy

    info = init_distributed("cpu")
    policy = VeOmniPolicy(args.model, info, lr=1e-3, total_steps=1, ulysses_size=args.ulysses)
    g = torch.Generator().manual_seed(info.rank)
    ids = torch.randint(3, 20, (args.seq_len,), generator=g).tolist()
    batch = RolloutBatch([ids[:16]], [ids[16:]], [[0.0] * (args.seq_len - 16)], [""], ["stop"], 1)
    adv = torch.full((1, args.seq_len - 16), 1.0 if info.rank % 2 == 0 else -1.0)
    group, (gadv,), _ = grpo.sp_group_batch(policy, batch, adv)
    cfg = AlgorithmConfig(micro_batch_size=1)
    inp = grpo.UpdateInputs(gadv, None, None, torch.zeros_like(gadv), group.response_mask(), 1.0, info.world_size)
    saved, masks, peak = {}, {}, [0, 0]
    forward = policy.forward_logprobs

    def counted(*a, **k):  # the storages saved for backward by one micro-batch's forward
        saved.clear()
        masks.clear()
        out = forward(*a, **k)
        peak[0], peak[1] = max(peak[0], sum(saved.values())), max(peak[1], sum(masks.values()))
        return out

    def pack(t):
        # an (S, S) attention mask of the whole row (S >= the sequence): O(S^2), not per token
        whole = t.dim() >= 2 and t.shape[-1] == t.shape[-2] >= args.seq_len
        (masks if whole else saved)[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    policy.forward_logprobs = counted
    times, rss = [], 0.0
    for i in range(args.repeats + 1):
        policy.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if i == 0:  # later calls reuse what the allocator kept: the first one shows the peak
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            before = _status_mib("VmRSS")
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grpo.accumulate_gradients(policy, group, list(range(len(group))), inp, cfg)
        if i == 0:
            rss = _status_mib("VmHWM") - before
        dist.barrier()
        times.append(time.perf_counter() - start)
    from torch.distributed.tensor import DTensor

    grads = torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten()
                       for p in policy.model.parameters()])
    stats = torch.tensor([float(peak[0]), float(peak[1]), statistics.median(times[1:]), rss])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if info.rank == 0:
        torch.save(grads, args.grads)
        print("RESULT " + json.dumps({
            "ulysses_size": args.ulysses, "saved_mib": round(stats[0].item() / 2**20, 2),
            "mask_mib": round(stats[1].item() / 2**20, 2), "peak_rss_mib": round(stats[3].item(), 1),
            "tokens_per_rank": -(-args.seq_len // args.ulysses), "seconds": round(stats[2].item(), 3),
            "grad_norm": grads.norm().item()}), flush=True)
    dist.destroy_process_group()


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory line (kB) in MiB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ulysses", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--grads", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    from rlcore.demo.toy import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="bench_sp_")
    model = make_tiny_model(os.path.join(tmp, "model"), hidden_size=args.hidden, num_layers=args.layers,
                            intermediate_size=2 * args.hidden, max_position_embeddings=args.seq_len + 64)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VEOMNI_VERBOSITY": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
           # a fixed mmap threshold: glibc's moving one keeps freed blocks of up to 32 MiB resident,
           # and the peak RSS would then show the allocator's history more than the live tensors
           "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    rows = []
    for u in (1, args.nproc):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               os.path.abspath(__file__), "--worker", "--model", model, "--ulysses", str(u), "--seq-len",
               str(args.seq_len), "--repeats", str(args.repeats), "--grads", os.path.join(tmp, f"g{u}.pt")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"ulysses_size {u} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        rows.append(json.loads(lines[0][7:]))
        print(f"ulysses_size {u}: {rows[-1]['tokens_per_rank']} tokens per rank per forward, "
              f"saved for backward {rows[-1]['saved_mib']} MiB + the row's attention mask {rows[-1]['mask_mib']} MiB, "
              f"peak RSS +{rows[-1]['peak_rss_mib']} MiB, {rows[-1]['seconds']} s", flush=True)
    g1, g2 = (torch.load(os.path.join(tmp, f"g{u}.pt"), weights_only=True) for u in (1, args.nproc))
    print(json.dumps({"seq_len": args.seq_len, "nproc": args.nproc, "hidden": args.hidden, "layers": args.layers,
                      "settings": rows, "saved_ratio": round(rows[1]["saved_mib"] / rows[0]["saved_mib"], 3),
                      "peak_rss_ratio": round(rows[1]["peak_rss_mib"] / rows[0]["peak_rss_mib"], 3),
                      "seconds_ratio": round(rows[1]["seconds"] / rows[0]["seconds"], 3),
                      "grad_rel_diff": ((g2 - g1).norm() / g1.norm()).item()}))


if __name__ == "__main__":
    main()
