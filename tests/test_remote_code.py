"""model.trust_remote_code: a model folder with its own modeling code (rlcore/engine/remote_code.py), built from
rlcore/demo/custom_code.py (a Qwen3 whose base model scales its input embeddings by a config value only
that code reads)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, run_torchrun
from test_e2e import read_metrics, train_args


@pytest.fixture(scope="session")
def custom_model(tmp_path_factory) -> str:
    from rlcore.demo.custom_code import make_tiny_custom_model

    return make_tiny_custom_model(str(tmp_path_factory.mktemp("tiny_custom_model")))


@pytest.mark.unit
def test_refusal_names_key_folder_entries_and_fix(custom_model, tiny_model):
    from rlcore.engine.remote_code import refusal

    off = refusal(custom_model, "model.path", False, policy=True)
    for part in ("model.path", custom_model, "AutoModelForCausalLM: modeling_tiny_custom.TinyCustomForCausalLM",
                 "set model.trust_remote_code: true"):
        assert part in off, off
    assert refusal(custom_model, "model.path", True, policy=True) is None
    assert refusal(tiny_model, "model.path", False, policy=True) is None  # no auto_map: nothing to trust
    judge = refusal(custom_model, "reward.models.path", True, policy=False)
    assert "reward.models.path" in judge and "policy only" in judge


@pytest.mark.unit
def test_refusal_needs_both_model_classes(custom_model, tmp_path):
    import shutil

    from rlcore.engine.remote_code import refusal

    folder = shutil.copytree(custom_model, str(tmp_path / "m"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    del config["auto_map"]["AutoModel"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    assert "lacks AutoModel" in refusal(folder, "model.path", True, policy=True)


def test_off_exits_2_before_any_model_loads(custom_model, toy_data, tmp_path, capsys):
    """Preflight refuses the folder with the key off: exit 2 from what train_grpo.main runs before
    its first engine (parse_config, then preflight), one paragraph naming the key and auto_map."""
    from test_bad_inputs import checks_exit_code

    code = checks_exit_code(train_args(custom_model, toy_data[0], str(tmp_path / "run"), 1), 1)
    err = capsys.readouterr().err
    assert code == 2 and "model.trust_remote_code is false" in err and "auto_map" in err, err
    assert err.startswith("error: ") and "Traceback" not in err


def test_on_trains_and_vllm_matches_the_trainer(custom_model, toy_data, tmp_path):
    """On: VeOmni builds the folder's class, vLLM runs it through its Transformers backend, two GRPO
    steps run, and vLLM's sampled-token log-probs equal the trainer's (rollout/mismatch_*, fp32) with the
    sync check on."""
    out = str(tmp_path / "run")
    run_torchrun(os.path.join(REPO, "train_grpo.py"), 1,
                 *train_args(custom_model, toy_data[0], out, 2, "--model.trust_remote_code", "true",
                             "--rollout.check_sync", "strict"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    print("trust_remote_code run:", [(r["rollout/mismatch_max"], r["rollout/mismatch_kl"],
                                      r.get("rollout/sync_probe_max"), r["actor/grad_norm"]) for r in rows])
    assert all(r["rollout/mismatch_max"] < 1e-3 and 0 <= r["rollout/mismatch_kl"] < 1e-6 for r in rows), rows


def test_veomni_runs_the_folders_code(custom_model, tmp_path):
    """VeOmni's policy log-probs equal transformers' forward with trust_remote_code (1e-5, fp32) and
    differ from plain Qwen3 on the same weights (the custom code ran, not a fallback)."""
    out = str(tmp_path / "policy.json")
    run_torchrun(os.path.join(REPO, "tests", "workers", "remote_code_policy.py"), 1, custom_model, out)
    with open(out) as f:
        got = json.load(f)
    print("trust_remote_code policy:", got)
    assert "TinyCustomForCausalLM" in str(got["class"])
    assert got["vs_custom"] < 1e-5 and got["vs_plain_qwen3"] > 1e-2, got
