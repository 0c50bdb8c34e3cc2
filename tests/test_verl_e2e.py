"""A verl user's whole run through the real entry point (2 CPU ranks under torchrun): verl 1dda039's
own launch scripts (tests/fixtures/verl/run_qwen3_8b_fsdp.sh, run_qwen2_5_vl_7b_fsdp.sh) converted
by scripts/from_verl.py in the test, the YAML it writes run as written. What is passed to the
converter is what a verl user passes to a script: its own knobs in the environment
(TRAIN_BATCH_SIZE, ROLLOUT_N, MAX_RESPONSE_LENGTH, ...), HOME (where the script reads
$HOME/data/...), and CPU sizes as the script's arguments (its "$@": vLLM's dtype and TP, the step
count, the logger, the run's folder). No data.* or reward.* key: the converter writes them.
The rows are Parquet files in verl's layout, written where the scripts read them.

  gsm8k    verl's gsm8k + MATH script on gsm8k and MATH rows: 2 steps, and every logged validation
           reward is the scorer of its row's data_source, recomputed here from verl's rules
           (gsm8k.py: the last "#### N" of the last 300 characters; math_reward.py: the last
           \\boxed{} equals the truth), per source in val/{data_source}/reward_mean too;
  resume   the same script converted again with other training rows in the same folder (the
           issue's two scripts in one output_dir): exit 2 before any model loads, naming
           data.train_files and both values; the first run's files untouched;
  custom   the same script with verl's custom_reward_function (path, name, reward_kwargs): every
           validation reward is the user's function of the logged response and its row;
  geo3k    verl's VL script on geo3k rows with images, the tiny Qwen3-VL: images found, verl's
           geo3k scorer (0.9 x accuracy + 0.1 x format) recomputed with mathruler for every sample.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import QUIET_ENV, REPO, run_torchrun
from workers.launch import TRAIN, rank_exit_codes, read_rows

FIX = os.path.join(REPO, "tests", "fixtures", "verl")
GSM8K_SCRIPT, VL_SCRIPT = os.path.join(FIX, "run_qwen3_8b_fsdp.sh"), os.path.join(FIX, "run_qwen2_5_vl_7b_fsdp.sh")
R, REF = "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
# the scripts' own knobs (their user-adjustable variables), set as a verl user sets them
KNOBS = {"TRAIN_BATCH_SIZE": "4", "PPO_MINI_BATCH_SIZE": "4", "ROLLOUT_N": "4", "MAX_RESPONSE_LENGTH": "12",
         "ROLLOUT_TP": "1", "NGPUS_PER_NODE": "2", "TEST_FREQ": "2", "SAVE_FREQ": "2", "DEVICE": "gpu"}
# CPU sizes as the script's "$@": vLLM in float32 (bf16 is ~4x slower on this CPU), 2 steps, no
# wandb, every validation sample kept, the reference in memory
CPU = [R + "dtype=float32", "trainer.total_training_steps=2", "trainer.logger=['console']",
       "trainer.log_val_generations=16", REF + "fsdp_config.param_offload=False"]


def verl_gsm8k(solution: str, truth: str) -> float:
    """verl 1dda039 verl/utils/reward_score/gsm8k.py with its defaults, written out again here."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution[-300:])
    return float(bool(found) and found[-1].replace(",", "").replace("$", "") == truth)


def verl_math(solution: str, truth: str) -> float:
    """verl 1dda039 verl/utils/reward_score/math_reward.py:17-28 on what the tiny model can write
    (words, digits and whole \\boxed{N} tokens): last_boxed_only_string, remove_boxed and is_equiv
    reduce to "the last \\boxed{N} holds the truth"."""
    found = re.findall(r"\\boxed\{(\d+)\}", solution)
    return float(bool(found) and found[-1] == truth)


def verl_geo3k(solution: str, truth: str) -> float:
    """verl 1dda039 verl/utils/reward_score/geo3k.py: mathruler on the last \\boxed{}, the format regex."""
    from mathruler.grader import extract_boxed_content, grade_answer

    fmt = re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", solution, re.DOTALL) is not None
    return 0.9 * float(grade_answer(extract_boxed_content(solution), truth)) + 0.1 * float(fmt)


def convert(script: str, home: str, out_yaml: str, *args: str, env: dict | None = None) -> dict:
    """scripts/from_verl.py on ``script`` in this process, with the knobs and HOME in the environment
    and ``args`` as the script's "$@"; the YAML it wrote."""
    from rlcore.verl.cli import main

    env = {**KNOBS, "HOME": home, **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main([script, "-o", out_yaml, "--", *args])
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert rc == 0, err.getvalue()
    with open(out_yaml) as f:
        return yaml.safe_load(f)


def logged(out: str) -> list[dict]:
    rows = []
    for step in (0, 2):  # trainer.val_before_train (verl's default) and the last step
        with open(os.path.join(out, "val", f"step_{step}.jsonl")) as f:
            rows += [json.loads(line) for line in f]
    return rows


def write_home(home: str, files: dict[str, list]) -> None:
    """``files``: path under $HOME -> rows, written as Parquet where verl's scripts read them."""
    from rlcore.task.convert import write_rows

    for path, rows in files.items():
        os.makedirs(os.path.dirname(os.path.join(home, path)), exist_ok=True)
        write_rows(os.path.join(home, path), rows)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlcore import quiet
    from rlcore.demo import verl_tasks
    from rlcore.demo.verl_tasks import MATH_SOURCE, shapes_rows, sum_rows

    root = tmp_path_factory.mktemp("verl_run")
    with quiet.filtered_output():
        chat = verl_tasks.make_verl_chat_model(str(root / "chat"))
        vl = verl_tasks.make_verl_vl_model(str(root / "vl"))
    homes = {"home": str(root / "home"), "other": str(root / "other_home")}
    write_home(homes["home"], {"data/gsm8k/train.parquet": sum_rows(8, 0, "train"),
                               "data/gsm8k/test.parquet": sum_rows(8, 1, "test"),
                               "data/math/train.parquet": sum_rows(8, 2, "train", MATH_SOURCE),
                               "data/math/test.parquet": sum_rows(8, 3, "test", MATH_SOURCE),
                               "data/geo3k/train.parquet": shapes_rows(8, 0, "train"),
                               "data/geo3k/test.parquet": shapes_rows(8, 1, "test")})
    # other training rows, the same validation rows: a run configured differently in its data only
    write_home(homes["other"], {"data/gsm8k/train.parquet": sum_rows(8, 4, "train"),
                                "data/math/train.parquet": sum_rows(8, 5, "train", MATH_SOURCE)})
    for name in ("gsm8k/test.parquet", "math/test.parquet"):
        os.symlink(os.path.join(homes["home"], "data", name), os.path.join(homes["other"], "data", name))
    (root / "configs").mkdir()
    return {"root": str(root), "configs": str(root / "configs"), "chat": chat, "vl": vl, **homes}


def gsm8k_yaml(assets, name: str, home: str, out: str, *args: str) -> tuple[str, dict]:
    """verl's gsm8k + MATH script converted with the tiny chat model (its MODEL_PATH knob), the run's
    folder ``out`` and ``args`` as more of the script's arguments."""
    path = os.path.join(assets["configs"], f"{name}.yaml")
    cfg = convert(GSM8K_SCRIPT, home, path, *CPU, f"trainer.default_local_dir={out}", *args,
                  env={"MODEL_PATH": assets["chat"]})
    return path, cfg


@pytest.fixture(scope="module")
def gsm8k_run(assets):
    cfg_path, cfg = gsm8k_yaml(assets, "gsm8k", assets["home"], os.path.join(assets["root"], "gsm8k_out"))
    assert cfg["reward"] == {"components": {"verl": 1.0}} and cfg["data"]["answer_key"] == "reward_model.ground_truth"
    proc = run_torchrun(TRAIN, 2, "--config", cfg_path)
    return cfg["trainer"]["output_dir"], proc


def test_verl_gsm8k_run_scores_each_source_with_verls_scorer(assets, gsm8k_run):
    out, proc = gsm8k_run
    assert ("read with data.answer_key=reward_model.ground_truth, data.apply_chat_template=true; reward: verl's scorer "
            "by data_source: DigitalLearningGmbH/MATH-lighteval (8 rows), openai/gsm8k (8 rows)") in proc.stdout, \
        proc.stdout[-3000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows if "reward/verl" in r] == [1, 2]
    samples = logged(out)
    assert len(samples) == 32 and all(s["prompt"].startswith("user tom has") for s in samples)
    score = {"openai/gsm8k": verl_gsm8k, "DigitalLearningGmbH/MATH-lighteval": verl_math}
    assert [s["reward"] for s in samples] == [score[s["data_source"]](s["response"], s["answer"]) for s in samples]
    assert {s["reward"] for s in samples} == {0.0, 1.0}, [s["response"] for s in samples]  # right and wrong answers
    assert all(s["correct"] == (s["reward"] == 1.0) for s in samples)
    for step in (0, 2):  # per source as verl's val-core/{data_source}/reward/mean@1
        val = next(r for r in rows if r["step"] == step and "val/reward_mean" in r)
        for source in score:
            mine = [s["reward"] for s in samples if s["step"] == step and s["data_source"] == source]
            assert len(mine) == 8 and val[f"val/{source}/reward_mean"] == pytest.approx(sum(mine) / 8, abs=1e-12)
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_2")) and os.path.isdir(os.path.join(out, "hf_final"))


def test_a_differently_configured_run_does_not_resume_the_first(assets, gsm8k_run):
    """The issue's case: a second converted run in the same folder resumed the first run's
    checkpoint, trained nothing and overwrote its hf_final. Now: exit 2 on every rank, naming the key."""
    out, _ = gsm8k_run
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in ("metrics.jsonl", "hf_final")}
    cfg_path, cfg = gsm8k_yaml(assets, "other_rows", assets["other"], out)
    assert cfg["trainer"]["output_dir"] == out
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, "--config",
           cfg_path]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=300)
    assert set(rank_exit_codes(proc.stderr).values()) == {2}, proc.stderr[-3000:]
    expected = ("but that run was configured differently in 1 key(s) that change what is trained: data.train_files: "
                f'["{assets["home"]}/data/gsm8k/train.parquet", ')  # both values, each cut short in the message
    assert expected in proc.stderr and f'there, ["{assets["other"]}/data/gsm8k/train.parquet", ' in proc.stderr
    assert "checkpoint.resume_config_mismatch: accept" in proc.stderr, proc.stderr[-3000:]
    assert f'File "{os.path.join(REPO, "rlcore")}' not in proc.stderr  # torchrun's own report only, no rank traceback
    assert "resumed from" not in proc.stdout
    assert before == {f: os.path.getmtime(os.path.join(out, f)) for f in ("metrics.jsonl", "hf_final")}


CUSTOM = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, hashes_bonus=0.0):
        """A verl custom_reward_function: right answer after ####, a bonus for trying the format."""
        assert data_source in ("openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"), data_source
        assert extra_info["num_turns"] == 2, extra_info
        words = solution_str.split()
        right = f"#### {ground_truth}" in solution_str
        return {"score": float(right) + hashes_bonus * solution_str.count("####") + 0.01 * extra_info["index"],
                "acc": right, "words": len(words)}
''')


def test_verl_custom_reward_function_runs_unchanged_on_verl_rows(assets):
    """verl's custom_reward_function.path/name/reward_kwargs as the script's arguments: the converter
    writes reward.fn and reward.fn_kwargs, and the user's compute_score gets each row's data_source,
    ground truth and extra_info, plus reward_kwargs."""
    from rlcore.demo.verl_tasks import MATH_SOURCE, sum_rows
    from rlcore.task.verl_rows import from_verl_row  # the logged samples' rows, by index

    fn = os.path.join(assets["root"], "my_reward.py")
    with open(fn, "w") as f:
        f.write(CUSTOM)
    out = os.path.join(assets["root"], "custom_out")
    cfg_path, cfg = gsm8k_yaml(assets, "custom", assets["home"], out, f"custom_reward_function.path={fn}",
                               "custom_reward_function.name=compute_score",
                               "+custom_reward_function.reward_kwargs.hashes_bonus=0.5")
    assert cfg["reward"] == {"fn": f"{fn}:compute_score", "fn_kwargs": {"hashes_bonus": 0.5},
                             "components": {"custom": 1.0}}
    proc = run_torchrun(TRAIN, 2, "--config", cfg_path)
    assert "reward: reward.components={'custom': 1.0}" in proc.stdout, proc.stdout[-3000:]
    val_rows = {"openai/gsm8k": [from_verl_row(r) for r in sum_rows(8, 1, "test")],
                MATH_SOURCE: [from_verl_row(r) for r in sum_rows(8, 3, "test", MATH_SOURCE)]}
    samples = logged(out)
    assert len(samples) == 32
    for s in samples:
        row = val_rows[s["data_source"]][s["index"] % 8]  # validation holds gsm8k's 8 rows, then MATH's
        right = f"#### {row['answer']}" in s["response"]
        want = float(right) + 0.5 * s["response"].count("####") + 0.01 * row["extra_info"]["index"]
        assert s["reward"] == pytest.approx(want, abs=1e-12) and s["correct"] == right, s
    rows = read_rows(out)
    assert all(r.get("reward/errors", 0) == 0 and r.get("val/errors", 0) == 0 for r in rows), rows


def test_verl_geo3k_run_with_images_scores_with_verls_geo3k_scorer(assets):
    """verl's VL script on geo3k rows: images found in verl's rows, the tiny Qwen3-VL trains 2 steps,
    every validation reward is verl's geo3k score."""
    out = os.path.join(assets["root"], "geo3k_out")
    cfg_path = os.path.join(assets["configs"], "geo3k.yaml")
    cfg = convert(VL_SCRIPT, assets["home"], cfg_path, *CPU, f"trainer.default_local_dir={out}",
                  env={"MODEL_PATH": assets["vl"]})
    assert cfg["data"]["image_key"] == "images" and cfg["reward"] == {"components": {"verl": 1.0}}
    proc = run_torchrun(TRAIN, 2, "--config", cfg_path)
    assert ("data.apply_chat_template=true, data.image_key=images; reward: verl's scorer by data_source: "
            "hiyouga/geometry3k (8 rows)") in proc.stdout, proc.stdout[-3000:]
    assert "train data: 8 prompts with 8 images" in proc.stdout
    samples = logged(out)
    assert len(samples) == 16 and {s["data_source"] for s in samples} == {"hiyouga/geometry3k"}
    assert [s["reward"] for s in samples] == pytest.approx([verl_geo3k(s["response"], s["answer"]) for s in samples],
                                                           abs=1e-12)
    assert any(s["reward"] > 0 for s in samples), [s["response"] for s in samples]
    assert [r["step"] for r in read_rows(out) if "reward/verl" in r] == [1, 2]
