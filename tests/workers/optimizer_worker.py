"""torchrun worker for tests/test_optimizer.py (optim.optimizer: anyprecision_adamw), run with
RLCORE_TEST_REAL_OFFLOAD=1 (offloaded state really leaves: tests/workers/offload_checkpoint.py).

Usage: torchrun --nproc_per_node=N optimizer_worker.py MODEL_DIR OUT_DIR

  steps   VeOmniPolicy with anyprecision_adamw (VeOmni's defaults: bf16 state, Kahan on) trains the
          3 steps of engine_train.py's data; at each optimizer step a pre-hook records the full
          (clipped) gradients and the lr, and the full parameters after it: the test replays them
          through its own AnyPrecision AdamW (steps.pt).
  bytes   the optimizer state's bytes per trainable parameter after one step, for adamw and each
          anyprecision_adamw option (bytes.json): what rlcore.plan.memory counts.
  a-d     offload_checkpoint.py's runs A-D (offload, DCP save while offloaded, load into an
          offloaded / a fresh engine, the trainer's resume order through rlcore.run.checkpoint)
          with anyprecision_adamw: their params_{a,b,c,d}.pt and results.json, compared as there;
          then a fresh engine loads ckpt_a: its state's dtypes and bytes (results.json).
Rank 0 writes the files.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

import torch
import torch.distributed as dist

import offload_checkpoint as oc  # same folder
from engine_train import ENGINE_KW, all_data, full_params, train_step
from rlcore.dist import all_reduce_sum, init_distributed
from rlcore.engine import optim as engine_optim
from rlcore.engine.parts import hf_name
from rlcore.engine_veomni import VeOmniPolicy

ANY = {**ENGINE_KW, "optimizer": "anyprecision_adamw"}
VARIANTS = {"adamw": ENGINE_KW, "anyprecision_adamw": ANY,
            "anyprecision_adamw/float32": {**ANY, "optimizer_state_dtype": "float32"},
            "anyprecision_adamw/no_kahan": {**ANY, "kahan_summation": False},
            "anyprecision_adamw/float32/no_kahan": {**ANY, "optimizer_state_dtype": "float32",
                                                    "kahan_summation": False}}


def record_steps(model_dir, info, data) -> dict:
    policy = VeOmniPolicy(model_dir, info, **ANY)
    names = {id(p): hf_name(n) for n, p in policy.model.named_parameters()}
    rec = {"params0": full_params(policy), "grads": [], "lr": [], "params": [], "state_dtypes": None}

    def pre_hook(opt, args, kwargs):  # after clipping, before the update: what the optimizer sees
        rec["lr"].append(opt.param_groups[0]["lr"])
        rec["grads"].append({names[id(p)]: p.grad.full_tensor().clone() for g in opt.param_groups
                             for p in g["params"]})

    for opt in engine_optim.inner_optimizers(policy.optimizer):
        opt.register_step_pre_hook(pre_hook)
    for step in data:
        train_step(policy, step[info.rank], info.world_size)
        rec["params"].append(full_params(policy))
        if rec["state_dtypes"] is None:
            rec["state_dtypes"] = sorted({f"{k}:{v.dtype}" for opt in engine_optim.inner_optimizers(policy.optimizer)
                                          for st in opt.state.values() for k, v in st.items()})
    rec["group"] = {k: str(v) for k, v in policy.optimizer.param_groups[0].items() if k != "params"}
    return rec


def state_bytes(model_dir, info, data) -> dict:
    out = {}
    for name, kw in VARIANTS.items():
        policy = VeOmniPolicy(model_dir, info, **kw)
        train_step(policy, data[0][info.rank], info.world_size)
        nbytes, numel = all_reduce_sum([float(x) for x in engine_optim.state_bytes(policy.optimizer)])
        out[name] = {"bytes": nbytes, "trainable": numel, "per_param": nbytes / numel}
        del policy
        gc.collect()
    return out


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    assert os.environ.get("RLCORE_TEST_REAL_OFFLOAD") == "1"
    info = init_distributed("cpu")
    data = all_data(info.world_size)
    steps = record_steps(model_dir, info, data)
    nbytes = state_bytes(model_dir, info, data)
    gc.collect()
    oc.ENGINE_KW = ANY  # runs A-D read the module's ENGINE_KW when they build their engines
    res: dict = {}
    final = {"a": oc.run_a(model_dir, info, data[:2], out)}
    final["b"] = oc.run_b(model_dir, info, data[:2], out, res)
    final["c"] = oc.run_c(model_dir, info, data[:2], out, res)
    final["d"] = oc.run_d(model_dir, info, data[:2], out, res, oc._load_hf(os.path.join(out, "hf_a")))
    for k in "bcd":
        res[f"final_{k}_equals_a"] = oc._equal(final[k], final["a"])
    loaded = VeOmniPolicy(model_dir, info, **ANY)  # what a load leaves in the state
    loaded.load_checkpoint(os.path.join(out, "ckpt_a"))
    res["loaded_state_dtypes"] = sorted({f"{k}:{v.dtype}" for opt in engine_optim.inner_optimizers(loaded.optimizer)
                                         for st in opt.state.values() for k, v in st.items()})
    nbytes_loaded, numel = all_reduce_sum([float(x) for x in engine_optim.state_bytes(loaded.optimizer)])
    res["loaded_per_param"] = nbytes_loaded / numel
    if info.is_main:
        torch.save(steps, os.path.join(out, "steps.pt"))
        for k, params in final.items():
            torch.save(params, os.path.join(out, f"params_{k}.pt"))
        with open(os.path.join(out, "bytes.json"), "w") as f:
            json.dump(nbytes, f, indent=1)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
