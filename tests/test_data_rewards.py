"""Data files (JSONL, Parquet, chat messages, bad rows), rewards (math-verify, exact, format, weighted
sums, custom functions with errors and timeouts), the data scripts (converters, arithmetic data) and
the reward/validation config checks. No model engine: a real tokenizer, real files, real pyarrow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from conftest import QUIET_ENV, REPO

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = CHATML
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


ROWS = [{"q": "d 1 2 pick 1st =", "meta": {"gt": "1"}}, {"q": "d 3 4 pick 2nd =", "meta": {"gt": "4"}}]


def test_jsonl_and_parquet_give_the_same_prompts(tok, tmp_path):
    from rlcore.config import DataConfig
    from rlcore.task.prompts import load_prompts

    cfg = DataConfig(prompt_key="q", answer_key="meta.gt", max_prompt_length=32)
    files = [write_jsonl(tmp_path / "a.jsonl", ROWS), write_parquet(tmp_path / "b.parquet", ROWS)]
    prompts, stats = load_prompts(files, cfg, tok)
    assert [p.text for p in prompts] == [r["q"] for r in ROWS] * 2
    assert [p.answer for p in prompts] == ["1", "4", "1", "4"]  # dotted key reaches the nested answer
    assert prompts[0].ids == prompts[2].ids == tok(ROWS[0]["q"])["input_ids"]
    assert stats == {"data/bad_rows": 0, "data/filtered_too_long": 0, "data/prompts": 4}


@pytest.mark.unit
def test_chat_messages_and_system_prompt_use_the_chat_template(tok, tmp_path):
    from rlcore.config import ConfigError, DataConfig
    from rlcore.task.prompts import load_prompts

    rows = [{"prompt": [{"role": "user", "content": "d 1 2 pick 1st ="}], "answer": "1"},
            {"prompt": "d 3 4 pick 2nd =", "answer": "4"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DataConfig(apply_chat_template=True, system_prompt="ans", max_prompt_length=64)
    prompts, _ = load_prompts([path], cfg, tok)
    # Rendered by hand from CHATML: a text prompt becomes one user message.
    assert prompts[0].text == "<|system|>ans\n<|user|>d 1 2 pick 1st =\n<|assistant|>"
    assert prompts[1].text == "<|system|>ans\n<|user|>d 3 4 pick 2nd =\n<|assistant|>"
    with pytest.raises(ConfigError, match="apply_chat_template=true"):
        load_prompts([path], DataConfig(max_prompt_length=64), tok)  # messages need the template


@pytest.mark.unit
def test_bad_parquet_row_names_file_and_row_or_is_counted(tok, tmp_path):
    from rlcore.config import ConfigError, DataConfig
    from rlcore.task.prompts import load_prompts

    rows = [{"prompt": "d 1 pick 1st =", "answer": "1"}, {"prompt": "d 2 pick 1st =", "answer": None},
            {"prompt": "d 3 pick 1st =", "answer": "3"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: row 2 lacks key(s) ['answer']")):
        load_prompts([path], DataConfig(), tok)
    prompts, stats = load_prompts([path], DataConfig(skip_bad_rows=True), tok)
    assert [p.answer for p in prompts] == ["1", "3"] and stats["data/bad_rows"] == 1
    bad_msgs = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(ConfigError, match=re.escape(f"{bad_msgs}:1 has a 'prompt' list that is not chat")):
        load_prompts([bad_msgs], DataConfig(apply_chat_template=True), tok)


# ----------------------------------------------------------------------------- rewards

MATH_CASES = [  # (response, gold, expected)
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # numeric equality across forms
    ("so x = 1/2", "\\frac{1}{2}", 1.0),
    ("\\boxed{2}", "\\sqrt{4}", 1.0),  # symbolic
    ("$1 + x^2$", "x^2+1", 1.0),
    ("3 + 5 = 8. Answer: 8", "8", 1.0),  # the final number counts ...
    ("He has 8 apples. Then 12 more.", "8", 0.0),  # ... not an earlier one
    ("\\boxed{3}", "\\frac{1}{2}", 0.0),
    ("eight", "8", 0.0),
    ("so 1234 apples", "1,234", 1.0),
]


@pytest.mark.unit
@pytest.mark.parametrize("response,gold,expected", MATH_CASES)
def test_math_reward(response, gold, expected):
    from rlcore.task.rewards import math_answer

    assert math_answer(response, gold) == expected


LAST_NUMBER_CASES = [  # (response, gold, last_number, math): where they differ is the point
    ("73 + 98", "171", 0.0, 1.0),  # a restated question: math-verify evaluates it, last_number does not
    ("73 + 98 = 171", "171", 1.0, 1.0),
    ("The answer is -48.", "-48", 1.0, 1.0),
    ("so 1,234 apples", "1234", 1.0, 1.0),
    ("3.0", "3", 1.0, 1.0),
    ("48", "-48", 0.0, 0.0),
    ("He has 8 apples. Then 12 more.", "8", 0.0, 0.0),
    ("no number at all", "3", 0.0, 0.0),
]


@pytest.mark.unit
@pytest.mark.parametrize("response,gold,last,symbolic", LAST_NUMBER_CASES)
def test_last_number_reward_does_not_evaluate_expressions(response, gold, last, symbolic):
    from rlcore.task.rewards import last_number, math_answer

    assert last_number(response, gold) == last and math_answer(response, gold) == symbolic


@pytest.mark.unit
def test_weighted_sum_accuracy_and_component_means():
    from rlcore.task.rewards import score_samples

    responses = ["\\boxed{4}", "4", "\\boxed{5}", "<answer>4</answer>"]
    answers = ["4"] * 4
    comps = {"math": 1.0, "format_boxed": 0.25, "exact_match": 2.0}
    totals, correct, m = score_samples(responses, answers, comps)
    math_v, boxed_v, exact_v = [1, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 0]
    assert totals == pytest.approx([a + 0.25 * b + 2 * c for a, b, c in zip(math_v, boxed_v, exact_v)], abs=1e-12)
    assert correct == [False, False, False, False]  # no sample satisfies all three components
    assert m["reward/math"] == 0.75 and m["reward/format_boxed"] == 0.5 and m["reward/exact_match"] == 0.25
    _, correct, m = score_samples(responses, answers, {"math": 1.0, "format_boxed": 0.1})
    assert correct == [True, False, False, False] and m["reward/accuracy"] == 0.25 and m["reward/errors"] == 0


# A custom reward module on disk, loaded by file path and by module name.
CUSTOM_SRC = '''
import time
from rlcore.task.rewards import batched

def strict(response, answer):
    if response == "boom":
        raise RuntimeError("custom reward exploded")
    if response == "slow":
        time.sleep(5)
    if response == "nan":
        return float("nan")
    return float(response == answer)

@batched
def lengths(responses, answers):
    return [len(r) / 10 for r in responses]

@batched
def short(responses, answers):
    return [1.0]
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(path)


def _scorer(**kw):
    from rlcore.config import RewardConfig
    from rlcore.task.rewards import Scorer

    return Scorer(RewardConfig(**kw))


@pytest.mark.unit
def test_custom_reward_by_module_and_file_and_batched(custom_module):
    s = _scorer(fn="my_rewards:strict")
    assert s.components == {"custom": 1.0}
    totals, correct, m = s.score_samples(["7", "8"], ["7", "7"])
    assert totals == [1.0, 0.0] and correct == [True, False] and m["reward/custom"] == 0.5
    s = _scorer(fn=f"{custom_module}:lengths", components={"custom": 0.5, "exact_match": 1.0})
    totals, m = s.score(["abc", "7"], ["x", "7"])
    assert totals == pytest.approx([0.5 * 0.3, 0.5 * 0.1 + 1.0], abs=1e-12)


@pytest.mark.serial
def test_failing_custom_reward_gives_error_value_and_counts(custom_module, capfd):
    from rlcore.task import rewards

    rewards._ErrorLog.printed = False
    s = _scorer(fn="my_rewards:strict", error_value=-1.0, timeout_s=0.3)
    start = time.perf_counter()
    totals, m = s.score(["boom", "7", "slow", "boom", "nan"], ["7"] * 5)
    elapsed = time.perf_counter() - start
    assert totals == [-1.0, 1.0, -1.0, -1.0, -1.0] and m["reward/errors"] == 4
    assert elapsed < 2.5, f"the 5 s call was not cut at timeout_s=0.3 ({elapsed:.1f} s)"
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1 and "custom reward exploded" in err  # the first one only
    # Off the main thread the timeout uses a worker thread instead of SIGALRM.
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=s.score(["slow", "7"], ["7", "7"])))
    worker.start()
    worker.join(10)
    assert box["r"][0] == [-1.0, 1.0] and box["r"][1]["reward/errors"] == 1
    # A failed call is never "fully correct", even with error_value = 1.
    _, correct, m = _scorer(fn="my_rewards:strict", error_value=1.0).score_samples(["boom", "7"], ["7", "7"])
    assert correct == [False, True] and m["reward/accuracy"] == 0.5
    # A batched function returning the wrong number of values fails as a whole batch.
    totals, m = _scorer(fn="my_rewards:short", error_value=0.0).score(["a", "b"], ["a", "b"])
    assert totals == [0.0, 0.0] and m["reward/errors"] == 2


@pytest.mark.parametrize("kw,expected", [
    ({"fn": "my_rewards:missing"}, "reward.fn='my_rewards:missing' is invalid: my_rewards has no callable"),
    ({"fn": "no_such_module_xyz:f"}, "importing no_such_module_xyz failed"),
    ({"fn": "nocolon"}, "package.module:function"),
    ({"components": {"custom": 1.0}}, "the custom component needs reward.fn"),
    ({"fn": "my_rewards:strict", "components": {"math": 1.0}}, "lists no 'custom' entry"),
    ({"fn": "my_rewards:strict", "timeout_s": 0}, "reward.timeout_s=0"),
])
@pytest.mark.unit
def test_reward_config_errors(custom_module, kw, expected):
    from rlcore.config import ConfigError, RewardConfig

    with pytest.raises(ConfigError, match=re.escape(expected)):
        RewardConfig(**kw)


def test_entry_point_rejects_bad_reward_fn_and_val_without_files(tiny_model, toy_data, tmp_path):
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    base = [sys.executable, "train_grpo.py", "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"),
            "--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]),
            "--trainer.output_dir", str(tmp_path / "out")]
    for extra, expected in ((["--reward.fn", "nope_mod_q:f"], "reward.fn='nope_mod_q:f' is invalid"),
                            (["--data.val_files", "[]", "--trainer.val_every", "5"], "data.val_files=[] is invalid")):
        proc = subprocess.run(base + extra, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- scripts


def _script(*args):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    return proc


def test_converters_extract_gsm8k_and_math_answers(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": "Q1?", "answer": "3 + 4 = 7\n#### 1,007"}, {"question": "Q2?", "answer": "no marker"}])
    _script("scripts/convert_data.py", "gsm8k", gsm, "--out", str(tmp_path / "g.jsonl"), "--instruction", "")
    assert [json.loads(x) for x in open(tmp_path / "g.jsonl")] == [{"prompt": "Q1?", "answer": "1007"}]
    math = write_parquet(tmp_path / "math.parquet", [
        {"problem": "P1", "solution": "So $\\boxed{\\frac{a}{b^{2}}}$ and \\boxed{\\dfrac{1}{2}}.", "level": "L5"}])
    _script("scripts/convert_data.py", "math", math, "--out", str(tmp_path / "m.parquet"), "--keep-fields")
    import pyarrow.parquet as pq

    row = pq.read_table(str(tmp_path / "m.parquet")).to_pylist()[0]
    assert row["answer"] == "\\dfrac{1}{2}" and row["level"] == "L5" and row["prompt"].startswith("P1\n")
    from rlcore.task.rewards import math_answer

    assert math_answer("the result is \\boxed{0.5}", row["answer"]) == 1.0  # the gold answer parses


def test_arith_data_is_exact_and_held_out(tmp_path):
    _script("scripts/make_arith_data.py", "--out", str(tmp_path), "--n-train", "400", "--n-val", "200")
    train = [json.loads(x) for x in open(tmp_path / "arith_train.jsonl")]
    val = [json.loads(x) for x in open(tmp_path / "arith_val.jsonl")]
    assert len(train) == 400 and len(val) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for row in train + val:  # recompute every answer from the two numbers in the text
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert int(row["answer"]) == (a + b if row["op"] == "add" else a - b) >= 0
