"""rlcore.attention.pick_attn_implementation: which kernel runs on packed micro-batches per device,
with the flash packages' importability monkeypatched (no GPU or flash-attn needed)."""

from __future__ import annotations

import warnings

import pytest

from rlcore import attention
from rlcore.attention import pick_attn_implementation as pick


@pytest.fixture
def importable(monkeypatch):
    """importable({"flash_attn"}) makes exactly those modules import."""
    def set_(modules: set[str]) -> None:
        monkeypatch.setattr(attention, "_importable", lambda name: name in modules)
    return set_


@pytest.mark.unit
def test_auto_on_cpu_is_sdpa_even_with_flash_installed(importable):
    importable({"flash_attn", "flash_attn_interface"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU choice is no fallback: no warning
        impl, reason = pick("auto", "cpu")
    assert impl == "sdpa" and "cpu" in reason


@pytest.mark.unit
@pytest.mark.parametrize("modules, expected", [
    ({"flash_attn", "flash_attn_interface"}, "flash_attention_2"),
    ({"flash_attn_interface"}, "flash_attention_3"),
])
def test_auto_on_cuda_prefers_flash_varlen(importable, modules, expected):
    importable(modules)
    impl, reason = pick("auto", "cuda", dtype="bfloat16")
    assert impl == expected and "varlen" in reason and "no L x L mask" in reason


@pytest.mark.unit
def test_auto_on_cuda_without_flash_falls_back_to_sdpa_with_a_warning(importable):
    importable(set())
    with pytest.warns(UserWarning, match=r"dense \(L x L\)"):
        impl, reason = pick("auto", "cuda", dtype="bfloat16")
    assert impl == "sdpa" and "L*L bytes" in reason and "pip install flash-attn" in reason


@pytest.mark.unit
def test_auto_in_float32_on_an_accelerator_is_sdpa(importable):
    importable({"flash_attn"})
    with pytest.warns(UserWarning):
        impl, reason = pick("auto", "cuda", dtype="float32")
    assert impl == "sdpa" and "float32" in reason


@pytest.mark.unit
def test_auto_on_npu_uses_the_npu_fusion_attention_path(importable):
    importable(set())  # flash-attn does not exist on Ascend; transformers routes FA2 to torch_npu
    impl, reason = pick("auto", "npu", dtype="bfloat16")
    assert impl == "flash_attention_2" and "npu_fusion_attention" in reason


@pytest.mark.unit
@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_explicit_flash_on_cpu_is_an_error_with_the_fix(importable, name):
    importable({"flash_attn", "flash_attn_interface"})
    with pytest.raises(ValueError, match="auto or sdpa"):
        pick(name, "cpu")


@pytest.mark.unit
def test_explicit_flash_checks_package_and_dtype(importable):
    importable(set())
    with pytest.raises(ValueError, match="install flash-attn"):
        pick("flash_attention_2", "cuda", dtype="bfloat16")
    importable({"flash_attn"})
    assert pick("flash_attention_2", "cuda", dtype="bfloat16")[0] == "flash_attention_2"
    assert pick("flash_attention_2", "cuda")[0] == "flash_attention_2"  # dtype unknown: not checked
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        pick("flash_attention_2", "cuda", dtype="float32")
    with pytest.raises(ValueError, match="not available on Ascend"):
        pick("flash_attention_3", "npu", dtype="bfloat16")


@pytest.mark.unit
def test_explicit_sdpa_and_eager_run_everywhere_and_say_what_they_cost(importable):
    importable(set())
    for device in ("cpu", "cuda", "npu"):
        for name in ("sdpa", "eager"):
            impl, reason = pick(name, device, dtype="bfloat16")
            assert impl == name and "block-causal" in reason
    assert "L*L bytes" in pick("sdpa", "cuda")[1] and "L*L*itemsize bytes" in pick("eager", "npu")[1]


@pytest.mark.unit
def test_unknown_names_and_devices(importable):
    importable(set())
    with pytest.raises(ValueError, match="unknown attention implementation"):
        pick("flash_attn", "cuda")
    with pytest.raises(ValueError, match="unknown device type"):
        pick("auto", "tpu")
