"""Every GRPO-family launch script of verl's examples (verl-project/verl 1dda039, examples/**/*.sh
less sft/, generation/ and critic PPO) and of verl-recipe's DAPO and partial-rollout recipes is a
fixture (tests/fixtures/verl/, each with its provenance in its first line). Each converts, or
exits 2 naming only keys with no equivalent here (never a traceback, never another error), as
docs/from_verl.md's table says script by script; every YAML written (--allow-unmapped) passes this
project's parse (unit) and, with the tests' tiny models in place of the script's, the trainer's
parse and its device's resolve (the full suite: it reads model folders).

Each fixture is converted once per session (``converted``, cached) and every test reads that result.

    .venv/bin/python tests/test_verl_examples.py     prints the doc's table from the fixtures
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FIXTURES = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "verl", "**", "*.sh"), recursive=True))
SOURCE = re.compile(r"# Copied unchanged from (https://github.com/(?:verl-project|volcengine)/(verl|verl-recipe)/blob/"
                    r"([0-9a-f]{40})/(\S+))")
# What a script itself demands (${VAR:?...}): the test sets it as a user must
ENV = {"run_kimi_k2_6_glm5_1_megatron_lite.sh": {"MODEL_PATH": "/models/Kimi-K2.6"},
       "run_qwen3_8b_from_adapter_fsdp.sh": {"LORA_ADAPTER_PATH": "/adapters/qwen3_8b_lora"}}
DOC = os.path.join(REPO, "docs", "from_verl.md")
TABLE_HEADING = "## verl's example scripts, one by one"


def source(path: str) -> tuple[str, str]:
    """(the script's path in its repository, its URL) from the fixture's first line."""
    m = SOURCE.match(open(path).readline())
    assert m, f"{path}: no provenance line"
    repo = "" if m.group(2) == "verl" else "verl-recipe: "
    older = "" if m.group(3).startswith(("1dda039", "e7f8895", "48ea0a7")) else f" (@{m.group(3)[:7]})"
    return repo + m.group(4) + older, m.group(1)


@functools.cache
def converted(path: str, allow_unmapped: bool = False) -> tuple[int, str, str, tuple[str, ...]]:
    """from_verl.py in this process with the fixture's environment, once per session: (exit code,
    the YAML it printed, stderr, the keys listed as having no equivalent)."""
    from rlcore.verl.cli import main

    env = {"HOME": "/home/user", **ENV.get(os.path.basename(path), {})}
    saved = {k: os.environ.get(k) for k in [*env, "DEVICE"]}
    os.environ.update(env)
    os.environ.pop("DEVICE", None)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main([path, *(["--allow-unmapped"] if allow_unmapped else [])])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    text = err.getvalue()
    keys = [re.split(r"[=:]", line.strip(), maxsplit=1)[0] for line in text.splitlines() if line.startswith("  ")]
    return rc, out.getvalue(), text, tuple(keys)


def outcome(path: str) -> tuple[str, list[str]]:
    rc, _, err, keys = converted(path)
    assert "Traceback" not in err, err
    if rc == 0:
        return "converts", []
    assert "have no equivalent here" in err and keys, err  # the only exit-2 path the examples may take
    return "exit 2", list(keys)


def markdown_table() -> str:
    lines = [TABLE_HEADING, "", "| script | outcome | keys with no equivalent here |", "| --- | --- | --- |"]
    for path in FIXTURES:
        name, url = source(path)
        result, keys = outcome(path)
        lines.append(f"| [{name}]({url}) | {result} | {', '.join(f'`{k}`' for k in dict.fromkeys(keys))} |")
    return "\n".join(lines) + "\n"


def doc_rows() -> dict[str, tuple[str, list[str]]]:
    text = open(DOC).read().split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| \[([^\]]+)\]\([^)]+\) \| ([^|]+) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), re.findall(r"`([^`]+)`", m.group(3)))
    return rows


@pytest.mark.unit
def test_every_example_is_a_fixture_with_its_source():
    """The 89 scripts of verl 1dda039's examples that launch GRPO-family training (its 109 less sft/,
    generation/, the 3 critic-PPO ones and grpo_trainer/run_deepseek_v4_megatron_lite.sh, which only
    points elsewhere), DAPO's and the partial-rollout recipe's scripts, and 4 older verl examples
    the first conversions were made on."""
    names = [source(p)[0] for p in FIXTURES]
    assert len(set(names)) == len(names)
    examples = [n for n in names if n.startswith("examples/") and "(@" not in n]
    assert len(examples) == 89 and not [n for n in examples if "/sft/" in n or "/generation/" in n]
    assert sum(n.startswith("verl-recipe: dapo/") for n in names) >= 29
    assert sum(n.startswith("verl-recipe: partial_rollout/") for n in names) >= 8


ROWS = doc_rows() if os.path.exists(DOC) and TABLE_HEADING in open(DOC).read() else {}
IDS = [os.path.relpath(p, os.path.join(REPO, "tests", "fixtures", "verl")) for p in FIXTURES]
VERL_FN = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return 0.0\n"


@pytest.mark.unit
@pytest.mark.parametrize("path", FIXTURES, ids=IDS)
def test_each_script_has_the_outcome_the_doc_says(path):
    name, _ = source(path)
    assert name in ROWS, f"docs/from_verl.md's table lacks {name}: run .venv/bin/python tests/test_verl_examples.py"
    result, keys = outcome(path)
    assert (result, list(dict.fromkeys(keys))) == ROWS[name], name


@pytest.mark.unit
def test_the_doc_lists_no_other_script():
    assert set(ROWS) == {source(p)[0] for p in FIXTURES}


def written(path: str, tmp_path) -> dict:
    """The YAML --allow-unmapped writes (every key's comment naming its origin), with a reward.fn
    this machine lacks (verl's examples name files of verl's repository) replaced by a verl-signature
    function in ``tmp_path``."""
    import yaml

    rc, text, err, _ = converted(path, True)
    assert rc == 0, err
    for line in text.splitlines():  # every key written says where it came from
        if re.match(r"\s*\w+: \S", line):
            assert "  # " in line, line
    cfg = yaml.safe_load(text)
    fn = cfg.get("reward", {}).get("fn")
    if fn and not os.path.isfile(fn.rpartition(":")[0]):
        (tmp_path / "reward.py").write_text(VERL_FN)
        cfg["reward"]["fn"] = f"{tmp_path / 'reward.py'}:compute_score"
    return cfg


@pytest.mark.unit
@pytest.mark.parametrize("path", FIXTURES, ids=IDS)
def test_every_yaml_written_passes_the_projects_parse(path, tmp_path):
    """Every section's checks, as the trainer's parse runs them, on the YAML as written (no model
    files read: the full suite's test below adds the resolve)."""
    from rlcore.config import Config
    from rlcore.verl.convert import instantiate

    instantiate(Config, written(path, tmp_path))


def verl_run_folder(path: str) -> str:
    """Where verl itself writes the script's run: its trainer.default_local_dir, else verl's default
    checkpoints/{project_name}/{experiment_name} (verl/trainer/config/ppo_trainer.yaml), read from
    the script's own overrides and verl's defaults (not from the converted YAML)."""
    import argparse

    from rlcore.verl import cli
    from rlcore.verl.defaults import Defaults

    env = {"HOME": "/home/user", **ENV.get(os.path.basename(path), {})}
    saved = {k: os.environ.get(k) for k in [*env, "DEVICE"]}
    os.environ.update(env)
    os.environ.pop("DEVICE", None)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            argv, _, _, _, entry = cli.read_input(argparse.Namespace(script=path, rest=[]))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    values, _, name = cli.split_overrides(argv)
    config = name if name in cli.CONFIG_NAMES else cli.ENTRIES.get(entry, "ppo_trainer")
    d = Defaults(config, {k: v for k, (v, _) in values.items()})  # resolves verl's ${trainer.project_name}/...
    return d.value("trainer.default_local_dir") or \
        f"checkpoints/{d.value('trainer.project_name')}/{d.value('trainer.experiment_name')}"  # an empty variable


@pytest.mark.unit
def test_two_converted_scripts_share_a_run_folder_only_where_verl_shares_it():
    """Issue 65: two converted runs of different verl scripts never share a directory. Each
    converted YAML's trainer.output_dir is the folder verl itself writes that script's run to, so
    two scripts share one only where they share it in verl (verl's examples reuse a few project and
    experiment names: their second run then exits 2 at resume, tests/test_verl_e2e.py)."""
    import yaml

    folders = {}
    for path in FIXTURES:
        rc, text, err, _ = converted(path, True)
        output_dir = yaml.safe_load(text)["trainer"]["output_dir"]
        assert output_dir == verl_run_folder(path), path
        folders.setdefault(output_dir, []).append(source(path)[0])
    assert len(folders) >= 120, [names for names in folders.values() if len(names) > 1]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from rlcore.demo.toy import make_tiny_moe_model

    return make_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="module")
def tiny_vl_moe(tmp_path_factory) -> str:
    from workers.vl_moe import make_tiny_vl_moe_model

    return make_tiny_vl_moe_model(str(tmp_path_factory.mktemp("tiny_vl_moe")))


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory) -> str:
    from rlcore.demo.toy import make_tiny_reward_model

    return make_tiny_reward_model(str(tmp_path_factory.mktemp("tiny_reward_model")))


@pytest.mark.parametrize("path", FIXTURES, ids=IDS)
def test_every_yaml_written_passes_the_trainers_parse_and_resolve(path, tmp_path, request, toy_data):
    """--allow-unmapped: the run without the listed keys; with the script's model, reward-model and
    data paths (which do not exist here) replaced by the tests' tiny ones (a vision-language one for
    an image run, a mixture-of-experts one where expert parallelism or routing replay needs experts),
    train_grpo's parse and resolve for the device the script targets accept it."""
    import yaml

    import train_grpo
    from rlcore.run.ownership import release_output_dirs

    cfg = written(path, tmp_path)
    moe = (cfg.get("rollout", {}).get("enable_expert_parallel") or cfg.get("parallel", {}).get("ep_size", 1) > 1
           or cfg["algorithm"].get("routing_replay"))
    name = {(True, True): "tiny_vl_moe", (True, False): "tiny_vl_model", (False, True): "tiny_moe",
            (False, False): "tiny_model"}[bool(cfg["data"].get("image_key")), bool(moe)]
    model = request.getfixturevalue(name)
    for judge in cfg.get("reward", {}).get("models", []):
        judge["path"] = request.getfixturevalue("tiny_reward_model")
    out = str(tmp_path / "cfg.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(cfg, f)
    argv = ["--config", out, "--model.path", model, "--data.train_files", json.dumps([toy_data[0]]),
            "--data.val_files", json.dumps([toy_data[1]]), "--trainer.output_dir", str(tmp_path / "run")]
    if cfg.get("distill", {}).get("teacher"):
        argv += ["--distill.teacher", model]
    if cfg.get("lora", {}).get("path"):
        argv += ["--lora.path", "null"]
    if cfg.get("lora", {}).get("rank", 0) > 8:  # the tiny models' projections are 32 wide
        argv += ["--lora.rank", "8"]
    device = cfg.get("parallel", {}).get("device", "cuda")
    try:
        train_grpo.parse_config(argv, device_type=device)
    finally:
        release_output_dirs()


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
