"""Config and data validation: user mistakes end the run before any model loads, with exit code 2
and a message naming the key, the value and the fix. Runs the real entry point as a subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import QUIET_ENV, REPO


def run_trainer(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "train_grpo.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def base_args(tiny_model, toy_data, tmp_path):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
            "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]",
            "--trainer.output_dir", str(tmp_path / "out")]


BAD = [
    (["--rollout.n", "0"], "rollout.n=0"),
    (["--rollout.temperature", "0"], "rollout.temperature=0"),
    (["--algorithm.adv_estimator", "ppo_magic"], "algorithm.adv_estimator='ppo_magic'"),
    (["--algorithm.loss_agg_mode", "mean"], "algorithm.loss_agg_mode='mean'"),
    (["--optim.lr", "-1"], "optim.lr=-1"),
    (["--reward.components", "{nope: 1.0}"], "reward.components='nope'"),
    (["--rollout.tensor_parallel_size", "2"], "rollout.tensor_parallel_size=2"),
    (["--trainer.prompts_per_step", "0"], "trainer.prompts_per_step=0"),
    (["--model.path", "/nonexistent/model"], "model.path='/nonexistent/model'"),
    (["--data.train_files", "[/nonexistent.jsonl]"], "data.train_files='/nonexistent.jsonl'"),
    (["--rollout.max_model_len", "8"], "rollout.max_model_len=8"),
    (["--rollout.max_response_length", "60"], "rollout.max_model_len=64"),
    (["--model.nonsense", "1"], "nonsense"),
]


@pytest.mark.parametrize("extra,expected", BAD, ids=[b[1] for b in BAD])
def test_bad_config_exits_2_with_message(base_args, extra, expected):
    proc = run_trainer(*base_args, *extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error:" in proc.stderr


def test_malformed_row_names_file_and_line(base_args, tmp_path, toy_data):
    bad = tmp_path / "bad.jsonl"
    lines = open(toy_data[0]).read().splitlines()[:3] + ["{not json"]
    bad.write_text("\n".join(lines) + "\n")
    proc = run_trainer(*base_args, "--data.train_files", json.dumps([str(bad)]))
    assert proc.returncode == 2 and f"{bad}:4" in proc.stderr and "skip_bad_rows" in proc.stderr, proc.stderr


def test_empty_dataset_is_an_error(base_args, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_trainer(*base_args, "--data.train_files", json.dumps([str(empty)]))
    assert proc.returncode == 2 and "no usable prompt" in proc.stderr, proc.stderr


def test_print_config_round_trips_with_help_comments(base_args, tmp_path):
    """--print_config prints a commented YAML a user can save, edit and pass back: auto values stay
    unresolved (null/auto), so the same file works on another device."""
    import yaml

    proc = run_trainer(*base_args, "--rollout.n", "3", "--print_config")
    assert proc.returncode == 0, proc.stderr
    assert "  # Samples per prompt (the GRPO group size)." in proc.stdout
    data = yaml.safe_load(proc.stdout)
    assert data["rollout"]["n"] == 3 and data["algorithm"]["adv_estimator"] == "grpo"
    assert data["rollout"]["enforce_eager"] is None and data["model"]["attn_implementation"] == "auto"
    saved = tmp_path / "saved.yaml"
    saved.write_text(proc.stdout)
    again = run_trainer("--config", str(saved), "--print_config")
    assert again.returncode == 0 and again.stdout == proc.stdout, again.stderr


def test_help_shows_each_keys_meaning_and_default():
    proc = run_trainer("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for phrase in ("Samples per prompt (the GRPO group size). (type: int, default: 8)",
                   "Weight of the KL loss to a frozen reference policy",
                   "null = bfloat16 on cuda/npu, float32 on cpu", "--print_resolved"):
        assert phrase in text, phrase


def resolved(*args: str) -> dict:
    import yaml

    proc = run_trainer(*args, "--print_resolved")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# resolved for device cpu")
    return yaml.safe_load(proc.stdout)


def test_dependent_defaults_are_resolved_after_parsing(tmp_path):
    """Every default that depends on another key or on the device, through the real command line.
    The reward case is the bug users met: a YAML with only reward.fn exited 2 ("lists no 'custom'
    entry") because the default section had filled components={math: 1.0} before the YAML arrived."""
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(response, answer):\n    return float(response.strip() == answer)\n")
    only_fn = tmp_path / "only_fn.yaml"
    only_fn.write_text(f"reward:\n  fn: {reward}:score\nrollout:\n  max_response_length: 40\n")
    cfg = resolved("--config", str(only_fn))
    assert cfg["reward"]["components"] == {"custom": 1.0}
    assert cfg["val"]["max_response_length"] == 40  # 0 = rollout.max_response_length
    assert cfg["model"]["dtype"] == "float32" and cfg["model"]["attn_implementation"] == "sdpa"
    assert cfg["offload"] == {"params": False, "optimizer": False, "ref": False}
    r = cfg["rollout"]
    assert r["weight_load"] == "reload" and r["enforce_eager"] is True and r["sleep_level"] == 0
    assert resolved()["reward"]["components"] == {"math": 1.0}
    # Explicit values win over every dependent default.
    cfg = resolved("--config", str(only_fn), "--reward.components", "{custom: 0.5, exact_match: 1.0}",
                   "--val.max_response_length", "7", "--offload.params", "true", "--model.dtype", "bfloat16")
    assert cfg["reward"]["components"] == {"custom": 0.5, "exact_match": 1.0}
    assert cfg["val"]["max_response_length"] == 7 and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["offload"] == {"params": True, "optimizer": False, "ref": True}  # ref follows params


@pytest.mark.unit
def test_accelerator_defaults_resolve_per_device():
    from rlcore.config import Config, resolve

    for device in ("cuda", "npu"):
        cfg = resolve(Config(), device)
        assert cfg.model.dtype == "bfloat16" and cfg.rollout.sleep_level == 2
        assert (cfg.offload.params, cfg.offload.optimizer, cfg.offload.ref) == (True, True, True)
        assert cfg.rollout.weight_load == "direct" and cfg.rollout.enforce_eager is False
        assert resolve(cfg, device) == cfg  # resolving twice changes nothing
    cpu = resolve(Config(), "cpu")
    assert cpu.model.dtype == "float32" and cpu.rollout.weight_load == "reload" and cpu.rollout.enforce_eager
    assert cpu.algorithm.share_prompt is True  # sdpa: the block mask runs
    assert cpu.rollout.dtype == "float32"  # vLLM's dtype follows the trainer's unless set
    from rlcore.config import RolloutConfig

    bf16 = resolve(Config(rollout=RolloutConfig(dtype="bfloat16")), "cpu")
    assert (bf16.model.dtype, bf16.rollout.dtype) == ("float32", "bfloat16")
    from rlcore.config.lora import LoraConfig

    lora = resolve(Config(lora=LoraConfig(rank=8)), "cuda")  # adapter-only sync: vLLM keeps its base weights
    assert lora.rollout.sleep_level == 1 and lora.rollout.check_sync == "off"
    assert cpu.rollout.check_sync == "warn"


@pytest.mark.unit
def test_kv_block_size_per_device():
    """CPU gets 32-token blocks so that prompts under vLLM's CPU default of 128 tokens are shared by
    their n samples (rollout.settings.pick_block_size); accelerators keep vLLM's default; a size the
    CPU kernels cannot take is refused naming the field and the fix."""
    from rlcore.config import Config, ConfigError, RolloutConfig, resolve

    assert resolve(Config(), "cpu").rollout.block_size == 32
    assert resolve(Config(), "cuda").rollout.block_size is None and resolve(Config(), "npu").rollout.block_size is None
    assert resolve(Config(rollout=RolloutConfig(enable_prefix_caching=False)), "cpu").rollout.block_size is None
    assert resolve(Config(rollout=RolloutConfig(block_size=64)), "cpu").rollout.block_size == 64
    assert resolve(Config(rollout=RolloutConfig(block_size=16)), "cuda").rollout.block_size == 16
    with pytest.raises(ConfigError, match=r"rollout.block_size=48 is invalid on cpu.*multiple of 32.*e.g. 32"):
        resolve(Config(rollout=RolloutConfig(block_size=48)), "cpu")
    with pytest.raises(ConfigError, match=r"rollout.block_size=0 is invalid on cuda.*> 0"):
        resolve(Config(rollout=RolloutConfig(block_size=0)), "cuda")


@pytest.mark.unit
def test_cpu_bf16_warning_follows_the_cpu():
    """bfloat16 on a CPU without AMX / AVX512-BF16 is emulated (about 4x slower than float32): the run
    warns naming both fields and the fix; with the instructions, on accelerators or in float32 it
    does not. The probe is torch's own (the one vLLM's CPU attention asks) and agrees with the
    kernel's flags in /proc/cpuinfo."""
    from rlcore.run.preflight import cpu_bf16_isa, cpu_bf16_note

    note = cpu_bf16_note("cpu", ("bfloat16", "bfloat16"), None)
    assert "model.dtype/rollout.dtype=bfloat16" in note and "model.dtype: float32" in note
    assert cpu_bf16_note("cpu", ("float32", "bfloat16"), None) == note  # a bf16 engine alone is enough
    assert cpu_bf16_note("cpu", ("float32", "float32"), None) is None
    assert cpu_bf16_note("cpu", (None, None), None) is None  # null resolves to float32 on cpu
    assert cpu_bf16_note("cpu", ("bfloat16", None), "amx") is None
    assert cpu_bf16_note("cpu", ("bfloat16", None), "avx512_bf16") is None
    assert cpu_bf16_note("cpu", ("bfloat16", None), "arm_bf16") is None
    assert cpu_bf16_note("cuda", ("bfloat16", None), None) is None
    if os.path.exists("/proc/cpuinfo"):
        flags = set(next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo")
                          if l.startswith(("flags", "Features"))), []))  # x86 / Arm
        expected = "amx" if "amx_tile" in flags else "avx512_bf16" if "avx512_bf16" in flags else \
            "arm_bf16" if "bf16" in flags else None  # Arm's flag for FEAT_BF16
        assert cpu_bf16_isa() == expected, (sorted(f for f in flags if "amx" in f or "bf16" in f), cpu_bf16_isa())


@pytest.mark.unit
def test_share_prompt_follows_the_attention_kernel():
    """share_prompt needs a dense mask: auto is on with sdpa/eager, off with a flash kernel and under
    Ulysses, and asking for it with a flash kernel is a config error that names both fixes."""
    from rlcore.config import AlgorithmConfig, Config, ConfigError, ModelConfig, resolve

    npu = Config(model=ModelConfig(attn_implementation="auto"))
    assert resolve(npu, "npu").algorithm.share_prompt is False  # npu_fusion_attention
    assert resolve(Config(model=ModelConfig(attn_implementation="eager")), "cpu").algorithm.share_prompt is True
    forced = dataclasses.replace(npu, algorithm=AlgorithmConfig(share_prompt=True))
    with pytest.raises(ConfigError, match="share_prompt=true needs a dense attention mask.*attn_implementation: sdpa"):
        resolve(forced, "npu")
    off = dataclasses.replace(npu, algorithm=AlgorithmConfig(share_prompt=False))
    assert resolve(off, "cpu").algorithm.share_prompt is False  # an explicit false wins
    from rlcore.config.sections import ParallelConfig

    sp = Config(parallel=ParallelConfig(ulysses_size=2))  # attends sequence by sequence: a mask would cost (S, S)
    assert resolve(sp, "cpu").algorithm.share_prompt is False
    assert resolve(dataclasses.replace(sp, algorithm=AlgorithmConfig(share_prompt=True)), "cpu").algorithm.share_prompt


@pytest.mark.unit
def test_prompt_sampler_is_seeded_and_resumable(tiny_model, toy_data):
    from transformers import AutoTokenizer

    from rlcore.config import DataConfig
    from rlcore.task.prompts import PromptSampler, load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = DataConfig(train_files=[toy_data[0]], max_prompt_length=16)
    prompts, stats = load_prompts(cfg.train_files, cfg, tok)
    assert len(prompts) == 200 and stats["data/filtered_too_long"] == 0
    a = PromptSampler(prompts, seed=3)
    first = [p.text for p in a.next_batch(150)]
    state = a.state_dict()
    rest = [p.text for p in a.next_batch(100)]  # crosses the epoch boundary
    b = PromptSampler(prompts, seed=3)
    b.load_state_dict(state)
    assert [p.text for p in b.next_batch(100)] == rest
    assert sorted(first + rest[:50]) == sorted(p.text for p in prompts)  # epoch 0 is a permutation
    assert a.epoch == 1


@pytest.mark.unit
def test_long_prompts_are_filtered_or_rejected(tiny_model, toy_data):
    from transformers import AutoTokenizer

    from rlcore.config import ConfigError, DataConfig
    from rlcore.task.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model)  # toy prompts are 6 tokens long (2 digits)
    cfg = DataConfig(train_files=[toy_data[0]], max_prompt_length=5)
    with pytest.raises(ConfigError, match="no usable prompt"):
        load_prompts(cfg.train_files, cfg, tok)
    cfg = DataConfig(train_files=[toy_data[0]], max_prompt_length=5, truncation="error")
    with pytest.raises(ConfigError, match="max_prompt_length=5"):
        load_prompts(cfg.train_files, cfg, tok)


@pytest.mark.unit
def test_engines_satisfy_the_protocols_the_loop_uses():
    """rlcore.protocols' Policy and Rollout list what the loop needs; the real engines provide it."""
    import inspect

    from rlcore.engine_veomni import VeOmniPolicy
    from rlcore.protocols import Policy, Rollout
    from rlcore.colocate_rollout import ColocateRollout

    for proto, cls in ((Policy, VeOmniPolicy), (Rollout, ColocateRollout)):
        methods = [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]
        assert methods and all(callable(getattr(cls, n, None)) for n in methods), (cls, methods)
        init = inspect.getsource(cls)
        for attr in getattr(proto, "__annotations__", {}):  # data members: set in __init__ or properties
            assert hasattr(cls, attr) or f"self.{attr}" in init, (cls, attr)


# ----------------------------------------------------------------------------- scripts/make_arith_data.py


def make_arith(tmp_path, *args: str) -> tuple[list[dict], list[dict]]:
    """Run the real script; return (train rows, validation rows)."""
    proc = subprocess.run([sys.executable, "scripts/make_arith_data.py", "--out", str(tmp_path), *args], cwd=REPO,
                          env={**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return tuple([json.loads(line) for line in open(tmp_path / name)] for name in ("arith_train.jsonl", "arith_val.jsonl"))


BARE_PROMPT = re.compile(r"What is (\d+) ([+-]) (\d+)\? Answer with just the number\.")


@pytest.mark.unit
def test_arith_bare_style_rows_are_exact_held_out_and_sometimes_negative(tmp_path):
    train, val = make_arith(tmp_path, "--style", "bare", "--n-train", "500", "--n-val", "100", "--seed", "3")
    assert len(train) == 500 and len(val) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}  # held out
    assert len({r["prompt"] for r in train}) == 500 and len({r["prompt"] for r in val}) == 100
    for row in train + val:
        assert set(row) == {"prompt", "answer", "op"}
        m = BARE_PROMPT.fullmatch(row["prompt"])
        assert m, row
        a, sym, b = int(m[1]), m[2], int(m[3])
        assert 1 <= a <= 99 and 1 <= b <= 99  # the bare default --max-operand
        assert row["op"] == {"+": "add", "-": "sub"}[sym]
        assert re.fullmatch(r"-?(0|[1-9]\d*)", row["answer"]), row  # a plain integer string
        assert int(row["answer"]) == (a + b if sym == "+" else a - b)
    assert sum(int(r["answer"]) < 0 for r in train) > 50  # b > a happens: answers go negative
    assert {r["op"] for r in train} == {"add", "sub"}


@pytest.mark.unit
def test_arith_bare_style_knobs_and_capacity(tmp_path):
    train, val = make_arith(tmp_path / "a", "--style", "bare", "--ops", "sub", "--max-operand", "9",
                            "--n-train", "61", "--n-val", "20")  # all 81 distinct problems
    assert {r["op"] for r in train + val} == {"sub"}
    assert len({r["prompt"] for r in train + val}) == 81
    assert max(abs(int(r["answer"])) for r in train + val) == 8
    proc = subprocess.run([sys.executable, "scripts/make_arith_data.py", "--out", str(tmp_path / "b"), "--style",
                           "bare", "--max-operand", "9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "only 162 distinct problems" in proc.stderr and "--max-operand" in proc.stderr


# Generated by the script before --style existed (seed 0, --n-train 400 --n-val 200): --style word,
# the default, must keep producing these exact bytes.
WORD_TRAIN_HEAD = [
    '{"prompt": "Leo had 7 cards and lost 1. How many cards does Leo have now?\\nGive only the final answer as a number.", "answer": "6", "op": "sub"}',
    '{"prompt": "Zoe had 8 pencils and lost 5. How many pencils does Zoe have now?\\nGive only the final answer as a number.", "answer": "3", "op": "sub"}',
    '{"prompt": "Zoe has 5 marbles. Zoe gets 3 more marbles. How many marbles does Zoe have now?\\nGive only the final answer as a number.", "answer": "8", "op": "add"}',
    '{"prompt": "Jack has 5 stickers. Jack gets 2 more stickers. How many stickers does Jack have now?\\nGive only the final answer as a number.", "answer": "7", "op": "add"}',
    '{"prompt": "Max had 9 stickers and lost 2. How many stickers does Max have now?\\nGive only the final answer as a number.", "answer": "7", "op": "sub"}',
]
WORD_SHA256 = {"arith_train.jsonl": "130f90e956da927d6445c6f0284747aa094d4fa0028f921fa2d365cfe753bf1d",
               "arith_val.jsonl": "68d9828ee315f4bb76608b631bce0ce983ad2e0ebcbdc858713020b3e9a8a058"}


@pytest.mark.unit
@pytest.mark.parametrize("style_args", [[], ["--style", "word"]], ids=["default", "explicit"])
def test_arith_word_style_output_is_unchanged(tmp_path, style_args):
    import hashlib

    make_arith(tmp_path, "--n-train", "400", "--n-val", "200", "--seed", "0", *style_args)
    assert open(tmp_path / "arith_train.jsonl").read().splitlines()[:5] == WORD_TRAIN_HEAD
    for name, digest in WORD_SHA256.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.unit
@pytest.mark.parametrize("response,gold,expected", [
    ("-48", "-48", 1.0),
    ("The answer is -48.", "-48", 1.0),
    ("What is 37 - 85? -48", "-48", 1.0),
    ("<answer>-48</answer>", "-48", 1.0),
    ("-48", "48", 0.0),
    ("The answer is -48.", "48", 0.0),
    ("48", "-48", 0.0),
    ("The answer is 48.", "-48", 0.0),
])
def test_math_reward_scores_negative_answers(response, gold, expected):
    from rlcore.task.rewards import math_answer

    assert math_answer(response, gold) == expected


@pytest.mark.unit
def test_arith_carries_by_hand(tmp_path):
    """Schoolbook carries and borrows, hand-counted; --with-carries adds the field and nothing else."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import make_arith_data as mad

    hand = {(73, 98, "add"): 2, (61, 6, "add"): 0, (55, 8, "add"): 1, (95, 5, "add"): 2, (98, 54, "sub"): 0,
            (76, 37, "sub"): 1, (100, 1, "sub"): 2, (37, 85, "sub"): 1, (40, 40, "sub"): 0}
    assert {k: mad.carries(*k) for k in hand} == hand
    plain, _ = make_arith(tmp_path / "a", "--n-train", "50", "--n-val", "10", "--max-operand", "99")
    marked, _ = make_arith(tmp_path / "b", "--n-train", "50", "--n-val", "10", "--max-operand", "99", "--with-carries")
    assert [{k: v for k, v in r.items() if k != "carries"} for r in marked] == plain
    for r in marked:
        a, b = (int(x) for x in re.findall(r"\d+", r["prompt"])[:2])
        assert r["carries"] == mad.carries(a, b, r["op"]) and r["answer"] == str(a + b if r["op"] == "add" else a - b)
