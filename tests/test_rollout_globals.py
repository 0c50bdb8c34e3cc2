"""Issue 60, F2: vllm-ascend's module globals kept per engine (rlcore/rollout/vllm_globals.py).

vllm-ascend 0.23.0 keeps the first rotary module's cos/sin cache, cos/sin buffers sized once, the MC2
sizes and its model-class flags in module globals that every engine in the process shares. The tests
install stand-ins under the real module names (``vllm_ascend.ops.rotary_embedding``,
``vllm_ascend.ascend_forward_context``, ``vllm_ascend.utils``) whose functions are vllm-ascend's, cut
down to the lines these globals take part in (cited per function), and build a policy and a teacher
through ``ColocateRollout`` on fake engines that do at build and per forward what vllm-ascend's
NPUModelRunner does with them. The policy's sleep marks its cos/sin cache as unmapped (NaN: its
storage is in the sleep-mode weights pool).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace as NS

import pytest
import torch

from rlcore.rollout import vllm_globals
from test_rollout_accel import FakeLLM, fake_vllm, make  # noqa: F401  (fake_vllm: the fixture)

ROTARY = '''
import torch
_cos_mla = None
_sin_mla = None
_cos_cache = None
_sin_cache = None
_cos_sin_cache = None
_cos = None
_sin = None
_cos_slice = None
_sin_slice = None


def set_cos_and_sin(max_num_batched_tokens, rope_dim):  # ops/rotary_embedding.py:62-86 (the GQA branch)
    global _cos, _sin
    if _cos_mla is not None or _sin_mla is not None or _cos is not None or _sin is not None:
        return
    _cos = torch.ones(1, max_num_batched_tokens, 1, rope_dim)
    _sin = torch.zeros(1, max_num_batched_tokens, 1, rope_dim)


def _record_cos_sin_cache(cos_sin_cache):  # :104-108
    global _cos_sin_cache
    if _cos_sin_cache is not None:
        return
    _cos_sin_cache = cos_sin_cache


def update_cos_sin(positions):  # :129-146
    global _cos_slice, _sin_slice
    if _cos_sin_cache is None or _cos is None or _sin is None:
        return
    num_tokens = positions.size(0)
    parts = _cos_sin_cache.index_select(0, positions).view(num_tokens, 2, -1).repeat(1, 1, 2).chunk(2, dim=-2)
    _cos[:, :num_tokens] = parts[0]
    _sin[:, :num_tokens] = parts[1]
    _cos_slice = _cos[:, :num_tokens]
    _sin_slice = _sin[:, :num_tokens]
'''

FORWARD_CONTEXT = '''
_mc2_tokens_capacity = None
_reserved_mc2_mask = None


def set_mc2_tokens_capacity(max_num_tokens):  # ascend_forward_context.py:202-217
    global _mc2_tokens_capacity
    if _mc2_tokens_capacity is not None:
        return
    _mc2_tokens_capacity = min(max_num_tokens, 512)
'''

UTILS = '''
_IS_MOE_MODEL = None
_IS_DRAFTER_MOE_MODEL = None
_IS_VL_MODEL = None
_ENABLE_SP = None
_HAS_LAYER_IDX = None
_HAS_ROPE = None


def is_moe_model(hf_config):  # utils.py:937-943 (_is_contain_expert on the config's keys)
    global _IS_MOE_MODEL
    if _IS_MOE_MODEL is None:
        _IS_MOE_MODEL = any("expert" in k for k in hf_config)
    return _IS_MOE_MODEL


def is_vl_model(hf_config):  # :1001-1029 (the config-key fallback)
    global _IS_VL_MODEL
    if _IS_VL_MODEL is None:
        _IS_VL_MODEL = "vision_config" in hf_config or "thinker_config" in hf_config
    return _IS_VL_MODEL


def has_rope(hf_config):  # :1032-1038
    global _HAS_ROPE
    if _HAS_ROPE is None:
        _HAS_ROPE = "rope_parameters" in hf_config
    return _HAS_ROPE


_potential_max_tokens = None


def set_potential_max_tokens(vllm_config):  # :1216-1221, the no-graph branch of :1205-1206
    global _potential_max_tokens
    if _potential_max_tokens is not None:
        return
    _potential_max_tokens = min(vllm_config.scheduler_config.max_num_seqs, 512)


def get_potential_max_tokens():  # :1224-1227
    assert _potential_max_tokens is not None
    return _potential_max_tokens
'''

ASCEND_CONFIG = '''
_ASCEND_CONFIG = None


class AscendConfig:  # ascend_config.py:27-32, the keys read here (enable_reduce_sample :324, enable_prefill_mc2 :165)
    def __init__(self, vllm_config):
        additional_config = vllm_config.additional_config if vllm_config.additional_config is not None else {}
        self.vllm_config = vllm_config
        self.enable_reduce_sample = additional_config.get("enable_reduce_sample", False)
        self.enable_prefill_mc2 = bool(additional_config.get("enable_prefill_mc2", False))
        self.ascend_compilation_config = self.eplb_config = object()


def _is_ascend_config_initialized(config):  # :900-910
    if config is None:
        return False
    return hasattr(config, "ascend_compilation_config") and hasattr(config, "eplb_config")


def init_ascend_config(vllm_config):  # :913-931 (the refresh key left out)
    global _ASCEND_CONFIG
    if (_ASCEND_CONFIG is not None and _is_ascend_config_initialized(_ASCEND_CONFIG)
            and getattr(_ASCEND_CONFIG, "vllm_config", None) is vllm_config):
        return _ASCEND_CONFIG
    new_config = AscendConfig(vllm_config)
    if _is_ascend_config_initialized(new_config):
        _ASCEND_CONFIG = new_config
    return new_config


def get_ascend_config():  # :940-944
    if _ASCEND_CONFIG is None or not _is_ascend_config_initialized(_ASCEND_CONFIG):
        raise RuntimeError("Ascend config is not initialized. Please call init_ascend_config first.")
    return _ASCEND_CONFIG
'''


def standin(name: str, source: str) -> types.ModuleType:
    m = types.ModuleType(name)
    exec(compile(source, f"<{name} stand-in>", "exec"), m.__dict__)
    return m


@pytest.fixture
def ascend(monkeypatch):
    mods = {"rot": standin("vllm_ascend.ops.rotary_embedding", ROTARY),
            "ctx": standin("vllm_ascend.ascend_forward_context", FORWARD_CONTEXT),
            "utils": standin("vllm_ascend.utils", UTILS),
            "config": standin("vllm_ascend.ascend_config", ASCEND_CONFIG)}
    for m in (types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend.ops"), *mods.values()):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    for name, keys in vllm_globals.ASCEND_GLOBALS.items():  # exactly the names vllm_globals keeps
        assert all(hasattr(sys.modules[name], k) for k in keys), name
    return types.SimpleNamespace(**mods)


@pytest.fixture
def no_vllm(monkeypatch):
    """No vLLM to import (an ImportError, which vllm_globals handles): calling ``engine_build`` directly
    then touches only vllm-ascend's globals, and imports nothing."""
    monkeypatch.setitem(sys.modules, "vllm", None)


class NPUFakeLLM(FakeLLM):
    """An NPU engine's use of the globals: at build its rotary module records its cos/sin cache
    (AscendRotaryEmbedding.__init__, ops/rotary_embedding.py:230-231) and the runner sizes the buffers
    and MC2 capacity (worker/model_runner_v1.py:500-502); every forward fills cos/sin from the recorded
    cache (:2266) and classifies the model (ascend_forward_context.py:125)."""

    spec: dict = {}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        rot, ctx, utils, config = _modules()
        s = self.spec = dict(NPUFakeLLM.spec)
        tokens = kwargs["max_num_batched_tokens"]
        # NPUPlatform.check_and_update_config (platform.py:475) on the engine's own config object
        self.vllm_config = NS(additional_config=kwargs.get("additional_config"),
                              scheduler_config=NS(max_num_seqs=kwargs.get("max_num_seqs") or 256))
        config.init_ascend_config(self.vllm_config)
        utils.set_potential_max_tokens(self.vllm_config)  # model_runner_v1.py:505
        self.cache = torch.arange(s["max_pos"] * s["rope_dim"], dtype=torch.float32).view(s["max_pos"], s["rope_dim"])
        rot._record_cos_sin_cache(self.cache)
        if not utils.is_vl_model(s["hf_config"]) and utils.has_rope(s["hf_config"]):  # rotary_embedding.py:78
            rot.set_cos_and_sin(tokens, s["rope_dim"])
        ctx.set_mc2_tokens_capacity(tokens)
        utils.is_moe_model(s["hf_config"])  # set_mc2_mask (model_runner_v1.py:502) asks, ascend_forward_context.py:228
        self.forwards: list[dict] = []

    def generate(self, inputs, params, use_tqdm=False):
        rot, ctx, utils, config = _modules()
        positions = torch.arange(self.spec["positions"])
        rot.update_cos_sin(positions)
        self.forwards.append({"own_cache": rot._cos_sin_cache is self.cache,
                              "cos_ok": bool(torch.isfinite(rot._cos_slice).all()),
                              "cos_tokens": rot._cos.shape[1], "mc2": ctx._mc2_tokens_capacity,
                              "moe": utils.is_moe_model(self.spec["hf_config"])})
        if self.spec.get("read_config"):  # model_runner_v1.py:2623, vocab_parallel_embedding.py:176
            ascend = config.get_ascend_config()
            self.forwards[-1].update(reduce_sample=ascend.enable_reduce_sample,
                                     own_config=ascend.vllm_config is self.vllm_config,
                                     max_tokens=utils.get_potential_max_tokens())
        return super().generate(inputs, params, use_tqdm)

    def sleep(self, level=1):
        super().sleep(level)
        self.cache.fill_(float("nan"))  # unmapped with the weights pool (camem.py:204-217): garbage

    def wake_up(self, tags=None):
        super().wake_up(tags)
        self.cache.copy_(torch.arange(self.cache.numel(), dtype=torch.float32).view_as(self.cache))


def _modules():
    return (sys.modules[n] for n in ("vllm_ascend.ops.rotary_embedding", "vllm_ascend.ascend_forward_context",
                                     "vllm_ascend.utils", "vllm_ascend.ascend_config"))


POLICY = dict(max_pos=64, rope_dim=32, positions=48, hf_config={"rope_parameters": {}})
TEACHER = dict(max_pos=256, rope_dim=64, positions=200, hf_config={"rope_parameters": {}, "num_experts": 4})


@pytest.mark.unit
def test_each_engine_keeps_its_ascend_globals(fake_vllm, ascend, monkeypatch):
    """A dense policy (head 32, 64 tokens a step) then a mixture-of-experts teacher (head 64, 256): each
    forward fills its own cos/sin buffers from its own cache, sized by its own settings, and sees its own
    flags and MC2 capacity; the teacher scores while the policy sleeps. Before: the teacher's build kept
    the policy's cache, buffers and flags (a dense teacher-less MoE classification, shape errors)."""
    fake_vllm.LLM = NPUFakeLLM
    monkeypatch.setattr(NPUFakeLLM, "spec", POLICY)
    policy = make("npu", max_num_batched_tokens=64, sleep_level=1)
    assert ascend.rot._cos_sin_cache is policy.llm.cache and ascend.utils._IS_MOE_MODEL is False
    monkeypatch.setattr(NPUFakeLLM, "spec", TEACHER)
    teacher = make("npu", max_num_batched_tokens=256, sleep_level=1)
    assert ascend.rot._cos_sin_cache is policy.llm.cache, "the teacher's build left its globals bound"
    assert ascend.utils._IS_MOE_MODEL is False and ascend.ctx._mc2_tokens_capacity == 64
    policy.generate([[1]], n=1)
    policy.release_memory()  # the policy sleeps while the teacher scores
    teacher.generate([[1]], n=1)
    policy.resume_memory()
    policy.generate([[1]], n=1)
    p, t = policy.llm.forwards, teacher.llm.forwards
    assert p == [{"own_cache": True, "cos_ok": True, "cos_tokens": 64, "mc2": 64, "moe": False}] * 2
    assert t == [{"own_cache": True, "cos_ok": True, "cos_tokens": 256, "mc2": 256, "moe": True}]
    assert ascend.rot._cos_sin_cache is policy.llm.cache  # between calls: the policy's, as after its build


@pytest.mark.unit
def test_lazy_values_stay_with_their_engine(ascend, no_vllm):
    """A value an engine's call computes first (has_layer_idx at the first forward, the cos/sin
    slices) is kept as that engine's; the previous binding comes back after the call."""
    owned_a, owned_b = {}, {}
    with vllm_globals.engine_build(owned_a):
        ascend.utils._IS_VL_MODEL = False
    with vllm_globals.engine_build(owned_b):
        assert ascend.utils._IS_VL_MODEL is None  # cleared before a build
        ascend.utils._IS_VL_MODEL = True
    assert ascend.utils._IS_VL_MODEL is False  # a's again after b's build
    with vllm_globals.bind(owned_b):
        assert ascend.utils._IS_VL_MODEL is True
        ascend.utils._HAS_LAYER_IDX = True
    assert ascend.utils._HAS_LAYER_IDX is None and owned_b["ascend"]["vllm_ascend.utils"]["_HAS_LAYER_IDX"] is True
    with vllm_globals.bind(owned_b), vllm_globals.bind(owned_b):  # nested, as update_weights -> _reload
        assert ascend.utils._HAS_LAYER_IDX is True
    assert ascend.utils._IS_VL_MODEL is False


@pytest.mark.unit
def test_no_vllm_ascend_is_a_no_op(monkeypatch, no_vllm):
    """CPU and CUDA: no vllm-ascend module imported, nothing recorded or bound."""
    for name in vllm_globals.ASCEND_GLOBALS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert vllm_globals.ascend_state() == {}
    owned: dict = {}
    with vllm_globals.engine_build(owned):
        pass
    assert owned["ascend"] == {}
    with vllm_globals.bind(owned):
        assert vllm_globals.ascend_state() == {}


@pytest.mark.unit
def test_the_policys_additional_config_survives_a_teachers_build(fake_vllm, ascend, monkeypatch):
    """Issue 66 F2: vllm-ascend rebuilds its process-wide AscendConfig from each engine's
    additional_config (ascend_config.py:913-929) and sizes potential_max_tokens once, from the first
    engine (utils.py:1216-1221); forwards read both. The policy's rollout.engine_kwargs.additional_config
    key (enable_reduce_sample) and its max_num_seqs stay what its forwards see after a teacher with
    vllm-ascend's defaults is built, and the teacher's forwards see its own. Before: the policy read the
    teacher's config (the key reverted to False) and the teacher the policy's token count."""
    fake_vllm.LLM = NPUFakeLLM
    monkeypatch.setattr(NPUFakeLLM, "spec", {**POLICY, "read_config": True})
    policy = make("npu", max_num_batched_tokens=64, max_num_seqs=32, sleep_level=1,
                  vllm={"engine_kwargs": {"additional_config": {"enable_reduce_sample": True}}})
    assert policy.llm.vllm_config.additional_config["enable_reduce_sample"] is True  # it reached the engine
    monkeypatch.setattr(NPUFakeLLM, "spec", {**TEACHER, "read_config": True})
    teacher = make("npu", max_num_batched_tokens=256, max_num_seqs=128, sleep_level=1)
    policy.generate([[1]], n=1)
    teacher.generate([[1]], n=1)
    policy.generate([[1]], n=1)
    mine = {k: [f[k] for f in policy.llm.forwards] for k in ("reduce_sample", "own_config", "max_tokens")}
    assert mine == {"reduce_sample": [True, True], "own_config": [True, True], "max_tokens": [32, 32]}
    theirs = teacher.llm.forwards[0]
    assert (theirs["reduce_sample"], theirs["own_config"], theirs["max_tokens"]) == (False, True, 128)
