"""rollout.emulate_sleep: vLLM's sleep levels 1 and 2 on a CPU engine (rlcore/rollout/cpu_sleep.py), the
config that turns it on, and its refusals. The real engine under it runs in the e2e tests named in
docs/accelerators.md (judge, LoRA, multi-turn, MoE, VL, resume, preemption)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from rlcore.rollout import cpu_sleep


class Tiny(torch.nn.Module):
    """A linear layer that computes through a packed copy (vLLM's CPU ``cpu_linear``), a norm, a
    tied pair of parameters and a rotary-cache-like buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 3)
        packed = self.proj.weight.detach().clone()  # what oneDNN holds; the parameter itself may be emptied
        self.proj.cpu_linear = lambda x, weight, bias: F.linear(x, packed, bias)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 3, bias=False)
        self.tied = torch.nn.Module()
        self.tied.weight = self.head.weight  # one storage, two holders
        self.register_buffer("cos_sin", torch.arange(6.0))

    def forward(self, x):
        return self.head(self.norm(self.proj.cpu_linear(x, self.proj.weight, self.proj.bias)))


def storages(model):
    params, buffers = cpu_sleep.model_storages(model)
    return params, buffers


@pytest.mark.unit
def test_level1_moves_the_weights_out_and_back():
    m, x = Tiny(), torch.randn(2, 4)
    ref, state = m(x), {k: v.clone() for k, v in m.state_dict().items()}
    params, buffers = storages(m)
    assert len(params) == 5 and len(buffers) == 1  # the tied weight counted once
    sleeping = cpu_sleep.sleep_weights(m, 1)
    assert all(st.nbytes() == 0 for st in params + buffers), "level 1 frees every storage"
    cpu_sleep.wake_weights(sleeping)
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
    assert torch.equal(m(x), ref) and cpu_sleep.discarded_linears(m) == []


@pytest.mark.unit
def test_level2_discards_until_every_layer_is_written_again():
    m, x = Tiny(), torch.randn(2, 4)
    cos_sin = m.cos_sin.clone()
    sleeping = cpu_sleep.sleep_weights(m, 2)
    assert all(st.nbytes() == 0 for st in storages(m)[0])
    cpu_sleep.wake_weights(sleeping)
    assert all(torch.isnan(p).all() for p in m.parameters()), "a level-2 wake-up brings garbage (NaN) back"
    assert torch.equal(m.cos_sin, cos_sin), "buffers survive level 2, as vLLM copies them (gpu_worker.py:298-306)"
    assert torch.isnan(m(x)).all() and cpu_sleep.discarded_linears(m) == ["proj"]
    # A push writes the parameters; the packed copy comes back only when its layer is re-processed.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.ones_like(p))
    assert torch.isnan(m(x)).all(), "the layer's packed copy is still the discarded one"
    packed = m.proj.weight.detach().clone()
    m.proj.cpu_linear = lambda x, weight, bias: F.linear(x, packed, bias)  # vLLM's process_weights_after_loading
    assert cpu_sleep.discarded_linears(m) == [] and torch.isfinite(m(x)).all()


@pytest.mark.unit
def test_sleep_level_checked():
    with pytest.raises(ValueError, match="level 1 or 2"):
        cpu_sleep.sleep_weights(Tiny(), 0)


@pytest.mark.unit
def test_emulate_sleep_config():
    """On CPU it resolves to the accelerators' level 2 (LoRA: 1); on a device it is refused by name."""
    from rlcore.config import Config, ConfigError, LoraConfig, ModelConfig, RolloutConfig, resolve
    model = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_8b")  # config.json only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the attention choice's warning on a GPU-less machine
        cfg = Config(model=ModelConfig(path=model), rollout=RolloutConfig(emulate_sleep=True))
        assert resolve(cfg, "cpu").rollout.sleep_level == 2
        assert resolve(Config(model=ModelConfig(path=model)), "cpu").rollout.sleep_level == 0  # off: KV only
        lora = Config(model=ModelConfig(path=model), rollout=RolloutConfig(emulate_sleep=True),
                      lora=LoraConfig(rank=8))
        assert resolve(lora, "cpu").rollout.sleep_level == 1
        with pytest.raises(ConfigError, match="rollout.emulate_sleep=true is for CPU runs.*emulate_sleep: false"):
            resolve(cfg, "cuda")


# ----------------------------------------------------------------------------- rollout.emulate_ascend_moe


class Experts(torch.nn.Module):
    """A fused-MoE layer's two expert weights in vllm-ascend 0.23's kernel layout: w13 (E, H, 2I), w2 (E, I, H)."""

    def __init__(self, e=3, h=8, i=6):
        super().__init__()
        torch.manual_seed(1)
        self.w13_weight = torch.nn.Parameter(torch.randn(e, h, 2 * i), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.randn(e, i, h), requires_grad=False)


def moe_model(**sizes):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    for layer in m.layers:
        layer.experts = Experts(**sizes)
    return m


@pytest.mark.unit
def test_the_wake_swap_is_vllm_ascends_and_the_restore_undoes_it():
    """vllm-ascend 0.23.0 worker.py:251-269: w13 with shape[1] == H and w2 with shape[2] == H become
    transposed views of the same storage; ExpertParams puts the kept Parameters back, and a layer
    it cannot account for is an error naming it."""
    from rlcore.rollout import expert_layout as el

    m = moe_model()
    kept = el.ExpertParams.capture(m)
    before = {n: p for n, p in m.named_parameters()}
    assert el.emulate_wake_swap(m, hidden_size=8) == 4
    w13 = m.layers[0].experts.w13_weight
    assert w13.shape == (3, 12, 8) and not w13.is_contiguous() and el.is_swapped_view(w13, before[
        "layers.0.experts.w13_weight"])
    assert el.emulate_wake_swap(m, hidden_size=5) == 0  # another hidden size: nothing matches
    assert kept.restore() == 4 and all(p is before[n] for n, p in m.named_parameters())
    assert kept.restore() == 0  # in place already (CUDA, CPU): nothing to do
    # not idempotent on the device either: a second swap without the restore is skipped unless 2I == H
    el.emulate_wake_swap(m, hidden_size=8)
    assert el.emulate_wake_swap(m, hidden_size=8) == 0
    # a contiguous transposed copy is not the kept storage: refused, named
    m.layers[1].experts.w2_weight = torch.nn.Parameter(before["layers.1.experts.w2_weight"].transpose(1, 2).contiguous())
    with pytest.raises(RuntimeError, match=r"layers\.1\.experts\.w2_weight: after vLLM's wake_up the layer holds "
                                           r"\(3, 8, 6\).*requirements-npu\.txt"):
        kept.restore()
    assert el.ExpertParams.capture(Tiny()) is None  # a dense model keeps nothing


@pytest.mark.unit
def test_the_emulated_kernel_reads_the_npu_layout():
    """kernel_layout_experts = the per-expert SwiGLU of the checkpoint layout (W13 (2I, H) = [gate; up],
    W2 (H, I)) transposed into (H, 2I) / (I, H), weighted by the router, within 1e-5 (fp32 rounding of
    outputs up to about 10)."""
    from rlcore.rollout.expert_layout import kernel_layout_experts

    torch.manual_seed(0)
    e, h, i, t, k = 4, 8, 6, 5, 2
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)  # vLLM's / the checkpoint's layout
    x, topk_ids = torch.randn(t, h), torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    topk_w = torch.rand(t, k)
    ref = torch.zeros(t, h)
    for tok in range(t):
        for slot in range(k):
            ex = topk_ids[tok, slot]
            hid = w13[ex] @ x[tok]
            ref[tok] += topk_w[tok, slot] * (w2[ex] @ (F.silu(hid[:i]) * hid[i:]))
    out = kernel_layout_experts(x, w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), topk_w, topk_ids)
    assert (out - ref).abs().max() < 1e-5
    # expert parallelism: experts another rank holds (-1 in the map) add nothing here
    emap = torch.tensor([0, -1, 1, -1])
    local = kernel_layout_experts(x, w13[[0, 2]].transpose(1, 2).contiguous(), w2[[0, 2]].transpose(1, 2).contiguous(),
                                  topk_w, topk_ids, emap)
    masked = torch.where(torch.isin(topk_ids, torch.tensor([0, 2])), topk_w, torch.zeros_like(topk_w))
    assert (local - kernel_layout_experts(x, w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(),
                                          masked, topk_ids)).abs().max() < 1e-5


@pytest.mark.unit
def test_emulate_ascend_moe_needs_the_emulated_sleep():
    from rlcore.colocate_rollout import ColocateRollout
    from rlcore.config import Config, ConfigError, ModelConfig, RolloutConfig, resolve
    from rlcore.dist import DistInfo

    model = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_30b_a3b")  # config.json only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Config(model=ModelConfig(path=model), rollout=RolloutConfig(emulate_sleep=True, emulate_ascend_moe=True))
        assert resolve(cfg, "cpu").rollout.emulate_ascend_moe
        with pytest.raises(ConfigError, match="rollout.emulate_ascend_moe=true.*set rollout.emulate_sleep: true"):
            resolve(Config(model=ModelConfig(path=model), rollout=RolloutConfig(emulate_ascend_moe=True)), "cpu")
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device_type="cpu", backend="gloo")
    with pytest.raises(ValueError, match="needs device cpu and emulate_sleep"):
        ColocateRollout(model, info, emulate_ascend_moe=True)
