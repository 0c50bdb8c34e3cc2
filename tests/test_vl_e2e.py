"""Image+text GRPO on the real entry point (2 CPU ranks, conftest.run_torchrun): a tiny Qwen3-VL on
the shapes task, images through vLLM (multi_modal_data) and through the VeOmni policy (pixel values,
M-RoPE).

Two launches share one module fixture (16 shapes prompts, 4 per step), both training as one Ulysses
group of the 2 ranks (each runs half of every packed row and half of its image patches):
  A  4 steps straight through, a checkpoint every 2 steps;
  B  the same run killed with kill -9 once step_2 is saved and step 3 is logged, then resumed with
     checkpoint.resume=auto to step 4.
Exactness: every metrics.jsonl value but wall-clock ones, and every bit of the model and optimizer
state of step 4. Each row's rollout/mismatch_max compares vLLM's sampling log-probs on the image
prompts with the trainer's on the same weights: a missing image, a wrong position or a vision
tower left out of the sync shows there.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun
from workers.launch import TRAIN, Launch, comparable, dcp_state, read_rows, same

STEPS = 4


def args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_vl_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--checkpoint.keep_last", "10", "--checkpoint.save_hf_final", "false",
            # 16 prompts of ~27 tokens per rank and step against a 64-token scheduler budget: vLLM
            # would chunk them, which kills seeded requests on CPU (rollout.engine_keys.chunked_prefill_kwargs)
            "--rollout.max_num_batched_tokens", "64",
            "--rollout.emulate_sleep", "true", *extra]  # level 2 as on a GPU (rlcore/rollout/cpu_sleep.py)


@pytest.fixture(scope="module")
def runs(tiny_vl_model, shapes_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_resume")
    a, b = str(root / "a"), str(root / "b")
    data = os.path.join(os.path.dirname(shapes_data[0]), "train16.jsonl")  # beside the images it names
    with open(shapes_data[0]) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:16])
    sp = ("--parallel.ulysses_size", "2")  # one Ulysses group: half of every row and of its patches per rank
    straight = run_torchrun(TRAIN, 2, *args(tiny_vl_model, data, a, "--checkpoint.save_every", "2", *sp))
    b_args = args(tiny_vl_model, data, b, "--checkpoint.save_every", "2", "--checkpoint.resume", "auto", *sp)
    killed = Launch(2, b_args)
    try:
        killed.wait_for(r"saved checkpoint .*step_2$", timeout=600)
        killed.wait_for(r"^step +3/", timeout=300)  # logged, not checkpointed: its row must go
        killed.kill9()
    finally:
        killed.close()
    rows_at_kill = [r["step"] for r in read_rows(b)]
    resumed = run_torchrun(TRAIN, 2, *b_args)
    return {"a": a, "b": b, "rows_at_kill": rows_at_kill, "straight_out": straight.stdout + straight.stderr,
            "resumed_out": resumed.stdout}


def test_image_prompts_train_and_vllm_matches_the_trainer(runs):
    rows = read_rows(runs["a"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    out = runs["straight_out"]
    assert "train data: 16 prompts with 16 images" in out, out[-3000:]
    assert "vision tower" in out, out[-3000:]  # the policy's start-up line says trained or frozen
    assert "Ulysses sequence parallel 2" in out
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    # fp32 on both sides, after every sync: vLLM's log-probs of its own samples equal the trainer's within 1e-4
    assert all(r["rollout/mismatch_max"] < 1e-4 and 0 <= r["rollout/mismatch_kl"] < 1e-6 for r in rows), \
        [(r["rollout/mismatch_max"], r["rollout/mismatch_kl"]) for r in rows]


def test_kill9_then_resume_with_images_is_exact(runs, tmp_path):
    assert runs["rows_at_kill"][:3] == [1, 2, 3]
    assert "resumed from" in runs["resumed_out"] and "step_2 at step 2" in runs["resumed_out"]
    a_rows, b_rows = read_rows(runs["a"]), read_rows(runs["b"])
    assert [r["step"] for r in b_rows] == list(range(1, STEPS + 1))
    for ra, rb in zip(a_rows, b_rows):
        assert comparable(ra) == comparable(rb), (ra["step"], comparable(ra), comparable(rb))
    sa = dcp_state(os.path.join(runs["a"], "checkpoints", f"step_{STEPS}"), tmp_path)
    sb = dcp_state(os.path.join(runs["b"], "checkpoints", f"step_{STEPS}"), tmp_path)
    assert sa["model"].keys() == sb["model"].keys()
    assert any("visual" in k for k in sa["model"])  # the vision tower is part of the trained state
    assert same(sa["model"], sb["model"]) and same(sa["optimizer"], sb["optimizer"])


def test_one_rank_image_training_agrees_with_vllm(tiny_vl_model, shapes_data, tmp_path):
    """The same agreement on a single rank (one FSDP2 shard, one vLLM engine), with on-policy
    distillation in top-k mode from a vision-language teacher that is the student's starting model:
    its engine reads each image prompt as the policy's did, so at step 1 (student = teacher) the
    teacher's log-prob of every sampled token equals vLLM's sampling one (reverse KL ~0) and the
    top-k divergence in the trainer is ~0; a teacher that missed the images, or read them at other
    positions, would be far off. Step 2's student has moved away: both grow."""
    out = str(tmp_path / "one")
    run_torchrun(TRAIN, 1, *args(tiny_vl_model, shapes_data[0], out, "--trainer.total_steps", "2",
                                 "--distill.teacher", tiny_vl_model, "--distill.mode", "topk", "--distill.topk", "4",
                                 "--distill.reward_weight", "1.0", "--distill.kv_cache_gb", "0.0625",
                                 "--optim.lr", "0.02"))
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/mismatch_max"] < 1e-4 for r in rows), [r["rollout/mismatch_max"] for r in rows]
    first, second = rows
    assert abs(first["distill/reverse_kl"]) < 1e-5 and first["distill/topk_divergence"] < 1e-6, first
    assert abs(first["distill/teacher_logprob_mean"] - first["distill/student_logprob_mean"]) < 1e-5
    assert 0 < first["distill/topk_mass"] <= 1 and first["timing/teacher_s"] > 0
    assert abs(second["distill/reverse_kl"]) > 1e-4 and second["distill/topk_divergence"] > 1e-6, second


def test_lora_on_a_vision_language_policy(tiny_vl_model, shapes_data, tmp_path):
    """LoRA on the tiny Qwen3-VL (the shapes demo): adapters on the language model only, the vision
    tower frozen; vLLM serves the pushed adapter on image prompts. The adapter matters (the trainer's
    KL to its adapter-off self grows past 1e-3) while vLLM's log-probs stay within 1e-4 of the
    trainer's every step: a vLLM that ignored the adapter would be that KL's size off. The merged
    export holds every base tensor, the vision tower's bit-identical to the base model's. A LoRA student
    distils from the base model as teacher (reverse-KL advantage beside the reward): at step 1 the
    adapter is zero, so the teacher's log-probs equal vLLM's sampling ones; later they part."""
    import glob

    from safetensors import safe_open

    out = str(tmp_path / "vl_lora")
    data = os.path.join(os.path.dirname(shapes_data[0]), "train16.jsonl")
    if not os.path.isfile(data):
        with open(shapes_data[0]) as src, open(data, "w") as dst:
            dst.writelines(src.readlines()[:16])
    proc = run_torchrun(TRAIN, 2, *args(tiny_vl_model, data, out, "--trainer.total_steps", "4", "--lora.rank", "8",
                                         "--optim.lr", "0.02", "--algorithm.kl_loss_coef", "0.001",
                                         "--checkpoint.save_hf_final", "true", "--checkpoint.merge_lora", "true",
                                         "--distill.teacher", tiny_vl_model, "--distill.reward_weight", "1.0",
                                         "--distill.coef", "0.5", "--distill.kv_cache_gb", "0.0625"))
    assert "vision tower frozen" in proc.stdout
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/mismatch_max"] < 1e-4 for r in rows), [r["rollout/mismatch_max"] for r in rows]
    assert rows[-1]["actor/kl"] > 1e-3, rows[-1]["actor/kl"]
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-5 and abs(rows[-1]["distill/reverse_kl"]) > 1e-4, \
        [r["distill/reverse_kl"] for r in rows]

    def tensors(folder):
        out = {}
        for path in glob.glob(os.path.join(folder, "*.safetensors")):
            with safe_open(path, "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    adapter, merged, base = (tensors(os.path.join(out, "hf_final")), tensors(os.path.join(out, "hf_final", "merged")),
                             tensors(tiny_vl_model))
    assert adapter and all(".language_model.layers." in k for k in adapter)  # nothing on the vision tower
    assert merged.keys() == base.keys()
    visual = [k for k in base if "visual" in k]
    assert visual and all(bool((merged[k] == base[k]).all()) for k in visual)
    changed = [k for k in base if not bool((merged[k] == base[k]).all())]
    assert changed and all(".language_model.layers." in k and k.endswith("proj.weight") for k in changed)
