"""optim.optimizer: anyprecision_adamw (VeOmni's AnyPrecisionAdamW through its build_optimizer,
rlcore/engine/optim.py) on the real engine, 2 CPU ranks (FSDP2), one launch
(tests/workers/optimizer_worker.py, run with RLCORE_TEST_REAL_OFFLOAD=1):

- three engine steps equal this file's own AnyPrecision AdamW (llama-recipes' algorithm: bf16
  momentum, variance and Kahan compensation, fp32 parameters) replayed on the gradients the engine's
  optimizer saw, within TOL; torch AdamW and AnyPrecision without Kahan on the same gradients are
  further than 10 x TOL away, so an engine that silently used either fails;
- the state's bytes per trainable parameter after a real step, for every option, equal what the
  memory plan counts (rlcore.plan.memory.OPTIMIZER_BYTES);
- offload, DCP checkpoints while offloaded, a load into an offloaded and into a fresh engine, and
  the trainer's resume order (tests/workers/offload_checkpoint.py's runs A-D) continue bit for bit.
Plus the config's checks, the hand-over from the config to the engine, and the plan's component.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "optimizer_worker.py")
# engine_train.ENGINE_KW's hyper-parameters (the worker's engines use them)
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.99), 1e-6, 0.01
# Max |engine - reference| over every parameter element after each step. Measured 0.0 (bit-exact) on
# the 2-core x86 CI host, 3 steps of lr <= 1e-3 moving parameters by up to 1.0e-3; torch AdamW on the
# same gradients is 1.35e-5 away after step 1, AnyPrecision without Kahan 3.8e-6.
TOL = 1e-6


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optimizer")
    run_torchrun(WORKER, 2, tiny_model, str(out), env={"RLCORE_TEST_REAL_OFFLOAD": "1"})
    with open(out / "results.json") as f:
        res = json.load(f)
    with open(out / "bytes.json") as f:
        nbytes = json.load(f)
    steps = torch.load(out / "steps.pt", weights_only=False)
    params = {k: torch.load(out / f"params_{k}.pt", weights_only=True) for k in "abcd"}
    return {"res": res, "bytes": nbytes, "steps": steps, "params": params}


# ------------------------------------------------------------------------- the references

def anyprecision_reference(params0: dict, grads: list, lrs: list, kahan: bool = True,
                           state_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """AnyPrecision AdamW as llama-recipes wrote it (v0.0.4 policies/anyprecision_optimizer.py), in
    plain PyTorch on whole tensors: fp32 parameters; momentum, variance and the Kahan compensation
    buffer in ``state_dtype``; the step count a float32 tensor (so the bias corrections are float32).
    With Kahan summation the update goes into the compensation buffer, the buffer into the
    parameter, and what the addition lost back into the buffer. Returns the parameters after each step."""
    b1, b2 = BETAS
    params = {n: t.clone().float() for n, t in params0.items()}
    state = {n: {"step": torch.tensor(0.0), "m": torch.zeros_like(p, dtype=state_dtype),
                 "v": torch.zeros_like(p, dtype=state_dtype), "c": torch.zeros_like(p, dtype=state_dtype)}
             for n, p in params.items()}
    out = []
    for g_step, lr in zip(grads, lrs):
        for n, p in params.items():
            g, s = g_step[n], state[n]
            s["step"] += 1
            p.mul_(1 - lr * WEIGHT_DECAY)  # decoupled weight decay
            s["m"].mul_(b1).add_(g, alpha=1 - b1)
            s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            step_size = lr / (1 - b1 ** s["step"])
            denom = (s["v"].sqrt() / (1 - b2 ** s["step"]) ** 0.5).add_(EPS)
            if kahan:
                s["c"].addcdiv_(s["m"], denom, value=-step_size)
                before = p.clone()
                p.add_(s["c"])
                s["c"].add_(before.sub_(p))  # the part of the buffer the addition lost
            else:
                p.addcdiv_(s["m"], denom, value=-step_size)
        out.append({n: p.clone() for n, p in params.items()})
    return out


def adamw_reference(params0: dict, grads: list, lrs: list) -> list[dict]:
    """torch.optim.AdamW (fp32 state) on the same gradients: what a silent fallback would give."""
    params = {n: t.clone().float().requires_grad_(True) for n, t in params0.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            foreach=False)
    out = []
    for g_step, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for n, p in params.items():
            p.grad = g_step[n].clone()
        opt.step()
        out.append({n: p.detach().clone() for n, p in params.items()})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# ------------------------------------------------------------------------- the engine

def test_engine_steps_equal_the_anyprecision_reference(run):
    s = run["steps"]
    assert len(s["grads"]) == len(s["params"]) == 3 and s["lr"][0] > 0
    assert s["state_dtypes"] == ["compensation:torch.bfloat16", "exp_avg:torch.bfloat16",
                                 "exp_avg_sq:torch.bfloat16", "step:torch.float32"]
    ref = anyprecision_reference(s["params0"], s["grads"], s["lr"])
    adamw = adamw_reference(s["params0"], s["grads"], s["lr"])
    no_kahan = anyprecision_reference(s["params0"], s["grads"], s["lr"], kahan=False)
    for k, engine in enumerate(s["params"]):
        moved = max_diff(engine, s["params0"])
        diff, off_adamw = max_diff(engine, ref[k]), max_diff(engine, adamw[k])
        off_no_kahan = max_diff(engine, no_kahan[k])
        print(f"step {k + 1}: max |engine - AnyPrecision reference| = {diff:.2e} (tolerance {TOL:.0e}); "
              f"torch AdamW {off_adamw:.2e}, no Kahan {off_no_kahan:.2e} away; parameters moved {moved:.2e}")
        assert diff <= TOL
        assert off_adamw > 10 * TOL and off_no_kahan > 2 * TOL  # the test tells the optimizers apart


def test_state_bytes_per_parameter_are_what_the_plan_counts(run):
    from rlcore.plan.memory import OPTIMIZER_BYTES

    measured = run["bytes"]
    assert measured.keys() == OPTIMIZER_BYTES.keys()
    for key, m in measured.items():
        print(f"{key}: {m['per_param']:.4f} bytes per trainable parameter ({m['bytes']:.0f} / {m['trainable']:.0f})")
        # the excess is one fp32 step counter per parameter tensor
        assert OPTIMIZER_BYTES[key] <= m["per_param"] < OPTIMIZER_BYTES[key] + 0.01, key


def test_offload_checkpoint_and_resume_are_bit_exact(run):
    res, params = run["res"], run["params"]
    assert res["b_state_left"] and res["b_step_refused"], "AnyPrecision's state did not leave with offload"
    assert res["b_offloaded_after_save"] and res["c_offloaded_after_load"] and res["d_offloaded_after_save"]
    assert res["b_export_while_offloaded_exact"] and res["d_pushed_exact"]
    assert res["c_loaded_extra"] == {"trainer": {"step": 1}} and res["d_loaded_trainer_state"] == {"step": 1}
    assert max_diff(params["a"], run["steps"]["params"][1]) == 0.0  # run A is the recorded run's first 2 steps
    for k in "bcd":  # b: offloaded save; c: loaded into an offloaded engine; d: the trainer's resume order
        assert res[f"final_{k}_equals_a"] and max_diff(params[k], params["a"]) == 0.0, k
    # the loaded state is bf16 again (torch's load_state_dict casts it to fp32: rlcore.engine.optim)
    assert res["loaded_state_dtypes"] == run["steps"]["state_dtypes"]
    assert res["loaded_per_param"] == pytest.approx(run["bytes"]["anyprecision_adamw"]["per_param"])


# ------------------------------------------------------------------------- config, plan

@pytest.mark.unit
def test_config_reaches_the_engine():
    from rlcore.config.sections import ModelConfig, OptimConfig
    from rlcore.engine_veomni import VeOmniPolicy
    from rlcore.run.build import _policy_kwargs

    optim = OptimConfig(optimizer="anyprecision_adamw", state_dtype="float32", kahan_summation=False)
    kw = _policy_kwargs(ModelConfig(path="unused"), optim, 10, 1, False)
    assert (kw["optimizer"], kw["optimizer_state_dtype"], kw["kahan_summation"]) == ("anyprecision_adamw", "float32",
                                                                                    False)
    assert set(kw) <= set(inspect.signature(VeOmniPolicy.__init__).parameters)
    default = _policy_kwargs(ModelConfig(path="unused"), OptimConfig(), 10, 1, False)
    assert (default["optimizer"], default["optimizer_state_dtype"], default["kahan_summation"]) == ("adamw", None,
                                                                                                   None)


@pytest.mark.unit
def test_engine_options_map_onto_anyprecisions_group_keys():
    from rlcore.engine.optim import anyprecision_overrides

    assert anyprecision_overrides(None, None) == {}  # VeOmni's defaults: bf16, Kahan on
    assert anyprecision_overrides("float32", False) == {
        "momentum_dtype": torch.float32, "variance_dtype": torch.float32,
        "compensation_buffer_dtype": torch.float32, "use_kahan_summation": False}


@pytest.mark.unit
@pytest.mark.parametrize("kw,key", [({"state_dtype": "float32"}, "optim.state_dtype"),
                                    ({"kahan_summation": True}, "optim.kahan_summation")])
def test_anyprecision_options_with_adamw_are_refused(kw, key):
    from rlcore.config.sections import OptimConfig
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{key}=.* is invalid: .*set optim.optimizer: anyprecision_adamw"):
        OptimConfig(**kw)
    OptimConfig(optimizer="anyprecision_adamw", **kw)  # fine with the optimizer they belong to


@pytest.mark.unit
def test_plan_counts_the_measured_state_bytes(tmp_path):
    """The plan's optimizer component is OPTIMIZER_BYTES x trainable parameters / W: 6 bytes for
    anyprecision_adamw (bf16 + Kahan), 3/4 of AdamW's 8 (Qwen3-8B on 16 ranks, as test_memory_plan.py)."""
    from rlcore.config.cli import parse_config
    from rlcore.plan.memory import optimizer_bytes, plan_from_config

    fixture = os.path.join(REPO, "tests", "fixtures", "qwen3_8b")
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {fixture}, dtype: bfloat16}}\ndata: {{train_files: [unused.jsonl]}}\n")
    plans = {}
    for name, args in {"adamw": [], "any": ["--optim.optimizer", "anyprecision_adamw"],
                       "fp32": ["--optim.optimizer", "anyprecision_adamw", "--optim.state_dtype", "float32"],
                       "no_kahan": ["--optim.optimizer", "anyprecision_adamw", "--optim.kahan_summation", "false"]
                       }.items():
        cfg = parse_config(["--config", str(path), *args], device_type="cuda")
        plans[name] = plan_from_config(cfg, world_size=16, device_gb=80, device_type="cuda")
    trainable = plans["adamw"].inputs.trainable
    for name, b in {"adamw": 8, "any": 6, "fp32": 12, "no_kahan": 4}.items():
        assert plans[name].inputs.optimizer_bytes == b
        assert plans[name].phases["train"]["optimizer"] == b * trainable // 16
    assert optimizer_bytes("anyprecision_adamw") == 6 and optimizer_bytes() == 8
    # everything else in the plan is the same
    other = {k: v for k, v in plans["any"].phases["train"].items() if k != "optimizer"}
    assert other == {k: v for k, v in plans["adamw"].phases["train"].items() if k != "optimizer"}


@pytest.mark.parametrize("state_dtype,kahan", [(None, None), ("float32", None), (None, False), ("float32", False)])
def test_resume_peak_is_what_the_plan_counts(state_dtype, kahan):
    """Issue 66 F5: a resume's optimizer state at its peak, measured on VeOmni's optimizer as built here:
    torch's ``load_state_dict`` casts every floating state tensor to its parameter's dtype (fp32 master
    weights; torch/optim/optimizer.py ``_process_value_according_to_param_policy``) while the loaded
    state it cast from is still held (a DCP load fills the optimizer's own state dict, which the caller
    holds), and rlcore.engine.optim's post-hook casts it back only after. The tensors alive when the
    post-hooks start, over the parameters, equal OPTIMIZER_LOAD_BYTES: 18 bytes for the seed recipe's
    bf16 state with Kahan (6 after), 12 without Kahan, and no copy of an fp32 state (AdamW in the plan's
    table is the same: its state is fp32)."""
    from rlcore.engine.optim import build
    from rlcore.plan.memory import OPTIMIZER_BYTES, OPTIMIZER_LOAD_BYTES, optimizer_key

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False))
    opt = build(model, "anyprecision_adamw", 1e-3, BETAS, EPS, WEIGHT_DECAY, state_dtype, kahan)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    nbytes = lambda tensors: sum(t.nbytes for t in {t.data_ptr(): t for t in tensors}.values())  # noqa: E731
    floating = lambda state: [t for s in state.values() for k, t in s.items() if k != "step"]  # noqa: E731
    loaded = opt.state_dict()  # what a DCP load filled in place: the optimizer's own state tensors
    peak = {}
    opt.register_load_state_dict_post_hook(
        lambda o: peak.update(n=nbytes(floating(o.state) + floating(loaded["state"]))), prepend=True)
    opt.load_state_dict(loaded)
    key = optimizer_key("anyprecision_adamw", state_dtype, kahan)
    print(f"{key}: {peak['n'] / n:g} bytes per parameter at the load's peak, {nbytes(floating(opt.state)) / n:g} after")
    assert peak["n"] == OPTIMIZER_LOAD_BYTES[key] * n
    assert nbytes(floating(opt.state)) == OPTIMIZER_BYTES[key] * n  # the hook cast it back


@pytest.mark.unit
def test_plan_counts_the_resume_peak(tmp_path):
    """The checkpoint phase holds ``optimizer_load``: the resume's extra copy (OPTIMIZER_LOAD_BYTES - OPTIMIZER_BYTES)
    x trainable / W, 12 bytes a parameter for bf16 anyprecision_adamw with Kahan, none for AdamW; no other phase."""
    from rlcore.config.cli import parse_config
    from rlcore.plan.memory import plan_from_config

    fixture = os.path.join(REPO, "tests", "fixtures", "qwen3_8b")
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {fixture}, dtype: bfloat16}}\ndata: {{train_files: [unused.jsonl]}}\n")
    plans = {name: plan_from_config(parse_config(["--config", str(path), *args], device_type="cuda"), world_size=16,
                                    device_gb=80, device_type="cuda")
             for name, args in {"adamw": [], "any": ["--optim.optimizer", "anyprecision_adamw"]}.items()}
    trainable = plans["any"].inputs.trainable
    assert plans["any"].phases["checkpoint"]["optimizer_load"] == 12 * trainable // 16
    assert plans["adamw"].phases["checkpoint"]["optimizer_load"] == 0
    assert all(plans["any"].phases[ph]["optimizer_load"] == 0 for ph in plans["any"].phases if ph != "checkpoint")
