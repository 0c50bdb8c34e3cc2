"""scripts/from_verl.py's conversions of verl's own scripts (the 16 of tests/fixtures/verl/*.sh; every
example's parse and resolve is tests/test_verl_examples.py's) through the device dry run
(scripts/check_config.py: VeOmni's validation, vLLM's create_engine_config, the memory plan), in one
interpreter as tests/test_check_config.py runs its configs. Not a unit test: it imports vLLM."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from conftest import REPO
from test_from_verl import convert

FIXTURES = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "verl", "*.sh")))


STAND_INS = {"vl": "qwen3_vl_8b", "vl_30b": "qwen3_vl_30b_a3b", "moe": "qwen3_30b_a3b", "dense": "qwen3_8b"}


def stand_in_for(name: str) -> str:
    """The config.json stand-in of the script's model family (tests/fixtures/<model>/config.json)."""
    if "vl" in name:
        return STAND_INS["vl_30b"] if "30b" in name else STAND_INS["vl"]
    return STAND_INS["moe"] if ("30b_a3b" in name or "30b_veomni" in name) else STAND_INS["dense"]


def reward_stand_ins(tmp_path, name: str, out: str) -> list[str]:
    """What the dry run rightly refuses because it is not on this machine, as the model is: a
    converted reward_model section names verl's hub id (Skywork/...), and a custom_reward_function
    path is taken from the folder from_verl.py ran in (the converter says so on stderr). Each reward
    model gets a stand-in score-head folder (Qwen3-8B's config.json as Qwen3ForSequenceClassification,
    empty safetensors, a tokenizer file); a missing reward.fn file a stand-in with its function."""
    import yaml

    from test_check_config import empty_safetensors

    stem = name.replace(".", "_")
    with open(out) as f:
        reward = yaml.safe_load(f).get("reward") or {}
    argv, models = [], reward.get("models") or []
    fn = reward.get("fn")
    if fn and not os.path.isfile(fn.rsplit(":", 1)[0]):
        src = tmp_path / f"{stem}_reward.py"
        src.write_text(f"def {fn.rsplit(':', 1)[1]}(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return 0.0\n")
        argv += ["--reward.fn", f"{src}:{fn.rsplit(':', 1)[1]}"]
    if not models:
        return argv
    for i, entry in enumerate(models):
        folder = tmp_path / f"{name.replace('.', '_')}_rm{i}"
        folder.mkdir()
        with open(os.path.join(REPO, "tests", "fixtures", "qwen3_8b", "config.json")) as f:
            config = json.load(f)
        config.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1)
        (folder / "config.json").write_text(json.dumps(config))
        empty_safetensors(folder / "model.safetensors")
        (folder / "tokenizer_config.json").write_text("{}")
        entry["path"] = str(folder)
    return argv + ["--reward.models", json.dumps(models)]


def test_every_fixture_passes_the_dry_run_for_its_device(tmp_path, capsys, monkeypatch):
    """scripts/check_config.py's dry run (rlcore/run/dry_run.py: VeOmni's validation, vLLM's
    create_engine_config, the memory plan) of each converted script, for the device and the ranks the
    launch line names, on the config.json stand-ins test_check_config.py uses (empty safetensors,
    empty data files). Every check but the memory plan passes; the memory plan is the stand-in's
    (Qwen3-8B for every dense script, whatever its own model), so it is printed, not asserted."""
    from test_check_config import RUNNER, stand_in

    monkeypatch.setenv("HOME", "/home/user")
    cases, names = [], []
    for path in FIXTURES:
        name = os.path.basename(path)
        out = str(tmp_path / f"{name}.yaml")
        device = "npu" if "npu" in name else "cuda"
        rc, _, err = convert([path, "--allow-unmapped", "--device", device, "-o", out], capsys)
        assert rc == 0, err
        m = re.search(r"--device (\w+) --nproc (\d+) --nnodes (\d+)", err)
        argv = ["--config", out, *stand_in(tmp_path, name.replace(".", "_"), stand_in_for(name)),
                *reward_stand_ins(tmp_path, name, out)]
        cases.append([argv, m.group(1), int(m.group(2)), int(m.group(3))])
        names.append(name)
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**env, "PYTHONPATH": REPO, "HOME": os.environ.get("HOME", "/root")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["checks"]
    for name, checks in zip(names, results):
        print(f"== {name}\n" + "\n".join(f"{s:<5} {n}: {d[:200]}" for n, s, d in checks))
        failed = [(n, d) for n, s, d in checks if s == "FAIL" and n != "memory"]
        assert not failed, (name, failed)
