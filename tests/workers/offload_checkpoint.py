"""torchrun worker for tests/test_offload_checkpoint.py, run with RLCORE_TEST_REAL_OFFLOAD=1: every
offload really moves state (into host copies; the original storages hold 0xFF garbage meanwhile).

Usage: torchrun --nproc_per_node=N offload_checkpoint.py MODEL_DIR OUT_DIR

Trainable policies, all on the same data (engine_train.py's micro-batches and loss):
  A  never offloaded: step 1, checkpoint ckpt_a + HF export hf_a, step 2.
  B  step 1, offload params + optimizer (the state after to_generation), checkpoint ckpt_b and HF
     export hf_b while offloaded, onload, step 2.
  C  fresh, offloaded before anything happens, loads ckpt_b into that state, onload, step 2.
  D  fresh and resident: the trainer's order around a resume through rlcore.run.checkpoint and the real
     PhaseSwitcher (fake rollout): load ckpt_b, to_generation (weights pushed, then offloaded),
     checkpoint.save + export_hf while offloaded (ckpt_d, hf_d), to_training, step 2.
Frozen references: plain vs offload_outside_forward (log-probs in one on_device() block and alone).
Rank 0 writes results.json and params_{a,b,c,d}.pt.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

import torch
import torch.distributed as dist

from engine_train import ENGINE_KW, TEMPERATURE, all_data, full_params, train_step  # same folder
from rlcore.dist import init_distributed
from rlcore.engine.offload import HostCopies
from rlcore.engine_veomni import VeOmniPolicy
from rlcore.metrics import Timer
from rlcore.run import checkpoint
from rlcore.step.switch import PhaseSwitcher


EXTRA = {"trainer": {"step": 1}}  # what rlcore.run.checkpoint.save stores, so checkpoint.load reads it


class FakeRollout:
    """What PhaseSwitcher needs from the rollout; keeps the pushed weights."""
    released: set = set()
    sleep_level = None
    weights_valid = False
    fused_experts = None

    def update_weights(self, weights, full: bool) -> int:
        self.pushed = {name: t.detach().cpu().clone() for name, t in weights}
        self.weights_valid = True
        return len(self.pushed)

    def release_memory(self) -> None:
        pass

    def resume_memory(self, tags) -> None:
        pass


def poisoned(policy: VeOmniPolicy, what: str) -> bool:
    """Every storage of ``what`` holds garbage: the state really left (test mode only)."""
    tensors = policy._state_tensors(what)
    return bool(tensors) and all(HostCopies.is_poisoned(t) for t in tensors)


def refuses(fn) -> bool:
    try:
        fn()
    except RuntimeError as e:
        return "offloaded" in str(e)
    return False


def run_a(model_dir, info, data, out) -> dict:
    a = VeOmniPolicy(model_dir, info, **ENGINE_KW)
    train_step(a, data[0][info.rank], info.world_size)
    a.save_checkpoint(os.path.join(out, "ckpt_a"), extra_state=EXTRA)
    a.save_hf(os.path.join(out, "hf_a"))
    train_step(a, data[1][info.rank], info.world_size)
    return full_params(a)


def run_b(model_dir, info, data, out, res) -> dict:
    b = VeOmniPolicy(model_dir, info, **ENGINE_KW)
    train_step(b, data[0][info.rank], info.world_size)
    after_step1 = full_params(b)
    b.offload(params=True, optimizer=True)
    res["b_state_left"] = poisoned(b, "params") and poisoned(b, "optimizer")
    mb = data[1][info.rank][0]
    res["b_forward_refused"] = refuses(lambda: b.forward_logprobs(mb["input_ids"], mb["position_ids"], mb["labels"]))
    res["b_step_refused"] = refuses(b.step)
    b.save_checkpoint(os.path.join(out, "ckpt_b"), extra_state=EXTRA)
    res["b_offloaded_after_save"] = b.offloaded == {"params": True, "optimizer": True} and poisoned(b, "params") \
        and poisoned(b, "optimizer")
    b.save_hf(os.path.join(out, "hf_b"))
    exported = full_params(b)  # named_hf_weights on an offloaded engine
    res["b_export_while_offloaded_exact"] = _equal(exported, after_step1)
    res["b_offloaded_after_export"] = b.offloaded["params"] and poisoned(b, "params")
    b.onload()
    train_step(b, data[1][info.rank], info.world_size)
    return full_params(b)


def run_c(model_dir, info, data, out, res) -> dict:
    c = VeOmniPolicy(model_dir, info, **ENGINE_KW)
    c.offload()
    res["c_loaded_extra"] = c.load_checkpoint(os.path.join(out, "ckpt_b"))
    res["c_offloaded_after_load"] = c.offloaded == {"params": True, "optimizer": True} and poisoned(c, "params") \
        and poisoned(c, "optimizer")
    c.onload()
    train_step(c, data[1][info.rank], info.world_size)
    return full_params(c)


def run_d(model_dir, info, data, out, res, step1: dict) -> dict:
    d = VeOmniPolicy(model_dir, info, **ENGINE_KW)
    rollout = FakeRollout()
    switch = PhaseSwitcher(d, rollout, Timer(), "cpu", offload_params=True, offload_optimizer=True,
                           free_kv_cache=False, sync_bucket_mb=0.05, rank=info.rank)
    res["d_loaded_trainer_state"] = checkpoint.load(d, os.path.join(out, "ckpt_b"), info.rank)  # lifecycle.resume
    switch.phase = "training"
    switch.to_generation()  # what lifecycle.resume does next
    res["d_pushed_exact"] = _equal(rollout.pushed, step1)
    res["d_offloaded_in_generation"] = poisoned(d, "params") and poisoned(d, "optimizer")
    d_out = os.path.join(out, "d")
    os.makedirs(d_out, exist_ok=True)  # the loop makes the output folder at its start; save requires it
    checkpoint.save(d, d_out, 1, {"step": 1}, info.rank, keep_last=2)  # maybe_save's call, state offloaded
    checkpoint.export_hf(d, os.path.join(out, "hf_d"), "float32", info.is_main)
    res["d_offloaded_after_save"] = d.offloaded == {"params": True, "optimizer": True} and poisoned(d, "params")
    switch.to_training()
    train_step(d, data[1][info.rank], info.world_size)
    return full_params(d)


def run_ref(model_dir, info, data, res) -> None:
    plain = VeOmniPolicy(model_dir, info, trainable=False)
    off = VeOmniPolicy(model_dir, info, trainable=False, offload_outside_forward=True)
    res["ref_offloaded_at_start"] = off.offloaded["params"] and poisoned(off, "params")
    res["ref_describe"] = off.describe()
    mbs = [mb for step in data for mb in step[info.rank]]
    args = [(mb["input_ids"], mb["position_ids"], mb["labels"]) for mb in mbs]
    want = [plain.forward_logprobs(*a, temperature=TEMPERATURE)[0] for a in args]
    moves, move = [], off._move
    off._move = lambda what, to_host: (moves.append([what, to_host]), move(what, to_host))[1]
    with off.on_device():
        res["ref_resident_in_block"] = not off.offloaded["params"] and not poisoned(off, "params")
        got = [off.forward_logprobs(*a, temperature=TEMPERATURE)[0] for a in args]
    res["ref_block_moves"] = list(moves)  # one in, one out, however many forwards ran inside
    res["ref_offloaded_after_block"] = off.offloaded["params"] and poisoned(off, "params")
    alone = off.forward_logprobs(*args[0], temperature=TEMPERATURE)[0]  # loads itself for one forward
    res["ref_offloaded_after_single"] = off.offloaded["params"] and poisoned(off, "params")
    res["ref_block_exact"] = all(torch.equal(g, w) for g, w in zip(got, want))
    res["ref_single_exact"] = torch.equal(alone, want[0])
    res["ref_num_forwards"] = len(args)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    assert os.environ.get("RLCORE_TEST_REAL_OFFLOAD") == "1"
    info = init_distributed("cpu")
    data = all_data(info.world_size)[:2]
    res: dict = {"world_size": info.world_size}
    final = {"a": run_a(model_dir, info, data, out)}
    final["b"] = run_b(model_dir, info, data, out, res)
    final["c"] = run_c(model_dir, info, data, out, res)
    final["d"] = run_d(model_dir, info, data, out, res, _load_hf(os.path.join(out, "hf_a")))
    gc.collect()  # the four trainable engines are gone by now
    run_ref(model_dir, info, data, res)
    for k in "bcd":
        res[f"final_{k}_equals_a"] = _equal(final[k], final["a"])
    if info.is_main:
        for k, params in final.items():
            torch.save(params, os.path.join(out, f"params_{k}.pt"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


def _load_hf(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
