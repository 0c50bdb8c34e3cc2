"""verl's rows and rewards without an engine: the layout recognised with no data.* key set, the
reward by data_source through the scorer (ground truth as stored, acc deciding correctness), a
custom reward function in verl's signatures (per sample, batched, async, reward_kwargs), and the
errors a verl user meets (a bad row, a video, a source verl has no scorer for, a function that
cannot take verl's call). Real files, a real tokenizer and pyarrow."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from test_data_rewards import tok, write_parquet  # noqa: F401 (tok: the tiny model's tokenizer with a chat template)

pytestmark = pytest.mark.unit

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py


def gsm8k_rows(n: int = 4) -> list[dict]:
    from rlcore.task.verl_rows import to_verl_row

    return [to_verl_row(f"d {i} {i + 1} pick 1st = {GSM8K_INSTRUCTION}", str(i), "openai/gsm8k",
                        extra_info={"split": "train", "index": i, "answer": f"... #### {i}", "question": f"d {i}"})
            for i in range(n)]


def test_verl_rows_are_read_with_no_data_key_set(tok, tmp_path):
    """The layout verl's gsm8k preprocessing writes: recognised from the file, answer_key,
    apply_chat_template and the reward default filled; the start-up line says so; keys set by the
    user stay set."""
    from rlcore.config import DataConfig, RewardConfig
    from rlcore.task import verl_rows
    from rlcore.task.prompts import load_prompts

    path = write_parquet(tmp_path / "train.parquet", gsm8k_rows())
    found = verl_rows.detect([path])
    assert found.files == [path] and not found.images
    data = verl_rows.resolve_data(DataConfig(max_prompt_length=64), found)
    assert (data.answer_key, data.apply_chat_template, data.image_key) == ("reward_model.ground_truth", True, None)
    assert RewardConfig().effective_components(verl_rows=True) == {"verl": 1.0}
    prompts, _ = load_prompts([path], DataConfig(max_prompt_length=64), tok)  # unresolved keys: the same reading
    assert [p.answer for p in prompts] == ["0", "1", "2", "3"]
    assert prompts[1].text == f"<|user|>d 1 2 pick 1st = {GSM8K_INSTRUCTION}\n<|assistant|>"  # the chat template
    assert prompts[1].row["extra_info"]["index"] == 1 and prompts[1].row["data_source"] == "openai/gsm8k"
    line = verl_rows.startup_line(found, data, {"verl": 1.0}, verl_rows.sources([path]))
    assert line == ("verl rows: train.parquet (ability, data_source, extra_info, prompt, reward_model) read with "
                    "data.answer_key=reward_model.ground_truth, data.apply_chat_template=true; reward: verl's scorer "
                    "by data_source: openai/gsm8k (4 rows)")
    mine = verl_rows.resolve_data(DataConfig(answer_key="extra_info.question", apply_chat_template=False), found)
    assert (mine.answer_key, mine.apply_chat_template) == ("extra_info.question", False)
    plain = write_parquet(tmp_path / "plain.parquet", [{"prompt": "d 1 2 pick 1st =", "answer": "1"}])
    assert verl_rows.detect([plain]) is None
    assert verl_rows.resolve_data(DataConfig(), None).answer_key == "answer"
    with pytest.raises(Exception, match="mixes verl's rows"):
        verl_rows.detect([path, plain])


def test_the_run_config_resolves_verl_rows(tmp_path):
    """rlcore.config.resolve, as train_grpo.py and --print_resolved run it: verl's keys and {verl: 1.0};
    an explicit reward.components or reward.fn wins."""
    from rlcore.config import Config, DataConfig, RewardConfig, resolve

    path = write_parquet(tmp_path / "train.parquet", gsm8k_rows())
    cfg = resolve(Config(data=DataConfig(train_files=[path])), "cpu")
    assert cfg.data.answer_key == "reward_model.ground_truth" and cfg.data.apply_chat_template is True
    assert cfg.reward.components == {"verl": 1.0}
    cfg = resolve(Config(data=DataConfig(train_files=[path]), reward=RewardConfig(components={"math": 1.0})), "cpu")
    assert cfg.reward.components == {"math": 1.0}


def test_bad_verl_rows_are_named_with_verls_fix(tok, tmp_path):
    from rlcore.config import ConfigError, DataConfig
    from rlcore.task.prompts import load_prompts

    rows = gsm8k_rows()
    rows[2]["reward_model"] = {"style": "rule"}
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError) as err:
        load_prompts([path], DataConfig(), tok)
    assert str(err.value).startswith(f"{path}: row 3 lacks key(s) ['reward_model.ground_truth']; a verl row holds its "
                                     "reference answer as reward_model: {style: rule, ground_truth: ...}")
    rows = gsm8k_rows()
    rows[1]["videos"] = [{"video": "clip.mp4"}]
    path = tmp_path / "video.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2 has 1 video(s) under 'videos'")):
        load_prompts([str(path)], DataConfig(), tok)
    prompts, stats = load_prompts([str(path)], DataConfig(skip_bad_rows=True), tok)
    assert len(prompts) == 3 and stats["data/bad_rows"] == 1


def test_a_source_verl_has_no_scorer_for_is_refused_naming_the_row(tmp_path):
    from rlcore.config import ConfigError
    from rlcore.task import verl_rows

    rows = gsm8k_rows()
    rows[3]["data_source"] = "my/unknown_set"
    rows[2]["data_source"] = "codecontests"
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(ConfigError) as err:
        verl_rows.check_sources(verl_rows.sources([path]), "reward.components")
    assert f"{path}: row 3 (and 0 more) cannot be scored by the verl component of reward.components: data_source=" \
           "'codecontests' is a code source" in str(err.value)
    del rows[2]
    path = write_parquet(tmp_path / "train2.parquet", rows)
    with pytest.raises(ConfigError, match=re.escape("Reward function is not implemented for data_source='my/unknown_set'")):
        verl_rows.check_sources(verl_rows.sources([path]), "reward.components")
    nosource = write_parquet(tmp_path / "plain.parquet", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(ConfigError, match="row 1 .* it has no data_source"):
        verl_rows.check_sources(verl_rows.sources([nosource]), "reward.components")


def test_verl_component_scores_by_source_with_the_stored_truth_and_acc():
    """The issue's GSM8K cases score 0 as verl's strict scorer gives them (math-verify gave each 1);
    math_dapo is +-1 with acc deciding correctness; geo3k's 0.9 (right, no <think>) is not "correct";
    a ground truth stored as a number is passed as stored (verl compares strings: 0)."""
    from rlcore.config import RewardConfig
    from rlcore.task.rewards import Scorer

    gsm = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "60"}}
    dapo = {"data_source": "math_dapo", "reward_model": {"ground_truth": "5"}}
    geo = {"data_source": "hiyouga/geometry3k", "reward_model": {"ground_truth": "3"}}
    number = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": 60}}
    responses = ["#### 60", "The answer is 60.", "\\boxed{60}", "#### 60.0", "#### 61 no wait it is 60",
                 "Answer: 5", "Answer: 6", "\\boxed{3}", "<think>t</think> \\boxed{3}", "#### 60"]
    rows = [gsm] * 5 + [dapo] * 2 + [geo] * 2 + [number]
    scorer = Scorer(RewardConfig(components={"verl": 1.0}), answer_key="reward_model.ground_truth")
    totals, correct, m = scorer.score_samples(responses, ["unused"] * len(rows), rows=rows)
    assert totals == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.9, 1.0, 0.0]
    assert correct == [True, False, False, False, False, True, False, False, True, False]
    assert m["reward/accuracy"] == 0.3 and m["reward/errors"] == 0.0
    math_verify = Scorer(RewardConfig(components={"math": 1.0}))
    assert math_verify.score(responses[:5], ["60"] * 5)[0] == [1.0] * 5  # what the issue saw instead


VERL_FN = textwrap.dedent('''
    import asyncio
    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0, **kwargs):
        CALLS.append((data_source, solution_str, ground_truth, dict(extra_info), bonus))
        if solution_str == "boom":
            raise RuntimeError("my reward exploded")
        right = solution_str.strip() == ground_truth
        return {"score": float(right) + bonus * extra_info["index"], "acc": right}

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]

    async def async_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return 0.5

    def no_extra(data_source, solution_str, ground_truth):
        return 1.0
''')


@pytest.fixture
def verl_fn(tmp_path):
    path = tmp_path / "my_verl_reward.py"
    path.write_text(VERL_FN)
    return str(path)


def _scored(spec: str, responses: list[str], rows: list[dict], **kw):
    from rlcore.config import RewardConfig
    from rlcore.task.rewards import Scorer

    scorer = Scorer(RewardConfig(fn=spec, **kw), answer_key="reward_model.ground_truth")
    return scorer, scorer.score_samples(responses, ["unused"] * len(rows), rows=rows)


def test_a_verl_custom_reward_function_works_unchanged(verl_fn, capfd):
    """verl's compute_score signature: keywords as verl's reward manager passes them (data_source,
    the decoded response, the stored ground truth, extra_info plus num_turns and
    rollout_reward_scores), reward.fn_kwargs on top; a dict's score and acc; its batched and async
    forms; a failure names the file, the function and the row."""
    from rlcore.task import rewards

    rows = gsm8k_rows(3)
    scorer, (totals, correct, m) = _scored(f"{verl_fn}:compute_score", ["0", "5", "2"], rows, fn_kwargs={"bonus": 0.25})
    assert totals == [1.0, 0.25, 1.5] and correct == [True, False, True] and m["reward/custom"] == pytest.approx(2.75 / 3)
    source, text, truth, extra, bonus = scorer.custom_fn.fn.__globals__["CALLS"][1]
    assert (source, text, truth, bonus) == ("openai/gsm8k", "5", "1", 0.25)
    assert extra == {**rows[1]["extra_info"], "num_turns": 2, "rollout_reward_scores": {}}
    assert "num_turns" not in rows[1]["extra_info"]  # the row itself is left as it was
    _, (totals, _, _) = _scored(f"{verl_fn}:batch_score", ["0", "x", "2"], rows, fn_kwargs={"scale": 2.0})
    assert totals == [2.0, 0.0, 2.0]
    _, (totals, _, _) = _scored(f"{verl_fn}:async_score", ["0"], rows[:1])
    assert totals == [0.5]
    rewards._ErrorLog.printed = False
    _, (totals, correct, m) = _scored(f"{verl_fn}:compute_score", ["boom", "1"], rows[:2], error_value=-1.0)
    assert totals == [-1.0, 1.0] and correct == [False, True] and m["reward/errors"] == 1
    err = capfd.readouterr().err
    assert (f"warning: reward 'custom' ({verl_fn}:compute_score) failed on the row (data_source='openai/gsm8k', "
            "extra_info.index=0)") in err and "my reward exploded" in err


@pytest.mark.parametrize("spec,kwargs,expected", [
    ("no_extra", {}, "cannot be called as compute_score(data_source, solution_str, ground_truth, extra_info=None, "
                     "**kwargs) (got an unexpected keyword argument 'extra_info')"),
    ("batch_score", {"nope": 1}, "plus reward.fn_kwargs ['nope']"),
])
def test_a_function_that_cannot_take_verls_call_is_refused_at_start_up(verl_fn, spec, kwargs, expected):
    from rlcore.config import ConfigError, RewardConfig

    with pytest.raises(ConfigError, match=re.escape(expected)):
        RewardConfig(fn=f"{verl_fn}:{spec}", fn_kwargs=kwargs)
    with pytest.raises(ConfigError, match=re.escape("reward.fn_kwargs={'bonus': 1} is invalid")):
        RewardConfig(fn_kwargs={"bonus": 1})


def test_the_verl_reward_times_out_as_reward_fn_does(tmp_path):
    """reward.timeout_s applies to a verl-signature function per call, and a limit nested inside it
    (verl's 10 s sympy limit, here 0.2 s) leaves the outer one in force."""
    from rlcore.task.timeouts import RewardTimeout, call_with_timeout

    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent('''
        import time
        from rlcore.task.timeouts import call_with_timeout

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "nested":
                try:
                    call_with_timeout(time.sleep, (5,), 0.2)  # the inner limit fires first
                except Exception:
                    pass
                time.sleep(5)  # the outer limit must still cut this
            return 1.0
    '''))
    _, (totals, _, m) = _scored(f"{path}:compute_score", ["nested", "fast"], gsm8k_rows(2), timeout_s=0.6)
    assert totals == [0.0, 1.0] and m["reward/errors"] == 1
    with pytest.raises(RewardTimeout):
        call_with_timeout(lambda: call_with_timeout(lambda: __import__("time").sleep(2), (), 5), (), 0.3)


def test_convert_data_reads_and_writes_verl_rows(tmp_path, capsys):
    """The issue's point 5: convert_data.py gsm8k on verl's Parquet reads it (it said "no gsm8k rows
    with an extractable answer"); --to verl writes rows the trainer recognises as verl's, with verl's
    data_source and instruction, and converting them back gives the plain rows again. The script's
    main in this process (tests/test_data_rewards.py runs the script in a child interpreter)."""
    import runpy

    import pyarrow.parquet as pq

    from conftest import REPO
    from rlcore.task import verl_rows
    from test_data_rewards import write_jsonl

    main = runpy.run_path(os.path.join(REPO, "scripts", "convert_data.py"))["main"]

    def _script(_, *argv):
        main(list(argv))

    verl = write_parquet(tmp_path / "verl.parquet", gsm8k_rows(3))
    _script("scripts/convert_data.py", "gsm8k", verl, "--out", str(tmp_path / "plain.jsonl"))
    assert "wrote 3 rows" in capsys.readouterr().out
    plain = [json.loads(x) for x in open(tmp_path / "plain.jsonl")]
    assert plain[1] == {"prompt": f"d 1 2 pick 1st = {GSM8K_INSTRUCTION}", "answer": "1", "data_source": "openai/gsm8k",
                        "extra_info": gsm8k_rows(3)[1]["extra_info"]}  # no second instruction appended
    raw = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Q1?", "answer": "3 + 4 = 7\n#### 1,007"}])
    _script("scripts/convert_data.py", "gsm8k", raw, "--out", str(tmp_path / "for_verl.parquet"), "--to", "verl",
            "--split", "test")
    rows = pq.read_table(str(tmp_path / "for_verl.parquet")).to_pylist()
    assert rows == [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q1? {GSM8K_INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1007"},
                     "extra_info": {"split": "test", "index": 0}}]
    assert verl_rows.detect([str(tmp_path / "for_verl.parquet")]) is not None
    _script("scripts/convert_data.py", "verl", str(tmp_path / "for_verl.parquet"), "--out", str(tmp_path / "again.parquet"),
            "--to", "verl")
    assert pq.read_table(str(tmp_path / "again.parquet")).to_pylist() == rows  # verl -> verl: unchanged


def test_the_issues_first_error_now_says_the_key(tok, tmp_path):
    """The issue's point 1: data.answer_key set to "answer" by hand on verl's rows said only "lacks
    key(s) ['answer']"; now it names verl's key."""
    from rlcore.config import ConfigError, DataConfig
    from rlcore.task.prompts import load_prompts

    path = write_parquet(tmp_path / "train.parquet", gsm8k_rows())
    with pytest.raises(ConfigError) as err:
        load_prompts([path], DataConfig(answer_key="answer", apply_chat_template=True), tok)
    assert str(err.value) == (f"{path}: row 1 lacks key(s) ['answer']; it is a verl row, whose reference answer is "
                              "reward_model.ground_truth: set data.answer_key: reward_model.ground_truth (or leave "
                              "data.answer_key unset: verl's rows are recognised), or set data.skip_bad_rows=true to "
                              "skip such rows")
