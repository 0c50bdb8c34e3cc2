"""ColocateRollout with image prompts: a tiny random Qwen3-VL (and Qwen2.5-VL) in real vLLM under
torchrun (gloo, fp32) against transformers' forward of the same weights and the same HF processor.

One 2-rank torchrun launch (tests/workers/vl_rollout_worker.py), held by a module-scoped fixture,
runs each layout in turn: two data-parallel engines (tp=1), then one engine sharded over both ranks
(tp=2); in each, a second engine on a tiny Qwen2.5-VL follows the Qwen3-VL one (the family-dependent
checks: log-probs, expansion, vision-weight push). (A world of one rank, once a layout here, is
the one-rank training run of tests/test_vl_e2e.py.)
The tests assert on what the ranks measured, so every property fails with its own message. The
``unit`` tests check the pure helpers in rlcore/rollout/checks.py and the engine keywords
against the fake vLLM of tests/test_rollout_accel.py.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

import test_rollout_accel as accel
from conftest import REPO, run_torchrun
from rlcore.rollout import checks as rc, settings as rs
from test_rollout_accel import fake_vllm  # noqa: F401  (the fixture, for the unit test at the end)

WORKER = os.path.join(REPO, "tests", "workers", "vl_rollout_worker.py")
LOGPROB_TOL = 1e-4  # fp32 vLLM vs fp32 transformers; measured ~5e-7
LAYOUTS = {"dp2": 1, "tp2": 2}  # name: tensor_parallel_size, on the launch's 2 ranks, in this order


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    import rlcore.demo.vl as vl

    return vl.make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def vl25_model(tmp_path_factory) -> str:
    """A tiny Qwen2.5-VL in the released checkpoints' layout (``visual.*``, ``model.layers.*``),
    which vLLM loads through its mapper (vllm 0.32.0 model_executor/models/qwen2_5_vl.py:1313-1322)."""
    import rlcore.demo.vl as vl

    return vl.make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl25")), family="qwen2_5_vl", original_layout=True)


@pytest.fixture(scope="module")
def launch(vl_model, vl25_model, tmp_path_factory) -> dict:
    """One 2-rank launch runs every layout in turn (each engine torn down before the next), Qwen3-VL
    then Qwen2.5-VL in each. It starts from an empty vLLM cache folder, so vLLM inspects each model
    in its registry subprocess (the path that needs the torchvision shim there too) on the first
    layout, and reads the cache on the second."""
    out = tmp_path_factory.mktemp("vl_rollout") / "result.json"
    cache = tmp_path_factory.mktemp("vllm_cache_cold")
    proc = run_torchrun(WORKER, 2, vl_model, str(out), ",".join(str(tp) for tp in LAYOUTS.values()), vl25_model,
                        env={"VLLM_CACHE_ROOT": str(cache)})
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(zip(LAYOUTS, json.loads(out.read_text())))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, launch) -> dict:
    """One layout's per-rank results."""
    result = dict(launch[request.param], layout=request.param)
    print(json.dumps([{k: v for k, v in r.items() if k not in ("samples", "qwen25")} for r in result["ranks"]]))
    return result


def test_engine_settings(run):
    """limit_mm_per_prompt reaches vLLM; the processed-image cache is off for a multimodal model."""
    for r in run["ranks"]:
        e = r["engine"]
        assert e["multimodal"] and e["image_token_id"] == 7
        assert e["limits"] == {"image": 2, "video": 0}
        assert e["mm_processor_cache_gb"] == 0.0
        assert e["tp"] == run["tp"]
        assert "images/prompt<=2" in e["describe"] and "mm_processor_cache_gb=0" in e["describe"]


def test_cold_model_info_cache(launch):
    """vLLM inspects a model class it has not seen in a fresh interpreter; with the shim there too
    the build succeeds and leaves the class's model info in the cache folder (the first layout, for
    Qwen3-VL then Qwen2.5-VL); the second layout finds both there."""
    first, second = (launch[name]["ranks"][0] for name in LAYOUTS)
    for m in (first, first["qwen25"]):
        assert not m["modelinfo_cached_before"] and m["modelinfo_cached_after"]
    for m in (second, second["qwen25"]):
        assert m["modelinfo_cached_before"] and m["modelinfo_cached_after"]


def test_logprobs_match_transformers(run):
    """Sampled-token logprobs (T=1) of 1-image, 2-image and text prompts in one call."""
    for r in run["ranks"]:
        assert r["n_per_prompt"] == [2, 2, 2, 2]
        assert r["lp_diff"] < LOGPROB_TOL, f"image prompts: {r['lp_diff']:.2e}"
        assert r["lp_diff_two_images"] < LOGPROB_TOL, f"2-image prompt: {r['lp_diff_two_images']:.2e}"
        assert r["lp_diff_text"] < LOGPROB_TOL, f"text prompt: {r['lp_diff_text']:.2e}"


def test_prompt_ids_are_expanded_like_the_trainer(run):
    """vLLM's RequestOutput.prompt_token_ids is the expanded prompt (one <|image_pad|> per merged
    patch), equal to the expansion by grid_thw.prod() // merge_size**2 of the HF processor."""
    for r in run["ranks"]:
        assert r["image_tokens"] == [9, 9, 18, 0]  # 96x96: (6*6 patches) / 2**2
        assert [v - s for v, s in zip(r["vllm_prompt_lens"], r["sent_prompt_lens"])] == [8, 8, 16, 0]
        assert r["expansion_equal"], "vLLM's expanded prompt differs from the processor-based expansion"
        if isinstance(r["rlcore_vision_expansion_equal"], bool):  # rlcore.task.images, when importable
            assert r["rlcore_vision_expansion_equal"], "rlcore.task.images.VisionProcessor.prepare differs from vLLM"


def test_one_pixel_reaches_the_engine(run):
    """One pixel changed: vLLM matches transformers on the new image, and is far from the old one."""
    for r in run["ranks"]:
        assert r["pixel_lp_diff"] < LOGPROB_TOL, f"{r['pixel_lp_diff']:.2e}"
        assert r["pixel_shift_hf"] > 2 * LOGPROB_TOL, f"one pixel moved logprobs by only {r['pixel_shift_hf']:.2e}"
        if r["pixel_same_tokens"]:
            assert r["pixel_shift_vllm"] > 2 * LOGPROB_TOL, r["pixel_shift_vllm"]


def test_vision_weight_sync(run):
    """Perturbed model.visual.* pushed with the full HF-named set: vLLM follows (the same images,
    so stale encoder-cache entries would show); the original weights pushed back: the first
    samples come back exactly."""
    for r in run["ranks"]:
        assert r["pushed"] == 64 and r["perturbed"] == r["pushed_visual_names"] == 39
        assert r["vllm_params_missed"] == [], "HF names that vLLM's loader did not map onto its parameters"
        assert r["lp_shift_vision"] > 100 * LOGPROB_TOL, "the vision noise barely moved the logprobs"
        assert r["lp_diff_vision_updated"] < LOGPROB_TOL, f"after the push: {r['lp_diff_vision_updated']:.2e}"
        assert r["text_prompt_unchanged"], "a text prompt changed with only the vision tower pushed"
        assert r["lp_diff_restored"] < LOGPROB_TOL, f"after pushing the original back: {r['lp_diff_restored']:.2e}"
        assert r["restored_equals_first"]


def test_encoder_cache_dropped_on_every_path(run):
    """Same images after a reload from the model folder and after release/resume: the first
    samples again (stale image encodings would change them, or fail on the CPU reload path)."""
    for r in run["ranks"]:
        assert r["moved_before_path_reload"], "the pushed vision noise did not change the samples"
        assert r["path_reload_equals_first"], "update_weights_from_path left other weights' image encodings"
        assert r["release_resume_equals_first"]


def test_refusals(run):
    for r in run["ranks"]:
        assert "At most 2 image(s)" in r["over_limit"], r["over_limit"]
        assert r["wrong_placeholders"].startswith("ValueError: prompt 0 holds 1 image tokens"), r["wrong_placeholders"]
        assert r["after_refusals"] == 1


def test_data_parallel_engines_see_their_own_images(run):
    r0, r1 = run["ranks"]
    if run["tp"] == 1:
        assert r0["engine"]["dp_rank"] != r1["engine"]["dp_rank"]
        assert r0["samples"] != r1["samples"], "DP replicas sampled identical completions"
    else:
        assert r0["samples"] == r1["samples"], "TP ranks returned different outputs"


def test_qwen25_vl_logprobs_expansion_and_vision_push(run):
    """Qwen2.5-VL (patch 14, window-attention ViT, M-RoPE [4, 6, 6]) in a second engine of each
    layout, loaded from the released layout (``visual.*``, ``model.layers.*``): sampled log-probs
    equal transformers' on 1-image, 2-image and text prompts; vLLM's expanded prompt equals the
    processor-based one; perturbed vision weights pushed under the module names the policy exports
    (``model.visual.*``, ``model.language_model.*``, ``lm_head``; vLLM's mapper maps both layouts,
    qwen2_5_vl.py:1313-1322) reach every vLLM parameter, move the log-probs and match
    transformers; the originals pushed back give the first samples again."""
    for r in run["ranks"]:
        q = r["qwen25"]
        print(f"{run['layout']} rank {r['rank']}: qwen2.5-vl lp_diff {q['lp_diff']:.2e} (2 images "
              f"{q['lp_diff_two_images']:.2e}, text {q['lp_diff_text']:.2e}), after the vision push "
              f"{q['lp_diff_vision_updated']:.2e} (moved {q['lp_shift_vision']:.2e}), restored {q['lp_diff_restored']:.2e}; "
              f"engine {q['init_s']:.1f} s, all {q['total_s']:.1f} s")
        assert q["model_type"] == "qwen2_5_vl" and q["image_token_id"] == 7
        assert q["n_per_prompt"] == [2, 2, 2, 2]
        assert q["lp_diff"] < LOGPROB_TOL and q["lp_diff_two_images"] < LOGPROB_TOL and q["lp_diff_text"] < LOGPROB_TOL
        assert q["image_tokens"] == [9, 9, 18, 0]  # 96x96 -> 84x84: (6*6 patches) / 2**2
        assert q["expansion_equal"] and q["rlcore_vision_expansion_equal"] is True
        assert q["pushed_names"] == ["lm_head.weight", "model.language_model", "model.visual"]
        assert q["pushed"] == 57 and q["perturbed"] == q["pushed_visual_names"] == 30
        assert q["vllm_params_missed"] == []
        assert q["lp_shift_vision"] > 100 * LOGPROB_TOL and q["lp_diff_vision_updated"] < LOGPROB_TOL
        assert q["text_prompt_unchanged"]
        assert q["lp_diff_restored"] < LOGPROB_TOL and q["restored_equals_first"]
    if run["tp"] == 2:
        assert run["ranks"][0]["qwen25"]["samples"] == run["ranks"][1]["qwen25"]["samples"]


# ----------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_multimodal_kwargs_only_for_multimodal_or_when_asked():
    assert rs.multimodal_kwargs(False) == {}
    assert rs.multimodal_kwargs(True) == {"mm_processor_cache_gb": 0.0}
    assert rs.multimodal_kwargs(True, limit_mm_per_prompt={"image": 2, "video": 0}, mm_processor_cache_gb=1) == {
        "limit_mm_per_prompt": {"image": 2, "video": 0}, "mm_processor_cache_gb": 1.0}
    assert rs.multimodal_kwargs(False, limit_mm_per_prompt={"image": 1}) == {"limit_mm_per_prompt": {"image": 1}}
    for bad in ({"image": -1}, {"image": 1.5}, {"image": True}, {3: 1}):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            rs.multimodal_kwargs(True, limit_mm_per_prompt=bad)
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        rs.multimodal_kwargs(True, mm_processor_cache_gb=-1)


@pytest.mark.unit
def test_multimodal_config_detection():
    assert rs.is_multimodal_config({"model_type": "qwen3_vl", "vision_config": {"depth": 2}})
    assert rs.is_multimodal_config({"audio_config": {}})
    assert not rs.is_multimodal_config({"model_type": "qwen3"})
    assert not rs.is_multimodal_config({})
    ns = types.SimpleNamespace
    assert rc.image_token_id(ns(image_token_id=7)) == 7
    assert rc.image_token_id(ns(image_token_index=32000)) == 32000
    assert rc.image_token_id(ns()) is None and rc.image_token_id(None) is None


@pytest.mark.unit
def test_prompt_images_checked():
    pad, im = 7, object()
    rc.check_prompt_images([[1, pad, 2], [1, 2]], None, pad)
    rc.check_prompt_images([[1, pad, 2], [1, 2], [pad, pad]], [[im], None, [im, im]], pad)
    rc.check_prompt_images([[1, 2]], [[]], pad)  # an empty list is a text prompt
    rc.check_prompt_images([[1, 2]], [None], None)  # text model, no images
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        rc.check_prompt_images([[1]], [None, None], pad)
    with pytest.raises(ValueError, match="holds 1 image tokens .* for 2 images"):
        rc.check_prompt_images([[1, pad]], [[im, im]], pad)
    with pytest.raises(ValueError, match="holds 9 image tokens .* pass the unexpanded prompt"):
        rc.check_prompt_images([[1] + [pad] * 9], [[im]], pad)
    with pytest.raises(ValueError, match="holds 1 image tokens .* for 0 images"):
        rc.check_prompt_images([[1, pad]], [None], pad)
    with pytest.raises(ValueError, match="the model takes none"):
        rc.check_prompt_images([[1]], [[im]], None)


def test_registry_subprocess_runs_the_shim_first(tmp_path):
    import subprocess

    from rlcore.colocate_rollout import _PACKAGE_ROOT

    assert os.path.samefile(_PACKAGE_ROOT, REPO)  # what the engine hands the registry subprocess: the checkout
    registry = types.SimpleNamespace(_SUBPROCESS_COMMAND=[sys.executable, "-m", "some.module"])
    with rc.registry_subprocess_with_shim(registry, False, REPO):
        assert registry._SUBPROCESS_COMMAND == [sys.executable, "-m", "some.module"]  # shim not needed
    with rc.registry_subprocess_with_shim(registry, True, REPO):
        cmd = registry._SUBPROCESS_COMMAND
        assert cmd[:2] == [sys.executable, "-c"] and "import rlcore" in cmd[2] and "'some.module'" in cmd[2]
    assert registry._SUBPROCESS_COMMAND == [sys.executable, "-m", "some.module"]  # restored
    with rc.registry_subprocess_with_shim(None, True, REPO):  # no registry module: nothing to do
        pass
    assert rc.registry_subprocess_command(["python", "script.py"], REPO) is None
    # The command works from any directory: it runs the module as __main__ after importing rlcore.
    mod = tmp_path / "probe_mod.py"
    mod.write_text("import sys\nif __name__ == '__main__':\n    print('torchvision' in sys.modules or 'ok', "
                   "sys.modules['rlcore'].__name__)\n")
    cmd = rc.registry_subprocess_command([sys.executable, "-m", "probe_mod"], REPO)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok", "rlcore"], out.stderr[-2000:]


@pytest.mark.unit
def test_registry_command_form_of_installed_vllm():
    """The installed vLLM's registry command has the form the shim rewrites (else the rollout
    warns and a cold model-info cache may fail on a CPU host)."""
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    assert rc.registry_subprocess_command(list(registry._SUBPROCESS_COMMAND), REPO) is not None, \
        registry._SUBPROCESS_COMMAND


@pytest.mark.unit
def test_encoder_cache_reset_required_for_multimodal():
    rc.check_encoder_cache_reset(object(), multimodal=False)
    rc.check_encoder_cache_reset(types.SimpleNamespace(reset_encoder_cache=lambda: None), multimodal=True)
    with pytest.raises(RuntimeError, match="reset_encoder_cache"):
        rc.check_encoder_cache_reset(object(), multimodal=True)


@pytest.mark.unit
def test_engine_kwargs_for_text_and_vl_folders(fake_vllm, tmp_path, monkeypatch):
    """Through ColocateRollout with the fake vLLM of tests/test_rollout_accel.py: a folder whose
    config.json has a vision_config gets the cache turned off and the limits; a text folder gets
    no multimodal keyword at all (its engine is built as before)."""
    import dataclasses

    import rlcore.colocate_rollout as cr
    from rlcore.dist import DistInfo

    mm_keys = ["limit_mm_per_prompt", "mm_processor_cache_gb"]  # vllm 0.32.0 engine/arg_utils.py:634, :643
    monkeypatch.setattr(sys.modules["vllm.engine.arg_utils"], "EngineArgs", dataclasses.make_dataclass(
        "EngineArgs", [(k, object, None) for k in accel.ENGINE_ARGS + mm_keys]))
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device_type="cpu", backend="gloo")
    text, vl = tmp_path / "text", tmp_path / "vl"
    for folder, config in ((text, {"model_type": "qwen3"}), (vl, {"model_type": "qwen3_vl", "vision_config": {}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    cr.ColocateRollout(str(text), info)
    assert not set(mm_keys) & set(accel.FakeLLM.built[-1])
    cr.ColocateRollout(str(vl), info, limit_mm_per_prompt={"image": 2, "video": 0})
    built = accel.FakeLLM.built[-1]
    assert built["mm_processor_cache_gb"] == 0.0 and built["limit_mm_per_prompt"] == {"image": 2, "video": 0}
