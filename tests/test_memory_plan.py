"""The memory plan (rlcore/plan/memory.py, scripts/plan_memory.py) against hand computations on
Qwen3-8B's config.json (tests/fixtures/qwen3_8b: the numbers only, no weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlcore.plan.inputs import COMPONENTS, PHASES, PlanInputs
from rlcore.plan.memory import GB, build_plan, format_plan, plan_from_config
from rlcore.plan.model_shape import ModelShape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "qwen3_8b")
SCRIPT = os.path.join(REPO, "scripts", "plan_memory.py")

# Qwen3-8B by hand: h 4096, 36 layers, 32 heads / 8 kv heads of 128, MLP 12288, vocab 151936, untied.
EMBED = 151936 * 4096  # embed_tokens; lm_head is the same size (tie_word_embeddings false)
LAYER = (4096 * 4096 + 4096 * 1024 + 4096 * 1024 + 4096 * 4096  # q, k, v, o
         + 128 + 128  # q_norm, k_norm
         + 4096 + 4096  # input_layernorm, post_attention_layernorm
         + 3 * 4096 * 12288)  # gate, up, down
N = EMBED + EMBED + 4096 + 36 * LAYER  # + final norm

RECIPE = """\
model: {{path: {model}, dtype: bfloat16, gradient_checkpointing: true}}
data: {{train_files: [unused.jsonl], max_prompt_length: 1024}}
rollout: {{n: 8, max_response_length: 2048, max_model_len: 3072, tensor_parallel_size: 2,
          gpu_memory_utilization: 0.6, sleep_level: 2, enforce_eager: true, sync_bucket_mb: 64}}
offload: {{params: true, optimizer: true, ref: false}}
algorithm: {{kl_loss_coef: 0.001, micro_batch_size: 4}}
trainer: {{prompts_per_step: 128}}
"""


@pytest.fixture
def recipe(tmp_path) -> str:
    path = tmp_path / "qwen3_8b.yaml"
    path.write_text(RECIPE.format(model=FIXTURE))
    return str(path)


def run_script(config: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--config", config, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hand_train_phase() -> dict[str, int]:
    """The train phase of RECIPE on 16 ranks, written out (bytes per rank)."""
    W, T = 16, 4 * 3072  # ranks; micro-batch tokens (4 sequences of 1024 + 2048)
    per_token_layer = 4 * 4096 + 2 * (4096 + 2 * 1024) + 4096 + 4 * 12288  # = 81920 saved elements
    activations = (36 * T * 4096 * 2  # gradient checkpointing: each layer's bf16 input
                   + 2 * T * per_token_layer * 2  # one layer recomputed + its gradients
                   + 2 * T * 4096 * 2  # final hidden state and its gradient
                   + 6 * 1024 * 151936 * 4)  # log-prob kernel: 6 fp32 (1024, V) buffers
    root = EMBED + 4096 + EMBED  # embed_tokens, final norm, lm_head
    gathered = 2 * root + 2 * EMBED + 2 * 2 * LAYER + (2 + 4) * LAYER  # root, lm_head grad, 2 layers, 1 grad
    return {"trainer_params": 4 * N // W, "gradients": 4 * N // W, "optimizer": 8 * N // W,
            "reference": 2 * N // W, "activations": activations, "fsdp_gathered": gathered,
            "vllm_overhead": GB // 2}  # sleep level 2 frees vLLM's weights and KV cache


@pytest.mark.unit
def test_parameter_count_is_the_hand_sum():
    shape = ModelShape.from_path(FIXTURE)
    assert shape.params == N == 8_190_735_360
    assert shape.counts() == (N, 0)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.tied) == (36, 8, 128, False)


@pytest.mark.unit
def test_lora_trains_the_adapters_only():
    """LoRA rank 32 on Qwen3-8B's 7 linear layers x 36: r x (in + out) each, by hand; gradients and
    AdamW state are the adapters', the reference is the policy itself."""
    import dataclasses

    shape = ModelShape.from_path(FIXTURE)
    p = PlanInputs(shape=shape, world=8, device_gb=80, reference=True, lora_rank=32)
    adapters = 32 * 36 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 12288) * 3)
    assert p.trainable == adapters == 87_293_952
    train = build_plan(p).phases["train"]
    full = build_plan(dataclasses.replace(p, lora_rank=0)).phases["train"]
    assert train["gradients"] == 4 * adapters // 8 and train["optimizer"] == 8 * adapters // 8
    assert train["reference"] == 0 and full["reference"] > 0
    assert train["trainer_params"] == full["trainer_params"]  # the frozen base keeps its fp32 shards


def test_script_train_phase_matches_hand_computation(recipe):
    proc = run_script(recipe, "--nproc", "8", "--nnodes", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    train = last_json(proc)["phases"]["train"]
    hand = hand_train_phase()
    for comp in COMPONENTS:
        assert train["components"][comp] == pytest.approx(hand.get(comp, 0) / GB, abs=1e-3), comp
    assert train["total_gb"] == pytest.approx(sum(hand.values()) / GB, abs=1e-3)
    assert train["fits"] is True


@pytest.mark.unit
def test_generate_phase_and_kv_cache_by_hand(recipe):
    from rlcore.config.cli import parse_config

    cfg = parse_config(["--config", recipe], device_type="cuda")
    plan = plan_from_config(cfg, world_size=16, device_gb=80, device_type="cuda")
    gen = plan.phases["generate"]
    kv_proj = 36 * 2 * 4096 * 128  # k and v projections of one kv head, all layers
    vllm_weights = 2 * ((N - 8 * kv_proj) // 2 + 4 * kv_proj)  # bf16, TP 2: 4 of the 8 kv heads per rank
    vllm_act = 16384 * (2 * 4096 + (2 * 4096 + 2 * 1024 + 3 * 12288) // 2) * 2 + 3 * 1024 * 151936 * 4
    kv = int(0.6 * 80 * GB) - vllm_weights - vllm_act - GB // 2
    assert gen["vllm_weights"] == vllm_weights
    assert gen["vllm_activations"] == vllm_act  # vLLM's >= 70 GB defaults: 16384 tokens, 1024 seqs
    assert gen["kv_cache"] == kv
    assert gen["reference"] == 2 * N // 16  # offload.ref false: stays while vLLM generates
    assert gen["trainer_params"] == gen["optimizer"] == gen["gradients"] == 0  # offloaded
    assert plan.kv["bytes_per_token"] == 2 * 36 * 4 * 128 * 2
    assert plan.kv["tokens"] == kv // (2 * 36 * 4 * 128 * 2)
    assert plan.kv["batch_sequences"] == 128 // 8 * 8


def test_judges_get_a_judging_phase_by_hand(recipe, tmp_path):
    """reward.models: a judging phase (the judges' whole budgets, the policy asleep as for training,
    the trainer state not offloaded), their overhead while asleep, their host memory at level 1,
    too large a judge is an exit-2 error before anything loads."""
    import shutil

    from rlcore.config import ConfigError
    from rlcore.config.cli import parse_config
    from rlcore.plan.judges import check_judging_fits as check_memory

    judge = tmp_path / "judge"
    judge.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "qwen3_1_7b", "config.json"), judge)
    (judge / "tokenizer_config.json").write_text("{}")
    models = ("[{name: clarity, path: %s, template: '{{ response }}', gpu_memory_utilization: %s, sleep_level: 1}]")
    args = ["--config", recipe, "--reward.components", "{math: 1.0, clarity: 1.0}"]
    cfg = parse_config(args + ["--reward.models", models % (judge, 0.25)], device_type="cuda")
    plan = plan_from_config(cfg, world_size=16, device_gb=80, device_type="cuda")
    j, train = plan.phases["judge"], plan.phases["train"]
    assert j["judges"] == int(0.25 * 80 * GB)
    # sleep level 2, offload on: the policy's engine and the trainer state are off the device
    assert j["vllm_weights"] == j["kv_cache"] == j["trainer_params"] == j["optimizer"] == 0
    assert j["reference"] == 2 * N // 16 and j["vllm_overhead"] == GB // 2
    assert plan.total("judge") == int(0.25 * 80 * GB) + 2 * N // 16 + GB // 2
    assert all(plan.phases[ph]["judges_asleep"] == GB // 2 for ph in ("train", "checkpoint", "sync", "generate"))
    assert train["judges"] == 0 and plan.fits
    check_memory(plan)  # fits: no error
    params_1_7b = 151936 * 2048 + 28 * (2048 * 2048 * 2 + 2048 * 1024 * 2 + 256 + 4096 + 3 * 2048 * 6144) + 2048
    text = format_plan(plan)
    assert f"judges asleep: {2 * params_1_7b / 2 / GB:.2f} GB host memory per rank" in text  # bf16 over TP 2
    big = plan_from_config(parse_config(args + ["--reward.models", models % (judge, 0.96)], device_type="cuda"),
                           world_size=16, device_gb=80, device_type="cuda")
    with pytest.raises(ConfigError, match=r"the judging phase needs .* lower reward.models\[\].gpu_memory_utilization"):
        check_memory(big)


def test_a_distillation_teacher_gets_its_own_phase_by_hand(recipe, tmp_path):
    """distill.teacher: a teacher phase (its whole budget, the judges asleep, the policy's engine asleep
    as for training), its overhead while asleep in every other phase (the judging one included), its
    host memory at level 1; too large a teacher is an exit-2 error naming distill.gpu_memory_utilization."""
    import dataclasses
    import shutil

    from rlcore.config import ConfigError
    from rlcore.config.cli import parse_config
    from rlcore.plan.judges import JudgePlan, check_judging_fits
    from rlcore.plan.memory import build_plan
    from rlcore.plan.model_shape import ModelShape

    folder = tmp_path / "teacher"
    folder.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "qwen3_1_7b", "config.json"), folder)
    (folder / "tokenizer_config.json").write_text("{}")
    models = "[{name: clarity, path: %s, template: '{{ response }}', gpu_memory_utilization: 0.25}]" % folder
    cfg = parse_config(["--config", recipe, "--reward.components", "{math: 1.0, clarity: 1.0}",
                        "--reward.models", models], device_type="cuda")
    judged = plan_from_config(cfg, world_size=16, device_gb=80, device_type="cuda")
    teacher = JudgePlan(ModelShape.from_path(str(folder)), 0.3, sleep_level=1, c=2)
    plan = build_plan(dataclasses.replace(judged.inputs, teacher=teacher))
    assert sorted(plan.phases) == sorted(["train", "checkpoint", "sync", "generate", "judge", "teacher"])
    t = plan.phases["teacher"]
    assert t["teacher"] == int(0.3 * 80 * GB) and t["judges"] == 0 and t["judges_asleep"] == GB // 2
    assert plan.total("teacher") == plan.total("judge") - int(0.25 * 80 * GB) + int(0.3 * 80 * GB)
    assert all(plan.phases[ph]["teacher_asleep"] == GB // 2 for ph in ("train", "checkpoint", "sync", "generate", "judge"))
    check_judging_fits(plan)  # fits
    params_1_7b = 151936 * 2048 + 28 * (2048 * 2048 * 2 + 2048 * 1024 * 2 + 256 + 4096 + 3 * 2048 * 6144) + 2048
    assert f"teacher asleep: {2 * params_1_7b / 2 / GB:.2f} GB host memory per rank" in format_plan(plan)
    big = build_plan(dataclasses.replace(judged.inputs, teacher=dataclasses.replace(teacher, gpu_memory_utilization=0.97)))
    with pytest.raises(ConfigError, match=r"distill.gpu_memory_utilization=0.97: the teacher's phase needs"):
        check_judging_fits(big)


def test_json_last_line_has_every_phase_and_component(recipe):
    proc = run_script(recipe, "--nproc", "8", "--nnodes", "2", "--json")
    plan = last_json(proc)
    assert set(plan["phases"]) == set(PHASES) and plan["fits"] is True
    for ph in PHASES:
        assert set(plan["phases"][ph]["components"]) == set(COMPONENTS)
        assert isinstance(plan["phases"][ph]["fits"], bool)
        assert plan["phases"][ph]["total_gb"] == pytest.approx(sum(plan["phases"][ph]["components"].values()),
                                                               abs=0.02)
    assert "component" in proc.stdout and "verdict: fits" in proc.stdout


def test_too_small_device_does_not_fit_and_names_a_setting(recipe):
    proc = run_script(recipe, "--nproc", "8", "--nnodes", "1", "--device-gb", "40", "--json", "--",
                      "--model.gradient_checkpointing", "false")
    assert proc.returncode == 1, proc.stderr
    plan = last_json(proc)
    assert plan["fits"] is False and plan["phases"]["train"]["fits"] is False
    assert "does NOT fit" in proc.stdout
    assert any("model.gradient_checkpointing=true" in s for s in plan["suggestions"]), plan["suggestions"]


def test_64gb_npu_plan(recipe):
    proc = run_script(recipe, "--nproc", "16", "--nnodes", "1", "--device", "npu", "--device-gb", "64", "--json")
    plan = last_json(proc)
    assert plan["device_type"] == "npu" and plan["limit_gb"] == 61.0
    assert plan["fits"] is True, proc.stdout
    # below 70 GB vLLM's defaults shrink: 8192 batched tokens, 256 sequences in its profile run
    vllm_act = 8192 * (2 * 4096 + (2 * 4096 + 2 * 1024 + 3 * 12288) // 2) * 2 + 3 * 256 * 151936 * 4
    assert plan["phases"]["generate"]["components"]["vllm_activations"] == pytest.approx(vllm_act / GB, abs=1e-3)


@pytest.mark.unit
def test_kv_cache_smaller_than_one_sequence_does_not_fit():
    p = PlanInputs(ModelShape.from_path(FIXTURE), world=16, device_gb=80, tp=2, gpu_memory_utilization=0.12,
                   max_model_len=3072, prompt_len=1024, response_len=2048, gradient_checkpointing=True)
    plan = build_plan(p)
    assert not plan.kv_ok and not plan.fits
    assert "vLLM will not start" in plan.warnings[0]
    assert any("gpu_memory_utilization" in s for s in plan.suggestions)


@pytest.mark.unit
def test_moe_count_and_expert_sharding():
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 256, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
           "decoder_sparse_step": 1, "mlp_only_layers": [3], "vocab_size": 100, "tie_word_embeddings": True}
    shape = ModelShape.from_hf_config(cfg)
    attn = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 16  # q, k, v, o + q_norm/k_norm
    sparse = attn + 2 * 64 + 64 * 8  # + norms + router
    dense = attn + 2 * 64 + 3 * 64 * 256
    experts = 8 * 3 * 64 * 32
    assert shape.sparse == (True, True, True, False)
    assert shape.counts() == (100 * 64 + 64 + 3 * sparse + dense, 3 * experts)  # tied: no lm_head
    assert shape.layer(0, ep=4) == (sparse, experts // 4)  # expert parallelism shards experts only


# ---------------------------------------------------------------------------------------------
# vision-language models: the vision tower (tests/fixtures/qwen3_vl_8b: Qwen3-VL-8B-Instruct's config.json)
# ---------------------------------------------------------------------------------------------

VL_FIXTURE = os.path.join(REPO, "tests", "fixtures", "qwen3_vl_8b")


def qwen3_vl_vision_by_hand(v, inter, depth, out, pos, deepstack, merge=2, patch_pixels=3 * 2 * 16 * 16) -> int:
    """Qwen3-VL's visual module written out (v hidden, H = v merge^2)."""
    h = v * merge ** 2
    patch_embed = patch_pixels * v + v  # Conv3d with bias
    pos_embed = pos * v
    block = (2 * 2 * v  # norm1, norm2: LayerNorm weight + bias
             + v * 3 * v + 3 * v + v * v + v  # qkv, proj (with bias)
             + v * inter + inter + inter * v + v)  # linear_fc1, linear_fc2 (with bias)
    merger = 2 * v + h * h + h + h * out + out  # LayerNorm over v, fc1 H -> H, fc2 H -> out
    deepstack_merger = 2 * h + h * h + h + h * out + out  # LayerNorm over H (post-shuffle)
    return patch_embed + pos_embed + depth * block + merger + deepstack * deepstack_merger


@pytest.mark.unit
def test_qwen3_vl_8b_count_is_the_hand_sum():
    shape = ModelShape.from_path(VL_FIXTURE)
    vision = qwen3_vl_vision_by_hand(1152, 4304, 27, 4096, 2304, 3)
    assert vision == shape.vision_params() == 576_388_336
    # the language model is Qwen3-8B's shape; the total is the 750 tensors of the released
    # safetensors (8,767,123,696 elements)
    assert shape.params == N + vision == 8_767_123_696
    assert shape.arch == "Qwen3VLForConditionalGeneration" and not shape.tied
    assert shape.vision.max_image_tokens == 16384  # no preprocessor_config.json: the processor default
    assert shape.root() == 2 * EMBED + 4096 + (vision - 27 * shape.vision.block())  # ViT blocks are FSDP units


@pytest.mark.unit
def test_qwen3_vl_8b_count_equals_transformers_on_meta():
    """Qwen3VLForConditionalGeneration built from the fixture on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(VL_FIXTURE))
    shape = ModelShape.from_path(VL_FIXTURE)
    assert sum(p.numel() for p in model.model.visual.parameters()) == shape.vision_params()
    assert sum(p.numel() for p in model.parameters()) == shape.params
    vis = model.model.visual
    assert sum(p.numel() for p in vis.blocks[0].parameters()) == shape.vision.block()
    assert sum(p.numel() for p in vis.deepstack_merger_list[0].parameters()) == shape.vision.merger(4608)


@pytest.mark.unit
def test_tiny_qwen3_vl_count_equals_the_loaded_model(tiny_vl_model):
    """rlcore.demo.vl's tiny Qwen3-VL loaded by transformers; its processor caps images at 128 x 128
    pixels (preprocessor_config.json), i.e. 16 tokens of 32 x 32 pixels."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_vl_model)
    shape = ModelShape.from_path(tiny_vl_model)
    assert sum(p.numel() for p in model.model.visual.parameters()) == shape.vision_params() == \
        qwen3_vl_vision_by_hand(64, 128, 2, 64, 64, 1)
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert shape.vision.max_image_tokens == 128 * 128 // 32 ** 2


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen2_vl_towers_equal_transformers_on_meta(family, tmp_path):
    """Qwen2.5-VL-7B's and Qwen2-VL-2B's vision configs (top-level LM, qkv bias) with a 2-layer LM."""
    import torch
    import transformers

    lm = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 2, "num_attention_heads": 12,
          "num_key_value_heads": 2, "vocab_size": 151936}
    if family == "qwen2_5_vl":
        vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 1536,
                  "in_chans": 3, "num_heads": 16, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                  "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 1536,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
        cls = transformers.Qwen2VLForConditionalGeneration
    config = {"architectures": [cls.__name__], "model_type": family, **lm, "tie_word_embeddings": True,
              "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = cls(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    shape = ModelShape.from_path(str(tmp_path))
    assert sum(p.numel() for p in model.model.visual.parameters()) == shape.vision_params() > 6e8
    assert sum(p.numel() for p in model.parameters()) == shape.params  # LM with qkv bias, tied lm_head


@pytest.mark.unit
def test_unknown_vision_tower_is_named_not_counted(tmp_path):
    config = json.loads(open(os.path.join(FIXTURE, "config.json")).read())
    config = {"model_type": "some_vl", "text_config": config, "vision_config": {"depth": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_path(str(tmp_path))
    assert shape.vision is None and shape.params == N and shape.uncounted_vision == "some_vl"
    plan = build_plan(PlanInputs(shape, world=16, device_gb=80, tp=2), suggest=False)
    assert any("'some_vl'" in w and "not counted" in w for w in plan.warnings)


VL_RECIPE = """\
model: {{path: {model}, dtype: bfloat16, gradient_checkpointing: true, freeze_vision_tower: {frozen}}}
data: {{train_files: [unused.parquet], image_key: images, apply_chat_template: true, max_prompt_length: 1024}}
rollout: {{n: 8, max_response_length: 2048, max_model_len: 3072, tensor_parallel_size: 2,
          gpu_memory_utilization: 0.6, sleep_level: 2, enforce_eager: true, sync_bucket_mb: 64,
          max_num_seqs: 128, max_num_batched_tokens: 8192, limit_mm_per_prompt: {{image: 1, video: 0}}}}
offload: {{params: true, optimizer: true, ref: true}}
algorithm: {{kl_loss_coef: 0.01, micro_batch_size: 4}}
trainer: {{prompts_per_step: 128}}
"""


def vl_plan(tmp_path, frozen: bool):
    from rlcore.config.cli import parse_config

    path = tmp_path / f"vl_{frozen}.yaml"
    path.write_text(VL_RECIPE.format(model=VL_FIXTURE, frozen=str(frozen).lower()))
    cfg = parse_config(["--config", str(path)], device_type="cuda")
    return plan_from_config(cfg, world_size=16, device_gb=80, device_type="cuda")


@pytest.mark.unit
@pytest.mark.parametrize("frozen", [False, True])
def test_vl_plan_by_hand(tmp_path, frozen):
    """The vision tower in every component: sharded fp32 state (frozen: no gradients or AdamW state
    for it), its activations, vLLM's weights and its profile run of the ViT."""
    plan = vl_plan(tmp_path, frozen)
    V, P, W = 576_388_336, 8_767_123_696, 16
    trainable = P - V * frozen
    train = plan.phases["train"]
    assert (train["trainer_params"], train["gradients"], train["optimizer"]) == \
        (4 * P // W, 4 * trainable // W, 8 * trainable // W)
    assert plan.to_json()["model"]["vision_params"] == V

    # activations: Qwen3-8B's (4 sequences of 3072) + the ViT's for 4 x 1024 image tokens at most
    T, img = 4 * 3072, 4 * 1024
    per_token_layer = 4 * 4096 + 2 * (4096 + 2 * 1024) + 4096 + 4 * 12288
    text = 36 * T * 4096 * 2 + 2 * T * per_token_layer * 2 + 2 * T * 4096 * 2 + 6 * 1024 * 151936 * 4
    out = 4096 * (1 + 3)  # merger + 3 deepstack mergers, per image token
    if frozen:  # no autograd through the tower: its output only
        vision = img * out * 2
    else:
        patches = 4 * img
        vision = (27 * patches * 1152 + 2 * patches * (11 * 1152 + 2 * 4304)  # checkpointed blocks, one recomputed
                  + img * 4 * 4 * 4608  # 4 mergers: norm in/out, hidden, activated (H = 4608)
                  + 2 * img * out) * 2  # the output and its gradient
    assert train["activations"] == text + vision

    # vLLM: TP 2 shards all but the ViT's patch/position embeddings (and 4 of 8 kv heads per rank)
    gen = plan.phases["generate"]
    kv_proj = 36 * 2 * 4096 * 128
    whole = 1536 * 1152 + 1152 + 2304 * 1152
    assert gen["vllm_weights"] == 2 * ((P - 8 * kv_proj - whole) // 2 + 4 * kv_proj + whole)
    # profile run: one 16384-token image (the processor's default largest; 16384 > 8192 batched tokens)
    patches = 16384 * 4
    encoder = patches * (1536 + 4 * 1152 + (4 * 1152 + 2 * 4304) // 2) * 2
    kept = 16384 * out * 2
    decoder = 8192 * (2 * 4096 + (2 * 4096 + 2 * 1024 + 3 * 12288) // 2) * 2 + 3 * 128 * 151936 * 4
    assert gen["vllm_activations"] == max(encoder, decoder) + kept
    assert gen["kv_cache"] == int(0.6 * 80 * GB) - gen["vllm_weights"] - gen["vllm_activations"] - GB // 2
    assert plan.fits and plan.kv["sequences"] >= plan.kv["batch_sequences"] == 128


@pytest.mark.unit
def test_vl_plan_reads_the_processor_image_budget(tmp_path):
    """A preprocessor_config.json that caps images at 1024 x 1024 pixels: 1024 tokens per image, so
    vLLM's encoder budget (8192 batched tokens) profiles 8 images, and training counts at most
    1024 image tokens per prompt."""
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(os.path.join(VL_FIXTURE, "config.json"), model)
    (model / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"longest_edge": 1024 * 1024, "shortest_edge": 65536}, "patch_size": 16, "merge_size": 2}))
    shape = ModelShape.from_path(str(model))
    assert shape.vision.max_image_tokens == 1024
    from rlcore.plan.memory import vllm_encoder_bytes

    p = PlanInputs(shape, world=16, device_gb=80, tp=2, max_num_batched_tokens=8192, max_num_seqs=128)
    encoder, kept = vllm_encoder_bytes(p)
    assert kept == 8 * 1024 * 4096 * 4 * 2
    assert encoder == 8 * 1024 * 4 * (1536 + 4 * 1152 + (4 * 1152 + 2 * 4304) // 2) * 2
    assert vllm_encoder_bytes(PlanInputs(shape, world=16, device_gb=80, vllm_images=0)) == (0, 0)


@pytest.mark.unit
def test_moe_sync_scratch_is_a_layers_gathered_experts():
    """Qwen3-30B-A3B (its public config.json): a layer's [E, 2I, H] gate_up_proj twice and its
    [E, H, I] down_proj, in bf16: 5 x 128 x 2048 x 768 x 2 bytes = 1.875 GiB (one routed expert,
    the largest bucket unit, gave 1.16 GiB)."""
    import os

    from rlcore.plan.memory import sync_bucket_bytes

    shape = ModelShape.from_path(os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_30b_a3b"))

    scratch = sync_bucket_bytes(PlanInputs(shape=shape, world=16, device_gb=80, dtype="bfloat16", tp=4, ep=8))
    assert scratch == 5 * 128 * 2048 * 768 * 2 and scratch / GB == pytest.approx(1.875)


@pytest.mark.unit
def test_hsdp_shards_the_trainer_state_over_fsdp_size():
    """parallel.fsdp_size (HSDP): a rank holds 1/fsdp_size of the trainer state, not 1/world; the rest
    of the plan (vLLM, activations) does not change. Qwen3-8B on 16 ranks, fsdp_size 8: twice the bytes."""
    from dataclasses import replace

    from rlcore.plan.memory import component_bytes

    p = PlanInputs(ModelShape.from_path(FIXTURE), world=16, device_gb=80, reference=True, tp=2)
    plain, hsdp = component_bytes(p), component_bytes(replace(p, fsdp=8))
    assert (plain["trainer_params"], plain["optimizer"]) == (4 * N // 16, 8 * N // 16)
    for key, per_param in (("trainer_params", 4), ("gradients", 4), ("optimizer", 8), ("reference", 2)):
        assert hsdp[key] == per_param * N // 8, key
    assert {k: v for k, v in hsdp.items() if k not in ("trainer_params", "gradients", "optimizer", "reference")} \
        == {k: v for k, v in plain.items() if k not in ("trainer_params", "gradients", "optimizer", "reference")}
    assert component_bytes(replace(p, fsdp=16)) == plain  # fsdp_size = world is plain FSDP


def test_hsdp_plan_from_config_and_its_suggestion(recipe):
    """The script reads parallel.fsdp_size; a plan that misses names a bigger shard group, not more ranks."""
    proc = run_script(recipe, "--nproc", "16", "--nnodes", "1", "--device-gb", "80", "--json", "--",
                      "--parallel.fsdp_size", "2")
    plan = last_json(proc)
    train = plan["phases"]["train"]["components"]
    assert train["trainer_params"] == pytest.approx(4 * N // 2 / GB, abs=1e-3)
    assert plan["fits"] is False
    assert any(s.startswith("parallel.fsdp_size=") for s in plan["suggestions"]), plan["suggestions"]
    assert not any("more ranks shard" in s for s in plan["suggestions"]), plan["suggestions"]
