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
