"""rlcore.engine.attention.pick_attn_implementation: which kernel runs on packed micro-batches per device.

Nothing in the decision is replaced: each case runs it in a fresh interpreter whose ``sys.path``
holds what a machine would have installed. ``flash-attn-4`` is the real wheel of
requirements-cuda.txt (pure Python; scripts/setup_env.sh installs it with ``--no-deps --target``
into .venv/accel/flash-attn-4): it leaves ``flash_attn`` as an empty namespace package, the trap
that once made ``auto`` choose FlashAttention 2 on every CUDA recipe. FlashAttention 2 and 3 have no
installable wheel here (flash-attn is sdist-only and needs nvcc), and FA4's ``flash_attn.cute``
needs nvidia-cutlass-dsl: for the cases where they import, small on-disk packages expose the entry
points VeOmni imports (veomni/ops/kernels/attention/flash.py:61-83), so the probe still runs a
real import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

FA4_WHEEL = os.path.join(REPO, ".venv", "accel", "flash-attn-4")
ENTRY = "def flash_attn_varlen_func(*args, **kwargs):\n    raise RuntimeError('stand-in: no GPU here')\n"
PROBE = textwrap.dedent("""
    import json, sys, warnings
    sys.path[:0] = json.loads(sys.argv[1])
    from rlcore.engine.attention import pick_attn_implementation
    out = []
    for requested, device, dtype in json.loads(sys.argv[2]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                impl, reason = pick_attn_implementation(requested, device, dtype=dtype)
                out.append({"impl": impl, "reason": reason, "warned": [str(w.message) for w in caught]})
            except ValueError as e:
                out.append({"error": str(e)})
    try:
        import flash_attn
        out.append({"flash_attn_imports": True, "file": getattr(flash_attn, "__file__", None)})
    except ImportError:
        out.append({"flash_attn_imports": False})
    print(json.dumps(out))
""")


def _write(root: str, rel: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
    with open(os.path.join(root, rel), "w") as f:
        f.write(text)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, list[str]]:
    """Named sets of sys.path entries, each one machine's installed kernels."""
    if not os.path.isfile(os.path.join(FA4_WHEEL, "flash_attn", "cute", "__init__.py")):
        pytest.fail(f"{FA4_WHEEL} is missing: run scripts/setup_env.sh (it installs the flash-attn-4 wheel there)")
    root = str(tmp_path_factory.mktemp("kernels"))
    _write(root, "fa2/flash_attn/__init__.py", ENTRY)
    _write(root, "fa3/flash_attn_interface.py", ENTRY)
    _write(root, "fa4/flash_attn/cute/__init__.py", ENTRY)  # flash_attn stays a namespace, as in the wheel
    return {"none": [], "fa4_wheel": [FA4_WHEEL], "fa2": [os.path.join(root, "fa2")],
            "fa3": [os.path.join(root, "fa3")], "fa4": [os.path.join(root, "fa4")],
            "fa2+fa3": [os.path.join(root, "fa2"), os.path.join(root, "fa3")]}


def choose(paths: list[str], *cases: tuple) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(paths), json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_real_flash_attn_4_wheel_never_selects_flash_attention_2(site):
    """Before the entry-point probe, ``import flash_attn`` succeeded here and auto returned
    flash_attention_2, whose first forward failed on every CUDA recipe."""
    auto, fa2, fa4, imports = choose(site["fa4_wheel"], ("auto", "cuda", "bfloat16"),
                                     ("flash_attention_2", "cuda", "bfloat16"), ("flash_attention_4", "cuda", "bfloat16"))
    assert imports["flash_attn_imports"] and imports["file"] is None  # the namespace-package trap is real
    assert auto["impl"] != "flash_attention_2"
    # flash_attn.cute needs nvidia-cutlass-dsl, absent on this CPU machine: dense-mask sdpa, said loudly
    assert auto["impl"] == "sdpa" and "flash_attn.cute" in auto["reason"] and auto["warned"], auto
    assert "flash_attn.flash_attn_varlen_func, which does not import here" in fa2["error"], fa2
    assert "flash-attn-4 with nvidia-cutlass-dsl" in fa4["error"], fa4


@pytest.mark.parametrize("kernels, expected", [
    ("fa2", "flash_attention_2"), ("fa3", "flash_attention_3"), ("fa4", "flash_attention_4"),
    ("fa2+fa3", "flash_attention_2"),
])
def test_auto_on_cuda_takes_the_first_flash_entry_point_that_imports(site, kernels, expected):
    (auto,) = choose(site[kernels], ("auto", "cuda", "bfloat16"))[:1]
    assert auto["impl"] == expected and "over the packed sequences (no L x L mask)" in auto["reason"], auto
    assert not auto["warned"]


def test_auto_on_cpu_is_sdpa_even_with_flash_installed(site):
    (auto,) = choose(site["fa2+fa3"], ("auto", "cpu", None))[:1]
    assert auto["impl"] == "sdpa" and "cpu" in auto["reason"] and not auto["warned"]  # no fallback on CPU


def test_auto_without_flash_or_in_float32_falls_back_to_sdpa_with_a_warning(site):
    none, fp32 = choose(site["none"], ("auto", "cuda", "bfloat16"), ("auto", "cuda", "float32"))[:2]
    assert none["impl"] == "sdpa" and "L*L bytes" in none["reason"] and "install flash-attn-4" in none["reason"]
    assert none["warned"] and "dense (L x L)" in none["warned"][0]
    (fp32_fa2,) = choose(site["fa2"], ("auto", "cuda", "float32"))[:1]
    assert fp32["impl"] == fp32_fa2["impl"] == "sdpa" and "float32" in fp32_fa2["reason"] and fp32_fa2["warned"]


def test_auto_on_npu_uses_the_npu_fusion_attention_path(site):
    (auto,) = choose(site["none"], ("auto", "npu", "bfloat16"))[:1]  # transformers routes FA2 to torch_npu
    assert auto["impl"] == "flash_attention_2" and "npu_fusion_attention" in auto["reason"]


def test_explicit_choices_check_device_package_and_dtype(site):
    results = choose(site["fa2"], ("flash_attention_2", "cpu", None), ("flash_attention_4", "cpu", None),
                     ("flash_attention_2", "cuda", "bfloat16"), ("flash_attention_2", "cuda", None),
                     ("flash_attention_2", "cuda", "float32"), ("flash_attention_3", "npu", "bfloat16"),
                     ("flash_attention_4", "npu", "bfloat16"), ("flash_attention_3", "cuda", "bfloat16"))
    on_cpu, fa4_cpu, ok, ok_untyped, fp32, fa3_npu, fa4_npu, fa3_missing = results[:8]
    assert "auto or sdpa" in on_cpu["error"] and "auto or sdpa" in fa4_cpu["error"]
    assert ok["impl"] == ok_untyped["impl"] == "flash_attention_2"  # dtype unknown: not checked
    assert "model.dtype=bfloat16" in fp32["error"]
    assert "not available on Ascend" in fa3_npu["error"] and "not available on Ascend" in fa4_npu["error"]
    assert "install flash-attn-3" in fa3_missing["error"]


def test_explicit_sdpa_and_eager_run_everywhere_and_say_what_they_cost(site):
    cases = [(name, device, "bfloat16") for device in ("cpu", "cuda", "npu") for name in ("sdpa", "eager")]
    results = choose(site["none"], *cases, ("sdpa", "cuda", None), ("eager", "npu", None))
    for (name, _, _), r in zip(cases, results):
        assert r["impl"] == name and "block-causal" in r["reason"]
    assert "L*L bytes" in results[len(cases)]["reason"] and "L*L*itemsize bytes" in results[len(cases) + 1]["reason"]


def test_unknown_names_and_devices(site):
    name, device = choose(site["none"], ("flash_attn", "cuda", None), ("auto", "tpu", None))[:2]
    assert "unknown attention implementation" in name["error"] and "flash_attention_4" in name["error"]
    assert "unknown device type" in device["error"]


@pytest.mark.unit
def test_the_dry_run_resolves_cuda_for_the_gpu_it_targets():
    """scripts/check_config.py --device cuda on a login node (no GPU, flash-attn-4 not importable here):
    auto resolves flash_attention_4 for an SM90+ GPU with the pinned wheel, says it assumed so, and
    with --pre-hopper probes the other kernels (none here: sdpa); an explicit flash_attention_4 is
    accepted for SM90+ and refused for older GPUs."""
    from rlcore.engine.attention import assume_gpu, pick_attn_implementation

    with assume_gpu("fa4"):
        impl, reason = pick_attn_implementation("auto", "cuda", dtype="bfloat16")
        assert impl == "flash_attention_4" and "assumed for the dry run" in reason and "--pre-hopper" in reason
        assert pick_attn_implementation("flash_attention_4", "cuda", dtype="bfloat16")[0] == "flash_attention_4"
        assert pick_attn_implementation("auto", "npu", dtype="bfloat16")[0] == "flash_attention_2"  # npu unchanged
        assert pick_attn_implementation("auto", "cuda", dtype="float32")[0] == "sdpa"  # fp32 rules flash out
    with assume_gpu("older"), pytest.warns(UserWarning, match="dense"):
        assert pick_attn_implementation("auto", "cuda", dtype="bfloat16")[0] == "sdpa"
    with assume_gpu("older"), pytest.raises(ValueError, match="Hopper/Blackwell.*--pre-hopper"):
        pick_attn_implementation("flash_attention_4", "cuda", dtype="bfloat16")
    with pytest.raises(ValueError, match="use 'fa4'"):
        with assume_gpu("sm80"):
            pass
