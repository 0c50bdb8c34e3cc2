"""A verl user's whole run through the real entry point (2 CPU ranks under torchrun): verl's converted
launch script (tests/fixtures/verl_run/: the converter's YAML for verl's run_qwen3_8b_fsdp.sh and
run_qwen2_5_vl-7b.sh) with CPU-size overrides only, on Parquet rows written in verl's layout.

  gsm8k    the YAML as the converter writes it (data keys, reward.components {verl: 1.0}): 2 steps, and
           every logged validation reward is verl's GSM8K score of the logged response, recomputed here
           from verl's rule (gsm8k.py: the last "#### N" of the last 300 characters equals the truth);
  resume   the same output_dir, the training files changed (the issue's run_qwen2-7b.sh then
           run_qwen2-7b_math.sh): exit 2 before any model loads, naming data.train_files and both
           values; the first run's files untouched;
  custom   the YAML without the converter's data and reward keys (verl's rows recognised from the
           file) and verl's custom_reward_function as reward.fn + reward.fn_kwargs: every validation
           reward is the user's function of the logged response and its row;
  geo3k    the VL script's YAML without data and reward keys on geo3k rows with images, the tiny
           Qwen3-VL: images found, verl's geo3k scorer (0.9 x accuracy + 0.1 x format) recomputed
           with mathruler for every validation sample.
"""

from __future__ import annotations

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

FIXTURES = os.path.join(REPO, "tests", "fixtures", "verl_run")
CPU = ["--parallel.device", "cpu", "--model.dtype", "float32", "--rollout.tensor_parallel_size", "1",
       "--rollout.kv_cache_gb", "0.125", "--rollout.n", "4", "--rollout.max_response_length", "12",
       "--rollout.max_model_len", "1040", "--trainer.prompts_per_step", "4", "--trainer.total_epochs", "null",
       "--trainer.total_steps", "2", "--trainer.val_every", "2", "--val.num_examples", "16",
       "--algorithm.mini_batches", "1", "--logging.trackers", "[]", "--offload.ref", "false"]
VERL_KEYS = {"data": ("prompt_key", "answer_key", "apply_chat_template", "image_key"), "reward": ("components",)}


def verl_gsm8k(solution: str, truth: str) -> float:
    """verl 1dda039 verl/utils/reward_score/gsm8k.py with its defaults, written out again here."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution[-300:])
    return float(bool(found) and found[-1].replace(",", "").replace("$", "") == truth)


def verl_geo3k(solution: str, truth: str) -> float:
    """verl 1dda039 verl/utils/reward_score/geo3k.py: mathruler on the last \\boxed{}, the format regex."""
    from mathruler.grader import extract_boxed_content, grade_answer

    fmt = re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", solution, re.DOTALL) is not None
    return 0.9 * float(grade_answer(extract_boxed_content(solution), truth)) + 0.1 * float(fmt)


def config(root, fixture: str, train: str, val: str, strip_verl_keys: bool = False, **reward) -> str:
    """The fixture YAML with the test's data files (where the converter wrote ~/data/...), without
    the converter's data/reward keys when asked, plus reward keys (a custom function)."""
    with open(os.path.join(FIXTURES, fixture)) as f:
        cfg = yaml.safe_load(f)
    cfg["data"].update(train_files=[train], val_files=[val])
    if strip_verl_keys:
        for section, keys in VERL_KEYS.items():
            for key in keys:
                cfg[section].pop(key, None)
    if reward:
        cfg.setdefault("reward", {}).update(reward)
    path = os.path.join(root, f"{len(os.listdir(root))}_{fixture}")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def logged(out: str) -> list[dict]:
    rows = []
    for step in (0, 2):  # trainer.val_before_train (verl's default) and the last step
        with open(os.path.join(out, "val", f"step_{step}.jsonl")) as f:
            rows += [json.loads(line) for line in f]
    return rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlcore import quiet
    from rlcore.demo import verl_tasks
    from rlcore.task.convert import write_rows

    root = tmp_path_factory.mktemp("verl_run")
    with quiet.filtered_output():
        chat = verl_tasks.make_verl_chat_model(str(root / "chat"))
        vl = verl_tasks.make_verl_vl_model(str(root / "vl"))
    files = {}
    for name, rows in (("gsm8k_train", verl_tasks.sum_rows(8, 0, "train")), ("gsm8k_test", verl_tasks.sum_rows(8, 1, "test")),
                       ("math_train", verl_tasks.sum_rows(8, 2, "train")),
                       ("geo3k_train", verl_tasks.shapes_rows(8, 0, "train")), ("geo3k_test", verl_tasks.shapes_rows(8, 1, "test"))):
        files[name] = str(root / f"{name}.parquet")
        write_rows(files[name], rows)
    (root / "configs").mkdir()
    return {"root": str(root), "configs": str(root / "configs"), "chat": chat, "vl": vl, **files}


@pytest.fixture(scope="module")
def gsm8k_run(assets):
    out = os.path.join(assets["root"], "gsm8k_out")
    cfg = config(assets["configs"], "run_qwen3_8b_fsdp.yaml", assets["gsm8k_train"], assets["gsm8k_test"])
    proc = run_torchrun(TRAIN, 2, "--config", cfg, "--model.path", assets["chat"], "--trainer.output_dir", out, *CPU)
    return out, proc


def test_verl_gsm8k_run_scores_with_verls_gsm8k_scorer(assets, gsm8k_run):
    out, proc = gsm8k_run
    assert ("verl rows: gsm8k_train.parquet (ability, data_source, extra_info, prompt, reward_model) read with "
            "data.answer_key=reward_model.ground_truth, data.apply_chat_template=true; reward: verl's scorer by "
            "data_source: openai/gsm8k (8 rows)") in proc.stdout, proc.stdout[-3000:]
    steps = [r for r in read_rows(out) if "reward/verl" in r]
    assert [r["step"] for r in steps] == [1, 2]
    samples = logged(out)
    assert len(samples) == 16 and all(s["prompt"].startswith("user tom has") for s in samples)
    assert [s["reward"] for s in samples] == [verl_gsm8k(s["response"], s["answer"]) for s in samples]
    assert {s["reward"] for s in samples} == {0.0, 1.0}, [s["response"] for s in samples]  # right and wrong answers
    assert all(s["correct"] == (s["reward"] == 1.0) for s in samples)
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_2")) and os.path.isdir(os.path.join(out, "hf_final"))


def test_a_differently_configured_run_does_not_resume_the_first(assets, gsm8k_run):
    """The issue's case: the second converted script in the same output_dir resumed the first run's
    checkpoint, trained nothing and overwrote its hf_final. Now: exit 2 on every rank, naming the key."""
    out, _ = gsm8k_run
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in ("metrics.jsonl", "hf_final")}
    cfg = config(assets["configs"], "run_qwen3_8b_fsdp.yaml", assets["math_train"], assets["gsm8k_test"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, "--config", cfg,
           "--model.path", assets["chat"], "--trainer.output_dir", out, *CPU]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=300)
    assert set(rank_exit_codes(proc.stderr).values()) == {2}, proc.stderr[-3000:]
    expected = (f"but that run was configured differently in 1 key(s) that change what is trained: data.train_files: "
                f"{json.dumps([assets['gsm8k_train']])} there, {json.dumps([assets['math_train']])} now")
    assert expected in proc.stderr and "checkpoint.resume_config_mismatch: accept" in proc.stderr, proc.stderr[-3000:]
    assert f'File "{os.path.join(REPO, "rlcore")}' not in proc.stderr  # torchrun's own report only, no rank traceback
    assert "resumed from" not in proc.stdout
    assert before == {f: os.path.getmtime(os.path.join(out, f)) for f in ("metrics.jsonl", "hf_final")}


CUSTOM = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, hashes_bonus=0.0):
        """A verl custom_reward_function: right answer after ####, a bonus for trying the format."""
        assert data_source == "openai/gsm8k" and extra_info["num_turns"] == 2, (data_source, extra_info)
        words = solution_str.split()
        right = f"#### {ground_truth}" in solution_str
        return {"score": float(right) + hashes_bonus * solution_str.count("####") + 0.01 * extra_info["index"],
                "acc": right, "words": len(words)}
''')


def test_verl_custom_reward_function_runs_unchanged_on_verl_rows(assets):
    """No data.* or reward.components key: verl's rows are recognised from the file, and the user's
    compute_score gets each row's data_source, ground truth and extra_info, plus reward_kwargs."""
    from rlcore.task.verl_rows import from_verl_row  # the logged samples' rows, by index
    from rlcore.demo.verl_tasks import sum_rows

    fn = os.path.join(assets["root"], "my_reward.py")
    with open(fn, "w") as f:
        f.write(CUSTOM)
    out = os.path.join(assets["root"], "custom_out")
    cfg = config(assets["configs"], "run_qwen3_8b_fsdp.yaml", assets["gsm8k_train"], assets["gsm8k_test"],
                 strip_verl_keys=True, fn=f"{fn}:compute_score", fn_kwargs={"hashes_bonus": 0.5})
    proc = run_torchrun(TRAIN, 2, "--config", cfg, "--model.path", assets["chat"], "--trainer.output_dir", out, *CPU)
    assert "read with data.answer_key=reward_model.ground_truth, data.apply_chat_template=true; reward: " \
           "reward.components={'custom': 1.0}" in proc.stdout, proc.stdout[-3000:]
    val_rows = [from_verl_row(r) for r in sum_rows(8, 1, "test")]
    samples = logged(out)
    for s in samples:
        row = val_rows[s["index"]]
        right = f"#### {row['answer']}" in s["response"]
        want = float(right) + 0.5 * s["response"].count("####") + 0.01 * row["extra_info"]["index"]
        assert s["reward"] == pytest.approx(want, abs=1e-12) and s["correct"] == right, s
    rows = read_rows(out)
    assert all(r.get("reward/errors", 0) == 0 and r.get("val/errors", 0) == 0 for r in rows), rows


def test_verl_geo3k_run_with_images_scores_with_verls_geo3k_scorer(assets):
    """The VL script's YAML without data or reward keys: images found in verl's rows, the tiny
    Qwen3-VL trains 2 steps, every validation reward is verl's geo3k score."""
    out = os.path.join(assets["root"], "geo3k_out")
    cfg = config(assets["configs"], "run_qwen2_5_vl-7b.yaml", assets["geo3k_train"], assets["geo3k_test"],
                 strip_verl_keys=True)
    proc = run_torchrun(TRAIN, 2, "--config", cfg, "--model.path", assets["vl"], "--trainer.output_dir", out, *CPU,
                        "--algorithm.micro_batch_size", "8", "--algorithm.log_prob_micro_batch_size", "8")
    assert ("data.apply_chat_template=true, data.image_key=images; reward: verl's scorer by data_source: "
            "hiyouga/geometry3k (8 rows)") in proc.stdout, proc.stdout[-3000:]
    assert "train data: 8 prompts with 8 images" in proc.stdout
    samples = logged(out)
    assert len(samples) == 16
    assert [s["reward"] for s in samples] == pytest.approx([verl_geo3k(s["response"], s["answer"]) for s in samples],
                                                           abs=1e-12)
    assert any(s["reward"] > 0 for s in samples), [s["response"] for s in samples]
    assert [r["step"] for r in read_rows(out) if "reward/verl" in r] == [1, 2]
