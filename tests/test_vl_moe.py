"""Qwen3-VL-MoE (the Qwen3-VL-30B-A3B family, shrunk) on CPU with expert parallelism 2: the policy
(VeOmni's patched Qwen3-VL-MoE, FSDP2 + EP over 2 gloo ranks, the pure-torch EP experts of
rlcore/engine/moe.py) against transformers' ``Qwen3VLMoeForConditionalGeneration``, its weight
export against the checkpoint, and ColocateRollout (vLLM, images) before and after a push of the
trained weights. One torchrun launch (tests/workers/vl_moe.py) holds policy and rollout.

This process never imports VeOmni (transformers stays unpatched): it builds the packed rows
(processor, transformers' M-RoPE positions per sample), the reference log-probs and the reference
gradient; the worker runs the engine on them.

Expert layout (see ``rlcore.engine.moe.ExpertLayout``): the tiny checkpoint stores the experts
as the released Qwen3-VL-MoE checkpoints do, fused ``[E, H, 2I]`` / ``[E, I, H]``; with H = 64,
I = 96 no expert tensor is square, so a layout mistake fails loudly in every loader.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import rlcore  # noqa: F401  (torchvision shim before transformers' Qwen-VL processor)
from conftest import REPO, run_torchrun
from test_vl_policy import Sample, image, pack  # the same reference rows (processor, transformers' positions)

WORKER = os.path.join(REPO, "tests", "workers", "vl_moe.py")
TOL = 1e-4  # fp32 policy vs transformers (measured ~1e-6)
ROLLOUT_TOL = 1e-3  # fp32 vLLM vs transformers
ROUTER_MARGIN = 1e-5  # smallest gap between a token's k-th and (k+1)-th router probability (fp32 noise ~1e-7)


@pytest.fixture(scope="module")
def tiny_vl_moe(tmp_path_factory) -> str:
    from workers.vl_moe import make_tiny_vl_moe_model

    return make_tiny_vl_moe_model(str(tmp_path_factory.mktemp("tiny_vl_moe")))


def loss_weights(k: int) -> torch.Tensor:
    """The worker's simple loss of a row: -(logp * w).sum(), tokens pushed up and down."""
    return torch.linspace(-1.0, 1.5, k)


@pytest.fixture(scope="module")
def vl_moe_inputs(tiny_vl_moe, tmp_path_factory):
    """Two packed rows (rank 0 and rank 1: different images and token counts, so the EP exchange
    is uneven), the per-sample transformers log-probs, the gradient of the mean of the two rows'
    losses, and the smallest router margin seen (no near-ties: EP and transformers route alike)."""
    from transformers import AutoProcessor, Qwen3VLMoeForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_vl_moe)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_vl_moe, dtype=torch.float32)
    model.train()  # no dropout in the model; grads on
    rows = [[Sample(processor, model, "what colour is the shape ?", [image(0, 96, 96)], [26, 27, 28]),
             Sample(processor, model, "how many shapes are there ?", [image(1, 64, 96), image(2, 96, 64)], [15, 11])],
            [Sample(processor, model, "which colour is the larger shape ?", [image(3, 128, 96)], [30, 29, 12, 4]),
             Sample(processor, model, "what colour is the circle ?", [image(4, 96, 96)], [31])]]
    margins = []

    def margin_hook(module, _args, output):
        probs = router_probs(output[0].detach()).sort(-1, descending=True).values
        margins.append(float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min()))

    hooks = [m.register_forward_hook(margin_hook) for m in model.modules()
             if type(m).__name__.endswith("TopKRouter")]
    ref, loss = [], 0.0
    for samples in rows:
        logp = torch.cat([s.reference_logprobs(model) for s in samples])
        ref.append(logp.detach())
        loss = loss + 0.5 * -(logp * loss_weights(logp.shape[0])).sum()
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    packed = [pack(samples) for samples in rows]
    forced_ref = []
    for row, samples in zip(packed, rows):  # routing replay: the experts each token is forced to
        row["replay_rows"], logp = forced_routing(Qwen3VLMoeForConditionalGeneration.from_pretrained(
            tiny_vl_moe, dtype=torch.float32), samples)
        forced_ref.append(logp)
    path = str(tmp_path_factory.mktemp("vl_moe_inputs") / "inputs.pt")
    torch.save({"rows": packed}, path)
    return path, ref, grads, min(margins), forced_ref


def router_probs(first: torch.Tensor) -> torch.Tensor:
    """The fp32 router probabilities from the router's first output: transformers 5.19 returns the logits
    (modeling_qwen3_vl_moe.py:136-141), 5.5.4 (the NPU pin) their softmax under the same name (:124-130)."""
    if bool((first >= 0).all()) and torch.allclose(first.float().sum(-1), torch.ones(len(first))):
        return first.float()
    return torch.nn.functional.softmax(first, dtype=torch.float, dim=-1)


def forced_routing(model, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for routing replay over a packed row (token order = the samples' ids one after the
    other): transformers' own top-k of each token with every third token moved to other experts,
    (L, layers, K); and transformers' response log-probs with its routers forced to them (the
    router's own math at the given indices: fp32 softmax, gather, renorm, cast)."""
    gates = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    state: dict = {"native": []}
    for layer, gate in enumerate(gates):
        native_forward = gate.forward

        def forward(hidden, native_forward=native_forward, layer=layer):
            logits, weights, idx = native_forward(hidden)
            if "rows" not in state:
                state["native"].append(idx)
                return logits, weights, idx
            forced = state["rows"][:, layer]
            probs = router_probs(logits).gather(1, forced)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), forced
        gate.forward = forward
    per_sample, logps = [], []
    with torch.no_grad():
        for s in samples:
            state["native"] = []
            s.reference_logprobs(model)
            top = torch.stack(state["native"], 1)  # (n, layers, K)
            top[::3] = (top[::3] + 1) % model.config.text_config.num_experts
            per_sample.append(top)
        for s, top in zip(samples, per_sample):
            state["rows"] = top
            logps.append(s.reference_logprobs(model))
            del state["rows"]
    return torch.cat(per_sample), torch.cat(logps)


@pytest.fixture(scope="module")
def vl_moe_run(tiny_vl_moe, vl_moe_inputs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vl_moe_run")
    proc = run_torchrun(WORKER, 2, tiny_vl_moe, vl_moe_inputs[0], str(out))
    with open(out / "results.json") as f:
        results = json.load(f)
    return {"out": str(out), "results": results, "stdout": proc.stdout,
            "tensors": torch.load(out / "tensors.pt", weights_only=False)}


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def test_tiny_checkpoint_has_the_released_expert_layout(tiny_vl_moe):
    """Fused experts as released ([E, H, 2I] / [E, I, H]); transformers loads them into its
    [E, 2I, H] / [E, H, I] modeling transposed; rlcore reads the layout back."""
    from safetensors.torch import load_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    from rlcore.engine.moe import ExpertLayout, checkpoint_expert_layout

    ckpt = load_file(os.path.join(tiny_vl_moe, "model.safetensors"))
    name = "model.language_model.layers.0.mlp.experts."
    assert ckpt[name + "gate_up_proj"].shape == (4, 64, 192) and ckpt[name + "down_proj"].shape == (4, 96, 64)
    assert not any(".experts.0." in n for n in ckpt)
    params = dict(Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_vl_moe).named_parameters())
    assert set(params) == set(ckpt)
    assert torch.equal(params[name + "gate_up_proj"], ckpt[name + "gate_up_proj"].transpose(1, 2))
    assert checkpoint_expert_layout(tiny_vl_moe) == ExpertLayout(per_expert=False, transposed=True)


def test_expert_layout_detection(tmp_path):
    """Per-expert names (Qwen3-MoE), fused released, fused in transformers' own save layout; a
    square expert tensor in transformers' layout is refused (VeOmni would transpose it)."""
    from safetensors.torch import save_file

    from rlcore.engine.moe import ExpertLayout, PER_EXPERT, checkpoint_expert_layout, split_experts

    def folder(name, h, i, tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"text_config": {"num_experts": 2, "hidden_size": h,
                                                                   "moe_intermediate_size": i}}))
        save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(d / "model.safetensors"))
        return str(d)

    e = "m.layers.0.mlp.experts."
    per = folder("per", 64, 96, {e + "0.gate_proj.weight": (96, 64), e + "0.up_proj.weight": (96, 64)})
    released = folder("rel", 64, 96, {e + "gate_up_proj": (2, 64, 192), e + "down_proj": (2, 96, 64)})
    own = folder("own", 64, 96, {e + "gate_up_proj": (2, 192, 64), e + "down_proj": (2, 64, 96)})
    released_square = folder("rel_sq", 64, 64, {e + "gate_up_proj": (2, 64, 128), e + "down_proj": (2, 64, 64)})
    own_square = folder("own_sq", 64, 64, {e + "gate_up_proj": (2, 128, 64), e + "down_proj": (2, 64, 64)})
    assert checkpoint_expert_layout(per) == PER_EXPERT
    assert checkpoint_expert_layout(released) == ExpertLayout(False, True)
    assert checkpoint_expert_layout(own) == ExpertLayout(False, False)
    assert checkpoint_expert_layout(released_square) == ExpertLayout(False, True)  # gate_up decides
    with pytest.raises(ValueError, match="square"):
        checkpoint_expert_layout(own_square)
    # split_experts: VeOmni's [E, 2I, H] out in each layout
    w = torch.arange(2 * 6 * 4.0).view(2, 6, 4)
    assert [n for n, _ in split_experts(e + "gate_up_proj", w)] == [
        e + "0.gate_proj.weight", e + "0.up_proj.weight", e + "1.gate_proj.weight", e + "1.up_proj.weight"]
    (n, t), = split_experts(e + "gate_up_proj", w, ExpertLayout(False, True))
    assert n == e + "gate_up_proj" and torch.equal(t, w.transpose(1, 2))
    (n, t), = split_experts(e + "down_proj", w, ExpertLayout(False, False))
    assert torch.equal(t, w)


def test_policy_ep2_logprobs_grads_export(vl_moe_run, vl_moe_inputs, tiny_vl_moe):
    """EP=2 policy: per-token log-probs of two packed image rows (one per rank) equal transformers
    per sample; the gradient of a simple loss equals transformers'; the export (bucketed and
    streamed) is the checkpoint's names and values; the step's router statistics are global."""
    from safetensors.torch import load_file

    _, ref, ref_grads, margin, _ = vl_moe_inputs
    r, t = vl_moe_run["results"], vl_moe_run["tensors"]
    print(f"router margin {margin:.2e}; worker times {r['times_s']}")
    assert margin > ROUTER_MARGIN, f"a near-tie in the routers ({margin:.2e}): pick another seed"
    assert "experts: torch_ep kernel, expert parallel 2" in r["describe"], r["describe"]
    assert r["experts_slot"] == "torch_ep" and r["expert_layout"] == "fused [E, H, 2I] / [E, I, H]"
    assert r["local_experts"] == {"gate_up_proj": [2, 192, 64], "down_proj": [2, 64, 96]}  # EP cut dim 0
    for rank in (0, 1):
        d = maxdiff(t["logprobs"][rank], ref[rank])
        print(f"row {rank}: max |EP2 - transformers| = {d:.2e} over {ref[rank].numel()} tokens")
        assert d <= TOL
    grads = t["grads"]
    assert set(grads) == set(ref_grads)
    num = sum((grads[n] - g).norm() ** 2 for n, g in ref_grads.items()) ** 0.5
    den = sum(g.norm() ** 2 for g in ref_grads.values()) ** 0.5
    experts = [n for n in ref_grads if ".mlp.experts." in n]
    worst = max(maxdiff(grads[n], ref_grads[n]) / max(ref_grads[n].abs().max().item(), 1e-12) for n in experts)
    print(f"grads EP2 vs transformers: rel {num / den:.2e}; worst expert tensor rel max {worst:.2e}")
    assert num / den < 1e-5 and worst < 1e-4
    assert all(bool((ref_grads[n].flatten(1).abs().amax(1) > 0).all()) for n in experts)  # every expert got tokens
    # export = the checkpoint: names (fused, released layout) and values
    ckpt = load_file(os.path.join(tiny_vl_moe, "model.safetensors"))
    for kind in ("bucketed", "streamed"):
        exported = t[f"exported_{kind}"]
        assert set(exported) == set(ckpt), kind
        bad = [n for n in ckpt if not torch.equal(exported[n], ckpt[n])]
        assert not bad, (kind, bad[:5])
    assert r["num_params"] == sum(v.numel() for v in ckpt.values())
    s = r["step"]
    assert s["actor/moe_aux_loss"] > 0.5 and 1.0 <= s["actor/moe_load_mean"] <= s["actor/moe_load_max"] <= 4.0


def test_routing_replay_with_image_tokens_ep2(vl_moe_run, vl_moe_inputs):
    """Routing replay on Qwen3-VL-MoE (the engine's own hook: veomni 0.1.12 wires none for this
    family), EP 2, image rows: every token, image tokens included, reaches the experts with exactly
    the given indices, and the log-probs equal transformers forced to them."""
    r, t = vl_moe_run["results"]["replay"], vl_moe_run["tensors"]
    forced_ref = vl_moe_inputs[4]
    print(json.dumps(r))
    assert r["tokens"] > 0 and r["mismatched"] == 0 and r["image_tokens"] > 0
    assert r["metrics"]["actor/router_replay_missing"] == 0
    assert 0 < r["metrics"]["actor/router_agreement"] < 1  # a third of the tokens were moved
    for rank in (0, 1):
        d = maxdiff(t["replay_logprobs"][rank], forced_ref[rank])
        print(f"row {rank}: max |replayed - transformers forced| = {d:.2e}")
        assert d <= 1e-5
    assert r["native_unchanged"]  # outside replay the blocks compute exactly what they did before


def test_rollout_images_and_weight_push(vl_moe_run, tiny_vl_moe):
    """vLLM (one engine per rank, fp32) on image prompts = transformers; after the policy's step,
    ``update_weights(policy.named_hf_weights_bucketed())``: every vLLM parameter written, the
    log-probs move and equal transformers on the policy's exported (save_hf) weights."""
    from safetensors.torch import load_file

    r = vl_moe_run["results"]
    for rk in r["rollout"]:
        print(json.dumps(rk))
        assert rk["n_per_prompt"] == [2, 2, 2, 2]
        assert rk["lp_diff_before"] < ROLLOUT_TOL
        assert rk["vllm_params_missed"] == [], "vLLM parameters the pushed names did not reach"
        assert rk["pushed"] == len(load_file(os.path.join(tiny_vl_moe, "model.safetensors")))
        assert rk["lp_shift"] > 100 * ROLLOUT_TOL, "the step barely moved the rollout's log-probs"
        assert rk["lp_diff_after"] < ROLLOUT_TOL
        # F6: the direct-load guard sees the real engine's fused-MoE layers (vllm 0.32 MoERunner)
        assert rk["has_fused_moe"] and rk["direct_refused"]
        # rollout.emulate_ascend_moe: the experts in the NPU kernel's layout, sleep level 2, vllm-ascend
        # 0.23's wake-up swap of both expert weights of both layers put back, the push, then exact again
        a = rk["ascend"]
        assert a["restored"] == [4] and a["pushed"] == rk["pushed"], a
        assert a["lp_diff_before"] < ROLLOUT_TOL and a["lp_diff_after"] < ROLLOUT_TOL, a
    # the step's export loads in transformers (the rollout reference above) with trained experts
    saved = load_file(os.path.join(vl_moe_run["out"], "hf_step", "model.safetensors"))
    ckpt = load_file(os.path.join(tiny_vl_moe, "model.safetensors"))
    assert set(saved) == set(ckpt) and all(saved[n].shape == ckpt[n].shape for n in ckpt)
    assert all(not torch.equal(saved[n], ckpt[n]) for n in ckpt if ".mlp.experts." in n)
