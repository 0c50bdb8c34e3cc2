"""Checkpoints, HF export and resume while the policy's state is offloaded, and the reference
policy that leaves the device outside its forwards, on 2 CPU ranks with offload really moving
state (RLCORE_TEST_REAL_OFFLOAD=1: offloaded state lives in a host copy, the original storage
holds 0xFF garbage meanwhile, so any read of offloaded state shows up as NaN / a mismatch).

One torchrun launch (tests/workers/offload_checkpoint.py, its docstring lists runs A-D); the tests
compare what it wrote: equal means bit for bit, not close.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO, run_torchrun
from workers.launch import dcp_state, same

WORKER = os.path.join(REPO, "tests", "workers", "offload_checkpoint.py")


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("offload_ckpt")
    run_torchrun(WORKER, 2, tiny_model, str(out), env={"RLCORE_TEST_REAL_OFFLOAD": "1"})
    with open(out / "results.json") as f:
        res = json.load(f)
    params = {k: torch.load(out / f"params_{k}.pt", weights_only=True) for k in "abcd"}
    return {"out": str(out), "res": res, "params": params}


def _hf(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_offload_really_moves_state_and_guards_training(run):
    res = run["res"]
    assert res["b_state_left"], "offload left parameters or optimizer state readable in place"
    assert res["b_forward_refused"] and res["b_step_refused"]


def test_save_and_export_while_offloaded_equal_the_resident_ones(run, tiny_model, tmp_path):
    res, out = run["res"], run["out"]
    assert res["b_offloaded_after_save"] and res["b_offloaded_after_export"] and res["d_offloaded_after_save"]
    assert res["b_export_while_offloaded_exact"]
    ckpt_a = dcp_state(os.path.join(out, "ckpt_a"), tmp_path)
    assert set(ckpt_a) >= {"model", "optimizer"}
    for other in ("ckpt_b", os.path.join("d", "checkpoints", "step_1")):
        assert same(dcp_state(os.path.join(out, other), tmp_path), ckpt_a), f"{other} differs from ckpt_a"
    hf_a = _hf(os.path.join(out, "hf_a"))
    initial = _hf(tiny_model)
    assert _max_diff(hf_a, initial) > 1e-4  # step 1 moved the weights: equality below means something
    for other in ("hf_b", "hf_d"):
        hf = _hf(os.path.join(out, other))
        assert hf.keys() == hf_a.keys() and all(torch.equal(hf[n], hf_a[n]) for n in hf), f"{other} differs"


def test_resume_into_offloaded_or_resident_engine_is_bit_exact(run):
    res, params = run["res"], run["params"]
    assert res["c_loaded_extra"] == {"trainer": {"step": 1}}
    assert res["d_loaded_trainer_state"] == {"step": 1}
    assert res["c_offloaded_after_load"], "load_checkpoint changed the engine's offload state"
    assert res["d_pushed_exact"] and res["d_offloaded_in_generation"]
    for k in "bcd":
        diff = _max_diff(params[k], params["a"])
        print(f"run {k} vs never-offloaded run a after step 2: max |diff| = {diff:.1e}")
        assert res[f"final_{k}_equals_a"] and diff == 0.0


def test_reference_offloaded_outside_forward(run):
    res = run["res"]
    assert res["ref_offloaded_at_start"] and res["ref_resident_in_block"]
    assert res["ref_offloaded_after_block"] and res["ref_offloaded_after_single"]
    assert res["ref_block_exact"] and res["ref_single_exact"] and res["ref_num_forwards"] >= 4
    assert res["ref_block_moves"] == [["params", False], ["params", True]]
    assert "params on host outside forwards" in res["ref_describe"]
