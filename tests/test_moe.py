"""Mixture-of-experts through the real engine on CPU: a tiny Qwen3-MoE (4 experts, top-2) with
VeOmni expert parallelism over 2 gloo ranks (the pure-torch EP experts of rlcore/engine/moe.py)
gives the logits and gradients of one rank without EP, and exports the checkpoint's names."""

import os

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "moe_parallel.py")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    from rlcore.demo.toy import make_tiny_moe_model

    return make_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")))


def test_expert_parallel_matches_one_rank(tiny_moe, tmp_path):
    runs = {}
    for world, ep in ((1, 1), (2, 1), (2, 2)):
        out = tmp_path / f"w{world}ep{ep}.pt"
        run_torchrun(WORKER, world, tiny_moe, str(out), str(ep))
        runs[(world, ep)] = torch.load(out, weights_only=False)
    ref = runs[(1, 1)]
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(tiny_moe, "model.safetensors"))
    for key, r in runs.items():
        logit_diff = (r["logits"] - ref["logits"]).abs().max().item()
        num = sum((r["grads"][n] - g).norm() ** 2 for n, g in ref["grads"].items()) ** 0.5
        den = sum(g.norm() ** 2 for g in ref["grads"].values()) ** 0.5
        print(f"world {key[0]} ep {key[1]}: logits max diff {logit_diff:.2e}, grad rel diff {num / den:.2e}, "
              f"router {({k: round(v, 4) for k, v in r['step'].items() if 'moe' in k})}")
        assert logit_diff <= 1e-5 and num / den <= 1e-5, key
        assert r["num_params"] == ref["num_params"] == sum(t.numel() for t in ckpt.values())
        assert set(r["weights"]) == set(ckpt)  # per-expert names, as transformers saved them
        s = r["step"]
        assert s["actor/moe_aux_loss"] > 0.5 and 1.0 <= s["actor/moe_load_mean"] <= s["actor/moe_load_max"] <= 4.0
        assert abs(s["actor/moe_aux_loss"] - ref["step"]["actor/moe_aux_loss"]) < 1e-5  # global statistics
    # the step moved the experts of every EP rank, by the same amounts as without EP
    moved = {n: (runs[(2, 2)]["weights"][n] - ckpt[n]).abs().max().item() for n in ckpt if ".experts." in n}
    assert min(moved.values()) > 0
    for n in ckpt:
        assert torch.allclose(runs[(2, 2)]["weights"][n], ref["weights"][n], atol=1e-5), n


def moe_args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", f'["{data}"]', "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", "4", "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--parallel.ep_size", "2", "--checkpoint.keep_last", "10",
            "--rollout.emulate_sleep", "true", *extra]  # level 2 as on a GPU (rlcore/rollout/cpu_sleep.py)


def test_expert_parallel_end_to_end_resume_and_export(tiny_moe, toy_data, tmp_path):
    """4 steps with EP=2 on 2 ranks (policy and reference), against the same run killed (-9) after
    step 2's checkpoint and resumed: equal metric rows and final weights; the HF export loads in
    transformers (per-expert names) and in vLLM; the sync kept vLLM on the trainer's weights. The MoE
    student distils from its starting model (an MoE teacher on its own engine, reverse-KL advantage
    beside the reward): step 1's teacher log-probs equal vLLM's sampling ones, resume included. The
    policy and the reference train as one Ulysses group of 2 (each rank half of every row, its experts
    split over the same 2 ranks)."""
    from workers.launch import TRAIN, comparable, kill9_when, read_rows

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    teacher = ("--distill.teacher", tiny_moe, "--distill.reward_weight", "1.0", "--distill.kv_cache_gb", "0.0625",
               "--parallel.ulysses_size", "2")  # and the train phase as one Ulysses group beside EP 2
    proc = run_torchrun(TRAIN, 2, *moe_args(tiny_moe, toy_data[0], a, *teacher))
    assert "experts: torch_ep kernel, expert parallel 2, Ulysses sequence parallel 2" in proc.stdout
    kill9_when(2, moe_args(tiny_moe, toy_data[0], b, "--checkpoint.save_every", "2", "--checkpoint.resume", "auto",
                           "--checkpoint.save_hf_final", "false", *teacher), r"saved checkpoint .*step_2$", r"^step +3/")
    run_torchrun(TRAIN, 2, *moe_args(tiny_moe, toy_data[0], b, "--checkpoint.save_every", "2",
                                     "--checkpoint.resume", "auto", *teacher))
    rows_a, rows_b = read_rows(a), read_rows(b)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        assert comparable(ra) == comparable(rb), ra["step"]
    for r in rows_a:  # fp32, right after a sync: vLLM samples from the trainer's weights, experts included
        assert r["rollout/mismatch_max"] < 1e-4 and r["rollout/mismatch_kl"] < 1e-6, r
        assert r["actor/moe_load_max"] >= 1.0 and r["actor/moe_aux_loss"] > 0
    assert abs(rows_a[0]["distill/reverse_kl"]) < 1e-5 and rows_a[-1]["timing/teacher_s"] > 0, rows_a[0]
    from safetensors.torch import load_file

    wa, wb = load_file(os.path.join(a, "hf_final", "model.safetensors")), load_file(
        os.path.join(b, "hf_final", "model.safetensors"))
    ckpt = load_file(os.path.join(tiny_moe, "model.safetensors"))
    assert set(wa) == set(ckpt) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert max((wa[k] - ckpt[k]).abs().max().item() for k in wa if ".experts." in k) > 0  # experts trained
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(os.path.join(a, "hf_final"))  # loads: names and shapes fit
    script = ("import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'\n"
              "from vllm import LLM, SamplingParams\n"
              f"llm = LLM(model={os.path.join(a, 'hf_final')!r}, dtype='float32', max_model_len=64, "
              "kv_cache_memory_bytes=64<<20, enforce_eager=True)\n"
              "o = llm.generate(['d 1 2 3 4 pick 2nd ='], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)\n"
              "print('VLLM_OK', len(o[0].outputs[0].token_ids))\n")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert "VLLM_OK" in out.stdout, out.stderr[-4000:]


def test_stale_experts_show_as_rollout_mismatch(tiny_moe, toy_data, tmp_path):
    """The same run with step 2's weight sync skipped (tests/workers/faulty_train.py): step 3
    samples from stale weights and its mismatch stands out; the synced steps stay at fp32 noise.
    (Before the CPU MoE re-pack in rlcore/rollout/checks.py, every synced step looked like this.)"""
    out = str(tmp_path / "stale")
    run_torchrun(os.path.join(REPO, "tests", "workers", "faulty_train.py"), 2,
                 *moe_args(tiny_moe, toy_data[0], out, "--trainer.total_steps", "3", "--checkpoint.save_hf_final",
                           "false",
                           # weights that survive the sleep (level 0): under an emulated level 2 a
                           # skipped sync is refused outright ("not valid after the weight sync")
                           "--rollout.emulate_sleep", "false"), env={"RLCORE_TEST_SKIP_SYNC_STEPS": "2"})
    from workers.launch import read_rows

    rows = read_rows(out)
    assert [r["rollout/mismatch_max"] < 1e-4 for r in rows] == [True, True, False], rows
    assert rows[2]["rollout/mismatch_max"] > 1e-2 and rows[2]["rollout/mismatch_kl"] > 1e-5, rows[2]


@pytest.mark.unit
def test_demo_moe_config_points_at_what_prepare_demo_writes():
    from rlcore.config.cli import parse_config

    cfg = parse_config(["--config", os.path.join(REPO, "configs", "demo_moe_cpu.yaml")], device_type="cpu")
    assert cfg.parallel.ep_size == 2 and cfg.model.moe_implementation == "torch_ep"
    assert cfg.model.path == "demo_assets/tiny_qwen3_moe"
    with open(os.path.join(REPO, "scripts", "prepare_demo.py")) as f:
        assert '"tiny_qwen3_moe"' in f.read()
