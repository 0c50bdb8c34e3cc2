"""The memory plan (rlcore/memory_plan.py, scripts/plan_memory.py) against hand computations on
Qwen3-8B's config.json (tests/fixtures/qwen3_8b: the numbers only, no weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlcore.memory_plan import COMPONENTS, GB, PHASES, ModelShape, PlanInputs, build_plan, plan_from_config

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
    from rlcore.cli import parse_config

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


@pytest.mark.unit
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


@pytest.mark.unit
def test_too_small_device_does_not_fit_and_names_a_setting(recipe):
    proc = run_script(recipe, "--nproc", "8", "--nnodes", "1", "--device-gb", "40", "--json", "--",
                      "--model.gradient_checkpointing", "false")
    assert proc.returncode == 1, proc.stderr
    plan = last_json(proc)
    assert plan["fits"] is False and plan["phases"]["train"]["fits"] is False
    assert "does NOT fit" in proc.stdout
    assert any("model.gradient_checkpointing=true" in s for s in plan["suggestions"]), plan["suggestions"]


@pytest.mark.unit
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
