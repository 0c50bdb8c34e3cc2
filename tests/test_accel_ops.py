"""The kernel names every shipped accelerator recipe hands VeOmni, validated by VeOmni itself.

VeOmni 0.1.12 checks ``OpsImplementationConfig`` against the device when it is constructed
(veomni/arguments/arguments_types.py:1276-1278 -> ``_validate_implementations`` :1331-1372, with
``_NPU_ALLOWED`` :1028-1036), asking ``veomni.utils.import_utils.is_torch_npu_available`` which
device it is on. Here that probe is forced to the recipe's device and nothing else is replaced:
the construction is the one ``rlcore.engine_veomni`` does before building the model, so a name
VeOmni refuses on Ascend fails here as it would on the cluster (the bare ``npu`` experts name once
stopped every NPU run, dense ones included, before step 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

from test_gpu_check import recipe_config


RECIPES = [  # (recipe, device it is written for, stand-in model config)
    ("qwen3_8b_math_16gpu", "cuda", "qwen3_8b"),
    ("qwen3_30b_a3b_math_16gpu", "cuda", "qwen3_30b_a3b"),
    ("qwen3_vl_8b_geo3k_16gpu", "cuda", "qwen3_vl_8b"),
    ("qwen3_8b_math_16npu", "npu", "qwen3_8b"),
]


@pytest.fixture
def veomni_device(monkeypatch):
    """Force VeOmni's own probes: ``set_(npu=True)`` makes it see an Ascend NPU, ``liger=True``
    find liger-kernel (requirements-cuda.txt installs it; it needs Triton, absent on this CPU)."""
    import veomni.utils.import_utils as import_utils

    def set_(npu: bool, liger: bool = False) -> None:
        monkeypatch.setattr(import_utils, "is_torch_npu_available", lambda: npu)
        monkeypatch.setattr(import_utils, "is_liger_kernel_available", lambda: liger)
    return set_


def build_ops(cfg, device):
    from rlcore.hf_folder import model_num_experts
    from rlcore.engine.kernels import ops_config

    m = cfg.model
    return ops_config(m.attn_implementation, m.moe_implementation, model_num_experts(m.path), device)


@pytest.mark.parametrize("recipe,device,model", RECIPES, ids=[f"{r}-{d}" for r, d, _ in RECIPES])
def test_recipe_kernels_pass_veomnis_validation_on_its_device(recipe, device, model, tmp_path, veomni_device):
    cfg, _ = recipe_config(tmp_path, recipe, model, model, device)
    veomni_device(npu=device == "npu", liger=device == "cuda")
    ops = build_ops(cfg, device)  # raises ValueError where VeOmni refuses a name on this device
    experts = "30b_a3b" in model
    assert ops.moe_implementation == ("fused_triton" if experts else "eager")  # the only NPU recipe is dense
    fused = "npu" if device == "npu" else "liger_kernel"
    assert ops.rms_norm_implementation == ops.rotary_pos_emb_implementation == fused
    assert ops.swiglu_mlp_implementation == ("eager" if device == "npu" else "liger_kernel")  # no NPU SwiGLU
    assert ops.cross_entropy_loss_implementation == "eager"  # the log-prob path ignores it


def test_moe_on_npu_resolves_and_passes_veomnis_validation(tmp_path, veomni_device):
    """MoE on Ascend is no longer refused (the rollout keeps the experts' Parameters over vllm-ascend
    0.23's wake-up swap: rollout.expert_layout): the 30B recipe parsed for npu resolves, and the
    experts name it hands VeOmni on Ascend is fused_npu, which VeOmni's validation accepts."""
    from rlcore.engine.kernels import ops_config

    veomni_device(npu=True)
    assert ops_config("flash_attention_2", "npu", 128, "npu").moe_implementation == "fused_npu"
    cfg, _ = recipe_config(tmp_path, "qwen3_30b_a3b_math_16gpu", "qwen3_30b_a3b", "qwen3_30b_a3b", "npu")
    assert cfg.parallel.ep_size == 8 and cfg.rollout.weight_load == "reload"  # direct is refused for MoE
    assert build_ops(cfg, "npu").moe_implementation == "fused_npu"


@pytest.mark.unit
def test_veomni_refuses_the_old_bare_names_on_npu(veomni_device):
    """The names the trainer used to pass: VeOmni's validation refuses them on Ascend."""
    from veomni.arguments.arguments_types import OpsImplementationConfig

    veomni_device(npu=True)
    with pytest.raises(ValueError, match="moe_implementation='npu' is not supported on Ascend NPU"):
        OpsImplementationConfig(attn_implementation="flash_attention_2", moe_implementation="npu",
                                cross_entropy_loss_implementation="eager", rms_norm_implementation="eager",
                                swiglu_mlp_implementation="eager", rotary_pos_emb_implementation="eager",
                                rotary_pos_emb_vision_implementation="eager",
                                load_balancing_loss_implementation="eager")


@pytest.mark.parametrize("impl,experts,expected", [
    ("npu", 128, "fused_npu"), ("triton", 128, "fused_triton"), ("quack", 8, "fused_quack"),
    ("npu", 0, "eager"), ("triton", 0, "eager"), ("torch_ep", 8, "eager"), ("eager", 8, "eager"),
])
@pytest.mark.unit
def test_project_names_map_to_veomnis(impl, experts, expected):
    from rlcore.engine.moe import veomni_moe_implementation

    assert veomni_moe_implementation(impl, experts) == expected


@pytest.mark.unit
def test_fused_kernels_per_device_and_what_the_start_up_line_says(veomni_device):
    """cuda: liger-kernel's RMSNorm / SwiGLU / RoPE when VeOmni finds it, else eager; npu: VeOmni's
    torch_npu RMSNorm and RoPE (text and vision); cpu: eager. Each set passes VeOmni's validation
    for its device (the npu set only there: VeOmni refuses 'npu' kernels elsewhere)."""
    from rlcore.engine.kernels import describe_kernels, kernel_fields, ops_config

    veomni_device(npu=False, liger=True)
    assert describe_kernels(kernel_fields("cuda")) == (
        "kernels: rms_norm liger_kernel, swiglu liger_kernel, rope liger_kernel, vision rope eager")
    ops_config("sdpa", "eager", 0, "cuda")
    veomni_device(npu=False, liger=False)  # a CUDA machine without liger-kernel
    assert describe_kernels(kernel_fields("cuda")) == "kernels: rms_norm eager, swiglu eager, rope eager, vision rope eager"
    assert describe_kernels(kernel_fields("cpu", {"rms_norm_implementation": "x"})).startswith("kernels: rms_norm x,")
    with pytest.raises(ValueError, match="requires Ascend NPU"):
        ops_config("sdpa", "eager", 0, "npu")  # the NPU kernels on a machine VeOmni sees as not Ascend
    veomni_device(npu=True)
    ops = ops_config("flash_attention_2", "eager", 0, "npu")
    assert (ops.rms_norm_implementation, ops.rotary_pos_emb_implementation,
            ops.rotary_pos_emb_vision_implementation, ops.swiglu_mlp_implementation) == ("npu", "npu", "npu", "eager")


def test_veomnis_own_probe_finds_the_real_liger_kernel_wheel():
    """No probe forced: the CUDA set's liger-kernel wheel (pure Python; setup_env.sh installs it into
    .venv/accel/liger-kernel) on sys.path, VeOmni's own ``find_spec`` probe (utils/import_utils.py:
    31-44) sees it and the CUDA kernels become liger's; without it they stay eager. Each set passes
    VeOmni's validation (not on NPU here)."""
    wheel = os.path.join(REPO, ".venv", "accel", "liger-kernel")
    if not os.path.isfile(os.path.join(wheel, "liger_kernel", "__init__.py")):
        pytest.fail(f"{wheel} is missing: run scripts/setup_env.sh (it installs the liger-kernel wheel there)")
    code = ("import json; from rlcore.engine.kernels import kernel_fields, ops_config; "
            "ops = ops_config('sdpa', 'eager', 0, 'cuda'); "
            "print(json.dumps([ops.rms_norm_implementation, ops.swiglu_mlp_implementation, "
            "ops.rotary_pos_emb_implementation]))")
    seen = {}
    for name, extra in (("with", [wheel]), ("without", [])):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, *extra])}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"with": ["liger_kernel"] * 3, "without": ["eager"] * 3}, seen
