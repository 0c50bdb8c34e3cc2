"""Model-based rewards (rlcore/judge): judges on their own in-process vLLM engines (resume with a judge
in the loop: tests/test_resume.py; judge outputs in validation examples: tests/test_evaluate.py).

Unit tests check the templates, parsers and the weighted sum against hand computations; the
worker (tests/workers/judge_worker.py, 2 ranks, the policy's engine beside a generative judge and
a reward model) is checked against independent computations: the same judge run alone with
vllm.LLM (greedy, parsed values bit for bit), and the reward model's transformers forward (1e-4).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import QUIET_ENV, REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "judge_worker.py")
ALONE = os.path.join(REPO, "tests", "workers", "judge_alone.py")
sys.path.insert(0, os.path.join(REPO, "tests", "workers"))


# ----------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_templates_render_jinja_and_format_strings():
    from rlcore.judge.prompts import Template

    row = {"prompt": "2+2?", "topic": "math"}
    jinja = Template("[{{ topic }}] Q: {{ prompt }} A: {{ response }} ({{ answer }})")
    fmt = Template("[{topic}] Q: {prompt} A: {response} ({answer})")
    fields = {**row, "response": "4", "answer": "4"}
    assert jinja.render(fields) == fmt.render(fields) == "[math] Q: 2+2? A: 4 (4)"
    assert jinja.missing(row) == [] and Template("{{ rubric }} {{ response }}").missing(row) == ["rubric"]
    assert Template("{rubric.text} {response}").missing(row) == ["rubric"]
    for bad, why in (("{{ response ", "not a valid Jinja template"), ("{response", "not a valid format string"),
                     ("{} {response}", "positional")):
        with pytest.raises(ValueError, match=why):
            Template(bad)


@pytest.mark.unit
def test_parsers_and_score_range(tmp_path):
    from rlcore.judge.prompts import compile_parser, prompt_text, to_score

    last_number = compile_parser(r"(-?\d+(?:\.\d+)?)")
    assert last_number("Score 3, no: 7.5") == 7.5 and last_number("no digits") is None
    assert compile_parser(r"\d")("a 1 b 2") == 2.0  # no group: the whole last match
    (tmp_path / "p.py").write_text("def parse(text):\n    return 1.0 if 'yes' in text else 0.0\n")
    assert compile_parser(f"{tmp_path}/p.py:parse")("yes!") == 1.0
    with pytest.raises(ValueError, match="not a valid regex"):
        compile_parser("Score: (")
    assert to_score(7, [1, 10]) == pytest.approx(6 / 9) and to_score(12, [1, 10]) == 1.0 and to_score(-3, [1, 10]) == 0
    assert to_score("nan", None) is None and to_score(None, None) is None and to_score(2.5, None) == 2.5
    chat = {"q": [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
                  {"role": "assistant", "content": "a"}, {"role": "user", "content": "last"}]}
    assert prompt_text(chat, "q") == "last" and prompt_text({"q": "plain"}, "q") == "plain"


@pytest.mark.unit
def test_weighted_sum_with_judged_components():
    """A judged component enters the sum like a rule; a parse failure is never correct, never an error."""
    from rlcore.task.rewards import score_samples

    judged = {"judge": ([0.8, 0.2, 0.0], [False, False, True], 0.5 - 1e-6)}
    totals, correct, m = score_samples(["1", "2", "3"], ["1", "1", "3"], {"exact_match": 1.0, "judge": 2.0},
                                       judged=judged)
    assert totals == pytest.approx([1.0 + 1.6, 0.0 + 0.4, 1.0 + 0.0])
    assert correct == [True, False, False]  # 0.2 < 0.5; sample 3's verdict was unreadable
    assert m["reward/judge"] == pytest.approx(1.0 / 3) and m["reward/errors"] == 0.0


@pytest.mark.unit
def test_judge_entries_are_checked(tmp_path):
    from rlcore.config import ConfigError, RewardConfig

    ok = {"name": "j", "path": "x", "template": "{{ response }}"}
    RewardConfig(components={"j": 1.0}, models=[ok])
    for entry, msg in (({**ok, "kind": "pairwise"}, "kind='pairwise' is invalid"),
                       ({**ok, "name": "math"}, "built-in component"),
                       ({**ok, "score_range": [5, 1]}, "lo < hi"),
                       ({**ok, "sleep_level": 0}, "sleep_level=0"),
                       ({"name": "j", "path": "x"}, "a generative judge needs a template")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            RewardConfig(components={"j": 1.0, "math": 1.0}, models=[entry])
    with pytest.raises(ConfigError, match="each judge needs its own name"):
        RewardConfig(components={"j": 1.0}, models=[ok, ok])


@pytest.mark.unit
def test_a_template_failing_on_one_sample_scores_it_as_unreadable(tmp_path):
    """A Jinja expression that raises on one row does not end the run: that sample is unscorable
    (parse_fail_value, counted), the error printed once; the engine is never asked about it."""
    from rlcore.demo.toy import make_tokenizer
    from rlcore.judge.config import JudgeConfig
    from rlcore.judge.scorer import Judge

    make_tokenizer(str(tmp_path))  # the judge reads its tokenizer only: no model here
    cfg = JudgeConfig(name="j", path=str(tmp_path), template="{{ response }} {{ (extra | int) // 0 }}",
                      parse_fail_value=-2.0)
    judge = Judge(cfg, engine=None, prompt_key="prompt")  # no engine call: every input fails to render
    values, failed, m = judge.score(["3", "4"], ["3", "4"], [{"prompt": "p", "extra": 1}] * 2)
    assert values == [-2.0, -2.0] and failed == [True, True] and m["reward/j_parse_fail_frac"] == 1.0
    assert m["judge/j_distinct_frac"] == 0.0


@pytest.mark.unit
def test_a_reward_model_reads_the_rows_chat_messages_as_verls(tmp_path):
    """Without a template a reward model reads its own chat template over the conversation: the
    row's chat messages (a system turn kept) then the response, the text verl's reward model
    renders (verl 1dda039 experimental/reward_loop/reward_loop.py:196-221: raw_prompt + the assistant
    turn, add_generation_prompt=False); a plain-text prompt is one user turn."""
    from transformers import AutoTokenizer

    from rlcore.demo.toy import make_tokenizer
    from rlcore.judge.config import JudgeConfig
    from rlcore.judge.scorer import Judge

    make_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    tok.save_pretrained(str(tmp_path))
    judge = Judge(JudgeConfig(name="rm", path=str(tmp_path), kind="discriminative"), engine=None, prompt_key="prompt")
    messages = [{"role": "system", "content": "pick 1st"}, {"role": "user", "content": "d 0 1"}]
    ids = judge.judge_ids("3", "3", {"prompt": messages})
    verl = tok.apply_chat_template([*messages, {"role": "assistant", "content": "3"}], add_generation_prompt=False,
                                   tokenize=False)
    assert ids == tok(verl, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "<unk> pick 1st <eos> <unk> d 0 1 <eos> <unk> 3 <eos>"  # roles: words the toy lacks
    assert tok.decode(judge.judge_ids("3", "3", {"prompt": "d 0 1"})) == "<unk> d 0 1 <eos> <unk> 3 <eos>"


# ----------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def judged(tiny_model, tmp_path_factory) -> tuple[list, dict]:
    from rlcore import quiet
    from rlcore.demo.toy import make_tiny_model, make_tiny_qwen2_reward_model, make_tiny_reward_model

    d = tmp_path_factory.mktemp("judges")
    with quiet.filtered_output():
        gen = make_tiny_model(str(d / "gen"), seed=5, hidden_size=64, num_heads=2, num_kv_heads=1)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gen)  # a chat template, so the judge's chat path is the one tested
        tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                             "{% if add_generation_prompt %}ans is{% endif %}")
        tok.save_pretrained(gen)
        rm = make_tiny_reward_model(str(d / "rm"), seed=2)
        qrm = make_tiny_qwen2_reward_model(str(d / "qrm"), seed=3)
    out = str(d / "out.json")
    run_torchrun(WORKER, 2, tiny_model, gen, rm, qrm, out, timeout=600)
    with open(out) as f:
        return json.load(f), {"gen": gen, "rm": rm, "qrm": qrm, "dir": str(d)}


def test_generative_judge_equals_vllm_alone(judged):
    """Parsed scores bit for bit equal to the same judge run alone (plain vllm.LLM, greedy)."""
    ranks, paths = judged
    r = ranks[0]
    inputs, worker_module = r["gen_inputs"], __import__("judge_worker")
    in_path, out_path = os.path.join(paths["dir"], "gen_in.json"), os.path.join(paths["dir"], "gen_alone.json")
    with open(in_path, "w") as f:
        json.dump(inputs, f)
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, ALONE, paths["gen"], in_path, out_path, "6"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_path) as f:
        alone = json.load(f)

    def parse(text):  # the judge's parser, written again: the first group of the last match of (\d)
        found = re.findall(r"(\d)", text)
        return float(found[-1]) if found else -1.0  # parse_fail_value

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["gen"])
    assert tok.decode(inputs[0]) == "the d 0 1 pick 1st = 3 4 ans is"  # template, then the judge's chat template
    assert r["gen_raw"] == alone
    assert r["gen_values"] == [parse(t) for t in alone]
    assert -1.0 in r["gen_values"] and len(set(r["gen_values"])) > 2  # failures and several scores
    assert ranks[1]["gen_values"] == r["gen_values"]
    assert len(worker_module.RESPONSES) == len(r["gen_values"])


def test_reward_model_equals_transformers(judged):
    """The reward model's values through vLLM's pooling runner equal its transformers forward within 1e-4."""
    from transformers import AutoModelForSequenceClassification

    ranks, paths = judged
    model = AutoModelForSequenceClassification.from_pretrained(paths["rm"], dtype=torch.float32)
    with torch.no_grad():
        ref = [model(torch.tensor([ids])).logits[0, 0].item() for ids in ranks[0]["rm_inputs"]]
    diff = max(abs(a - b) for a, b in zip(ranks[0]["rm_values"], ref))
    assert diff < 1e-4, diff
    assert max(ref) - min(ref) > 0.05  # the samples score differently: the comparison means something


def test_token_level_reward_model_equals_its_hand_forward(judged):
    """Qwen2ForRewardModel (Qwen2.5-Math-RM's layout; vLLM's token_classify pooler): the value at the
    last token equals transformers' Qwen2Model forward and the score head written out, within 1e-4."""
    from safetensors.torch import load_file
    from transformers import Qwen2Model

    ranks, paths = judged
    body = Qwen2Model.from_pretrained(paths["qrm"], dtype=torch.float32)
    w = load_file(os.path.join(paths["qrm"], "model.safetensors"))
    ref = []
    with torch.no_grad():
        for ids in ranks[0]["qrm_inputs"]:
            h = body(torch.tensor([ids])).last_hidden_state[0, -1]
            hidden = torch.relu(h @ w["score.0.weight"].T + w["score.0.bias"])
            ref.append((hidden @ w["score.2.weight"].T + w["score.2.bias"]).item())
    diff = max(abs(a - b) for a, b in zip(ranks[0]["qrm_values"], ref))
    assert diff < 1e-4, diff
    assert max(ref) - min(ref) > 1e-3


def test_weighted_sum_and_dedup(judged):
    ranks, _ = judged
    r = ranks[0]
    assert r["totals"] == pytest.approx([g + 0.5 * v + 0.25 * q for g, v, q in
                                         zip(r["gen_values"], r["rm_values"], r["qrm_values"])], abs=1e-6)
    assert r["metrics"]["judge/gen_distinct_frac"] == 7 / 8  # sample 3 repeats sample 0: one request
    assert r["metrics"]["reward/gen_parse_fail_frac"] == r["gen_values"].count(-1.0) / 8
    assert r["gen_raw"][3] == r["gen_raw"][0]


def test_accelerator_sleep_frees_and_restores_a_real_engine(judged):
    """rlcore.rollout.offload on a vLLM engine (bf16 on CPU: its linear layers use the parameters'
    storages): level 1 frees weights and KV cache and restores them exactly; level 2 discards the
    weights (generate refused), which are what vLLM computes with (zeros answer differently), and the
    reload from the judge's folder brings the same answers back."""
    for r in judged[0]:
        assert r["storage_kv_gb_awake"] == 0.03125 and r["storage_kv_gb_asleep"] == 0.0
        assert r["storage_params_freed"] and r["storage_level1_same"]
        assert r["storage_level2_blocked"] and r["storage_zeros_differ"] and r["storage_level2_same"]


def test_memory_phases_and_policy_untouched(judged):
    """Judges hold their KV cache only while scoring; the policy's engine sleeps meanwhile and,
    woken by ensure_generation, samples exactly as before the judges existed."""
    for r in judged[0]:
        assert r["judge_kv_gb_built"] == {"gen": 0.0, "rm": 0.0, "qrm": 0.0}  # asleep once built
        # F2: vLLM's process-global rotary cache would hand the tiny Qwen3 judge the policy's cos/sin buffer
        assert r["storages_shared_with_policy"] == {"gen": 0, "rm": 0, "qrm": 0}
        # F5: the flag the storage sleep refuses on is read from the real scheduler (plain attention: off)
        assert r["has_zeroing_flag"] and r["kv_zeroing"] == {"gen": False, "rm": False, "qrm": False}
        assert r["inside"] == {"policy_released": ["kv_cache"],
                               "judge_kv_gb": {"gen": 0.03125, "rm": 0.03125, "qrm": 0.03125}}
        assert r["after_judge_kv_gb"] == {"gen": 0.0, "rm": 0.0, "qrm": 0.0}
        assert r["after_policy_released"] == ["kv_cache"]
        assert [step for _, step, _ in r["resumed_trace"]] == ["wake_weights", "wake_kv_cache"]
        assert r["policy_same_ids"] and r["policy_max_logprob_diff"] < 1e-6


def test_judge_in_a_tensor_parallel_group(tiny_model, toy_data, tmp_path):
    """rollout.tensor_parallel_size 2: the judge's engine is built at the policy engine's TP (its
    tensor_parallel_size left null) and both ranks of the group score the same samples alike."""
    from rlcore import quiet
    from rlcore.demo.toy import DEMO_RM_PREFERRED, make_tiny_reward_model
    from workers.launch import TRAIN, read_rows

    with quiet.filtered_output():
        rm = make_tiny_reward_model(str(tmp_path / "rm"), preferred=DEMO_RM_PREFERRED)
    judge = {"name": "high_digit", "path": rm, "kind": "discriminative", "activation": "sigmoid",
             "template": "{{ response.split()[0] if response.split() else '?' }}", "max_model_len": 32,
             "kv_cache_gb": 0.0625}
    out = str(tmp_path / "tp2")
    proc = run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "demo_judge_cpu.yaml"),
                        "--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]),
                        "--data.val_files", json.dumps([toy_data[1]]), "--val.max_samples", "8",
                        "--reward.models", json.dumps([judge]),
                        "--rollout.tensor_parallel_size", "2", "--trainer.total_steps", "2",
                        "--rollout.emulate_sleep", "true",  # level 2 as on a GPU (finding F1)
                        "--trainer.val_before_train", "true",  # F1's first generate: validation's
                        "--logging.switch_trace", "true",
                        "--trainer.prompts_per_step", "4", "--rollout.n", "4", "--trainer.output_dir", out,
                        "--checkpoint.save_hf_final", "false")
    assert "tp=2" in proc.stdout and "judges: high_digit" in proc.stdout
    # F1 under the emulated level-2 sleep: the judges' build left the policy's weights discarded, and
    # the first generate (validation before training) refilled them through the phase switch
    assert "release=sleep level 2 (emulated on CPU)" in proc.stdout
    assert "to_generation 4/7 sync_weights" in proc.stderr and "released ['kv_cache', 'weights']" in proc.stderr
    rows = read_rows(out)
    train = [r for r in rows if "reward/high_digit" in r]
    assert [r["step"] for r in train] == [1, 2] and any("val/reward_mean" in r for r in rows)
    assert all(0 < r["reward/high_digit"] < 1 and r["reward/high_digit_parse_fail_frac"] == 0 for r in train)
