"""scripts/from_verl.py: verl launch scripts in, this project's YAML out (issue 58, point 1).

The fixtures are verl's own examples/grpo_trainer scripts, copied unchanged (tests/fixtures/verl/,
each file's first line names its repository, commit and path). Each converts, and the converted
YAML passes this project's own parse and checks (train_grpo.parse_config) once the verl script's
model and data paths, which do not exist here, are replaced on the command line by the tests'
tiny model and toy data (--model.path, --data.train_files, --data.val_files, --trainer.output_dir).
Conversions of three scripts are checked by hand against verl's semantics; the shell reading, the
unmapped list and bad inputs each have their cases. All in-process except --help and the
no-traceback checks, which run the script as a user does.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

sys.path.insert(0, os.path.join(REPO, "scripts"))
import from_verl  # noqa: E402
import verl_shell  # noqa: E402
import verl_table  # noqa: E402

FIXTURES = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "verl", "*.sh")))
A, R, REF = verl_table.A, verl_table.R, verl_table.REF
# Converted settings this project refuses for a reason of its own, asserted as such (exit 2 naming the key).
KNOWN_REFUSALS: dict[str, str] = {}  # fixture -> the key this project's parse refuses it on (none now)


def convert(argv: list[str], capsys, env: dict | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if env and monkeypatch:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    rc = from_verl.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def yaml_of(argv, capsys, **kw) -> tuple[dict, str, str]:
    import yaml

    rc, out, err = convert(argv, capsys, **kw)
    assert rc == 0, err
    return yaml.safe_load(out), out, err


def comment_of(text: str, key: str) -> str:
    line = next(line for line in text.splitlines() if re.match(rf"\s*{key}: ", line))
    return line.split("  # ", 1)[1]


# ----------------------------------------------------------------------------- the fixtures


def test_at_least_twelve_fixtures_with_their_source():
    assert len(FIXTURES) >= 12
    for path in FIXTURES:
        head = open(path).readline()
        assert re.match(r"# Copied unchanged from https://github.com/(verl-project|volcengine)/verl/blob/[0-9a-f]{40}/"
                        r"examples/grpo_trainer/\S+\.sh", head), path


@pytest.mark.parametrize("path", FIXTURES, ids=[os.path.basename(p) for p in FIXTURES])
def test_every_fixture_converts_and_passes_the_projects_parse(path, capsys, tmp_path, tiny_model, toy_data, monkeypatch):
    import train_grpo
    from rlcore.run.ownership import release_output_dirs

    monkeypatch.setenv("HOME", "/home/user")
    out = str(tmp_path / "cfg.yaml")
    rc, _, err = convert([path, "--allow-unmapped", "-o", out], capsys)
    assert rc == 0, err
    text = open(out).read()
    for line in text.splitlines():  # every key written names where it came from
        if re.match(r"\s*\w+: \S", line):
            assert re.search(r"  # .*(actor_rollout_ref\.|data\.|trainer\.|algorithm\.|model_engine|reward_model\.|"
                             r"max_prompt_length \+ max_response_length|Ascend)", line), line
    argv = ["--config", out, "--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]),
            "--data.val_files", json.dumps([toy_data[1]]), "--trainer.output_dir", str(tmp_path / "run")]
    try:
        # resolved for the device the script targets (npu where it says so), as scripts/check_config.py does
        train_grpo.parse_config(argv, device_type="npu" if "device: \"npu\"" in text else "cuda")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        release_output_dirs()
    err = capsys.readouterr().err
    if os.path.basename(path) in KNOWN_REFUSALS:
        assert code == 2 and KNOWN_REFUSALS[os.path.basename(path)] in err, err
    else:
        assert code == 0, err


@pytest.mark.parametrize("name, expected", [
    ("run_qwen3_8b_megatron.sh", ["actor_rollout_ref.actor.megatron.", "Megatron is not a backend here"]),
    ("run_mistral_nemo_12b_skyworkrm_fsdp.sh", ["reward.reward_model.enable=True", "reward.models"]),
    ("run_gpt_oss_20b_fsdp.sh", [R + "name=sglang", "vLLM is the only rollout engine here"]),
    ("run_qwen3_8b_fsdp.sh", ["ray_kwargs.ray_init.runtime_env.py_executable", "no Ray here"]),
])
def test_unmapped_keys_exit_2_naming_them_and_become_comments_with_allow_unmapped(name, expected, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    path = os.path.join(REPO, "tests", "fixtures", "verl", name)
    rc, out, err = convert([path], capsys)
    assert rc == 2 and out == "" and "have no equivalent here" in err
    for text in expected:
        assert text in err
    rc, out, err = convert([path, "--allow-unmapped"], capsys)
    assert rc == 0 and "# verl keys with no equivalent here (--allow-unmapped):" in out
    assert all(text in out for text in expected)


@pytest.mark.parametrize("override", ["algorithm.use_kl_in_reward=True", "reward_model.enable=True",
                                      "trainer.critic_warmup=5", A + "strategy=megatron"])
def test_no_effect_keys_at_another_value_are_unmapped(override, capsys):
    rc, _, err = convert(["--", override], capsys)
    assert rc == 2 and override in err and "has an equivalent here" in err


def test_hydra_flags_are_named_as_unmapped(capsys):
    rc, _, err = convert(["--", "--config-path=cfg", "--config-name=ppo_megatron_trainer", "data.train_batch_size=8",
                          A + "ppo_mini_batch_size=8"], capsys)
    assert rc == 2 and "--config-path=cfg" in err and "--config-name=ppo_megatron_trainer" in err and "Hydra" in err


def test_a_fully_mapped_script_exits_0_without_the_flag(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    rc, out, err = convert([os.path.join(REPO, "tests", "fixtures", "verl", "run_qwen2_5-3b_gsm8k_grpo_lora.sh")], capsys)
    assert rc == 0, err
    assert "no equivalent" not in out


# ----------------------------------------------------------------------------- hand-checked conversions


def test_lora_gsm8k_script_by_hand(capsys, monkeypatch):
    """verl's run_qwen2_5-3b_gsm8k_grpo_lora.sh: 16 prompts a step in mini-batches of 16 prompts -> 1
    mini-batch; its KL loss (low_var_kl, 0.001); LoRA 64/32; log-prob micro-batches 40 on both sides."""
    monkeypatch.setenv("HOME", "/home/user")
    cfg, text, err = yaml_of([os.path.join(REPO, "tests", "fixtures", "verl", "run_qwen2_5-3b_gsm8k_grpo_lora.sh")], capsys)
    assert cfg["trainer"]["prompts_per_step"] == 16 and cfg["algorithm"]["mini_batches"] == 1
    assert cfg["algorithm"]["kl_loss_coef"] == 0.001 and cfg["algorithm"]["kl_loss_type"] == "low_var_kl"
    assert cfg["lora"] == {"rank": 64, "alpha": 32.0}
    assert cfg["algorithm"]["micro_batch_size"] == 40 and cfg["algorithm"]["log_prob_micro_batch_size"] == 40
    assert cfg["data"]["train_files"] == ["/home/user/data/gsm8k/train.parquet"]
    assert cfg["data"]["truncation"] == "filter" and cfg["data"]["shuffle"] is False
    assert cfg["logging"]["trackers"] == ["wandb"] and cfg["logging"]["wandb"]["name"] == "qwen2.5_3b_grpo_lora"
    assert cfg["checkpoint"]["save_every"] == 20 and cfg["trainer"]["val_every"] == 5
    assert cfg["trainer"]["val_before_train"] is False and cfg["trainer"]["total_epochs"] == 15
    assert cfg["optim"] == {"lr": 3e-6, "weight_decay": 0.01}
    assert cfg["rollout"]["max_model_len"] == 512 + 1024 and cfg["rollout"]["max_response_length"] == 1024
    assert comment_of(text, "mini_batches") == "16 / actor_rollout_ref.actor.ppo_mini_batch_size=16"
    assert comment_of(text, "prompts_per_step") == "data.train_batch_size=16"
    assert "torchrun --nproc_per_node=2 train_grpo.py --config OUT.yaml" in err and "WANDB_MODE" in err


def test_qwen3_8b_on_npu_by_hand(capsys, monkeypatch):
    """verl's run_qwen3_8b_fsdp.sh with DEVICE=npu: its npu branch sets 16 prompts, mini-batch 16, Ulysses 4;
    the 24576-token per-GPU budgets become 4 x 24576 per Ulysses group; the launch names Ascend's variables."""
    cfg, text, err = yaml_of([os.path.join(REPO, "tests", "fixtures", "verl", "run_qwen3_8b_fsdp.sh"), "--allow-unmapped"],
                             capsys, env={"DEVICE": "npu", "HOME": "/h"}, monkeypatch=monkeypatch)
    assert cfg["parallel"]["device"] == "npu" and cfg["parallel"]["ulysses_size"] == 4
    assert cfg["trainer"]["prompts_per_step"] == 16 and cfg["algorithm"]["mini_batches"] == 1
    assert cfg["algorithm"]["micro_batch_tokens"] == 4 * 24576
    assert cfg["algorithm"]["log_prob_micro_batch_tokens"] == 4 * 24576
    assert cfg["algorithm"]["log_prob_micro_batch_size"] == 1 and cfg["algorithm"]["micro_batch_size"] == 1
    assert cfg["offload"] == {"params": True, "optimizer": True, "ref": True}
    assert cfg["rollout"]["tensor_parallel_size"] == 4 and cfg["rollout"]["sync_bucket_mb"] == 4096
    assert cfg["data"]["max_prompt_length"] == 2048 and cfg["rollout"]["max_response_length"] == 32768
    assert cfg["data"]["train_files"] == ["/h/data/gsm8k/train.parquet", "/h/data/math/train.parquet"]
    assert "per GPU x Ulysses 4" in comment_of(text, "micro_batch_tokens")
    assert "HCCL_CONNECT_TIMEOUT" in err and "--device npu" in err
    assert "the script exported: HCCL_CONNECT_TIMEOUT=1500" in err


def test_veomni_moe_script_by_hand(capsys, monkeypatch):
    """verl's run_qwen3_30b_veomni.sh: model_engine=veomni -> cosine (verl's optim/veomni.yaml), rollout
    expert parallelism 8 over data_parallel_size 8 x TP 1 -> vLLM's switch off (an engine here is one TP
    group; said), engine_kwargs nested, total_training_steps 100."""
    cfg, text, err = yaml_of([os.path.join(REPO, "tests", "fixtures", "verl", "run_qwen3_30b_veomni.sh"), "--allow-unmapped"],
                             capsys, env={"DEVICE": "gpu"}, monkeypatch=monkeypatch)
    assert cfg["optim"]["lr_schedule"] == "cosine" and "model_engine=veomni" in comment_of(text, "lr_schedule")
    assert cfg["trainer"]["total_steps"] == 100 and cfg["trainer"]["prompts_per_step"] == 16
    assert cfg["algorithm"]["mini_batches"] == 2 and cfg["checkpoint"]["save_every"] == 100
    assert cfg["rollout"]["enable_expert_parallel"] is False and cfg["rollout"]["enable_chunked_prefill"] is True
    assert "off at TP 1" in comment_of(text, "enable_expert_parallel") and "raise rollout.tensor_parallel_size" in err
    assert cfg["rollout"]["engine_kwargs"] == {"compilation_config": {"cudagraph_capture_sizes": [1, 8, 16, 32, 40, 48, 64, 96, 128, 256]},
                                               "mm_processor_cache_gb": 0}
    assert cfg["logging"]["trackers"] == [] and cfg["trainer"]["val_every"] == 0  # test_freq=-1: none
    assert "trainer.total_epochs" not in text  # total_training_steps given: epochs unused
    assert "actor_rollout_ref.actor.veomni.fsdp_size=-1" in text  # -1: every rank, said as a no-effect key


def test_epochs_become_steps_from_readable_files(tmp_path, capsys):
    """verl runs total_epochs x (rows // train_batch_size) steps (its dataloader drops the last partial batch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(50)))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"prompt": [str(i) for i in range(30)]}), parquet)
    base = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.total_epochs=3"]
    cfg, text, _ = yaml_of(["--", f"data.train_files=['{jsonl}','{parquet}']", *base], capsys)
    assert cfg["trainer"]["total_steps"] == 3 * (80 // 16) and "total_epochs" not in cfg["trainer"]
    assert comment_of(text, "total_steps") == "trainer.total_epochs=3 x (80 rows // 16) as verl counts"
    cfg, _, _ = yaml_of(["--", f"data.train_files={tmp_path / 'missing.jsonl'}", *base], capsys)
    assert cfg["trainer"]["total_epochs"] == 3 and "total_steps" not in cfg["trainer"]
    # warm-up in training steps (verl) -> optimizer steps (here): x ppo_epochs x mini_batches
    cfg, _, _ = yaml_of(["--", f"data.train_files={jsonl}", *base, A + "optim.lr_warmup_steps_ratio=0.2", A + "ppo_epochs=2"], capsys)
    assert cfg["optim"]["warmup_steps"] == int(0.2 * 9) * 2 * 2


# ----------------------------------------------------------------------------- single conversions


@pytest.mark.parametrize("verl, here", [("kl", "k1"), ("k1", "k1"), ("mse", "k2"), ("k2", "k2"), ("abs", "abs"),
                                        ("low_var_kl", "low_var_kl"), ("k3", "k3")])
def test_kl_aliases_as_verls_core_algos(verl, here, capsys):
    from rlcore import advantage

    cfg, _, _ = yaml_of(["--", A + "use_kl_loss=True", f"{A}kl_loss_type={verl}"], capsys)
    assert cfg["algorithm"]["kl_loss_type"] == here and here in advantage.KL_KINDS


def test_kl_full_and_use_kl_loss_false(capsys):
    rc, _, err = convert(["--", A + "use_kl_loss=True", A + "kl_loss_type=full"], capsys)
    assert rc == 2 and A + "kl_loss_type=full" in err
    cfg, text, _ = yaml_of(["--", A + "use_kl_loss=False", A + "kl_loss_coef=0.5"], capsys)
    assert cfg["algorithm"]["kl_loss_coef"] == 0.0 and "use_kl_loss=False" in comment_of(text, "kl_loss_coef")


def test_optimizer_warmup_and_schedule(capsys):
    base = ["data.train_batch_size=64", A + "ppo_mini_batch_size=16"]
    cfg, _, _ = yaml_of(["--", *base, A + "optim.lr_warmup_steps=10"], capsys)
    assert cfg["optim"]["warmup_steps"] == 40 and cfg["optim"]["weight_decay"] == 0.01
    assert "lr_schedule" not in cfg["optim"]  # verl's FSDP engine: constant, as here
    cfg, _, _ = yaml_of(["--", *base, "trainer.total_training_steps=100", A + "optim.lr_warmup_steps_ratio=0.1"], capsys)
    assert cfg["optim"]["warmup_steps"] == 10 * 4
    rc, _, err = convert(["--", *base, "data.train_files=/nowhere.parquet", A + "optim.lr_warmup_steps_ratio=0.1"], capsys)
    assert rc == 2 and "lr_warmup_steps_ratio" in err and "needs the step count" in err
    cfg, _, _ = yaml_of(["--", *base, "model_engine=veomni", A + "optim.lr_scheduler_type=constant", A + "optim.lr=1e-5",
                         A + "optim.lr_min=1e-6"], capsys)
    assert cfg["optim"]["lr_schedule"] == "constant" and cfg["optim"]["min_lr_ratio"] == pytest.approx(0.1)


def test_trackers_frequencies_and_launchers(capsys):
    cfg, _, err = yaml_of(["--", "trainer.logger=['console','mlflow','tensorboard']", "trainer.project_name=p",
                           "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.nnodes=2", "trainer.n_gpus_per_node=8"], capsys)
    assert cfg["logging"] == {"trackers": ["mlflow", "tensorboard"], "mlflow_experiment": "p"}
    assert cfg["checkpoint"]["save_every"] == -1 and cfg["trainer"]["val_every"] == 0
    assert "sbatch --nodes=2 --gpus-per-node=8 scripts/slurm/train_grpo.sbatch" in err and "WANDB" not in err
    rc, _, err = convert(["--", "trainer.logger=['console','swanlab']"], capsys)
    assert rc == 2 and "trainer.logger=swanlab" in err and "SwanLab" in err


def test_log_prob_sizes_take_the_smaller(capsys):
    cfg, text, _ = yaml_of(["--", R + "log_prob_micro_batch_size_per_gpu=8", REF + "log_prob_micro_batch_size_per_gpu=4"], capsys)
    assert cfg["algorithm"]["log_prob_micro_batch_size"] == 4 and "the smaller" in comment_of(text, "log_prob_micro_batch_size")


def test_engine_kwargs_nest_and_owned_ones_move_or_are_refused(capsys):
    cfg, _, _ = yaml_of(["--", f"+{R}engine_kwargs.vllm.max_model_len=4096", f"+{R}engine_kwargs.vllm.swap_space=4",
                         f"+{R}engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"], capsys)
    assert cfg["rollout"]["max_model_len"] == 4096
    assert cfg["rollout"]["engine_kwargs"] == {"swap_space": 4, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
    rc, _, err = convert(["--", f"+{R}engine_kwargs.vllm.seed=3"], capsys)
    assert rc == 2 and "engine_kwargs.vllm.seed=3" in err and "trainer.seed" in err


@pytest.mark.parametrize("override, key, value", [
    (verl_table.M + "trust_remote_code=True", "model.trust_remote_code", True),
    ("trainer.balance_batch=False", "trainer.balance_batch", False),
    (A + "fsdp_config.fsdp_size=8", "parallel.fsdp_size", 8),
    (R + "enable_chunked_prefill=False", "rollout.enable_chunked_prefill", False),
    (R + "expert_parallel_size=4", "rollout.enable_expert_parallel", True),  # verl's default TP 2
])
def test_the_keys_issue_58_adds(override, key, value, capsys):
    """Each maps to its key once that key is in this checkout, and is named as missing before."""
    rc, out, err = convert(["--", override], capsys)
    if key in from_verl.project_keys():
        import yaml

        section, name = key.split(".")
        assert rc == 0 and yaml.safe_load(out)[section][name] == value
    else:
        assert rc == 2 and f"{key} is not a key of this checkout yet" in err


# ----------------------------------------------------------------------------- the shell


def run_script(text: str, args=(), env=None):
    launches, shell = verl_shell.run(text, list(args), env if env is not None else {"HOME": "/home/u"})
    return launches[-1][1], shell


def test_shell_reading():
    script = r"""#!/bin/bash
set -x  # comments go
export VLLM_X=1
MODEL=${MODEL_PATH:-Qwen/Qwen3-8B}
tbs=$(( 64 * 2 ))
FLAGS="trainer.nnodes=1 \
    trainer.n_gpus_per_node=8"
ARR=(
    data.train_batch_size=${tbs}   # an array, with a comment
)
ARR+=("trainer.logger=['console','wandb']")
case "${DEVICE:-gpu}" in
    npu) ARR+=(trainer.device=npu) ;;
    gpu | cuda)
        ARR+=(trainer.device=cuda)
        ;;
esac
if [ "$MODE" = fast ]; then
    ARR+=(a=1)
elif [ -z "$MODE" ]; then
    ARR+=(actor_rollout_ref.rollout.n=5)
else
    exit 1
fi
python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path="$MODEL" \
    data.train_files=$HOME/data/train.parquet \
    'trainer.project_name=a b' \
    "${ARR[@]}" $FLAGS \
    $@ 2>&1 | tee log.txt
"""
    argv, shell = run_script(script, ["trainer.total_epochs=2"])
    assert argv == ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "data.train_files=/home/u/data/train.parquet",
                    "trainer.project_name=a b", "data.train_batch_size=128", "trainer.logger=['console','wandb']",
                    "trainer.device=cuda", "actor_rollout_ref.rollout.n=5", "trainer.nnodes=1",
                    "trainer.n_gpus_per_node=8", "trainer.total_epochs=2"]
    assert shell.exports == {"VLLM_X": "1"}
    argv, _ = run_script(script, env={"MODEL_PATH": "/m", "DEVICE": "npu", "MODE": "fast"})
    assert argv[0] == "actor_rollout_ref.model.path=/m" and "trainer.device=npu" in argv and "a=1" in argv


def test_shell_expansions():
    sh = verl_shell.Shell(["x"], {"E": "env", "EMPTY": ""})
    sh.vars.update({"V": "var", "L": ["a", "b"]})
    cases = {"${V}": "var", "$E": "env", "${E:-d}": "env", "${EMPTY:-d}": "d", "${EMPTY-d}": "", "${NO:=set}": "set",
             "${V:+alt}": "alt", "${NO2:+alt}": "", "$1": "x", "'$V'": "$V", '"$V-$E"': "var-env", "$((3 * (2 + 1) / 2))": "4",
             "${L[1]}": "b", "a\\ b": "a b"}
    for raw, want in cases.items():
        assert sh._expand_str(raw) == want, raw
    assert sh.vars["NO"] == "set"
    assert sh.expand('"${L[@]}"') == ["a", "b"] and sh.expand("$@") == ["x"]
    fallback = verl_shell.Shell([], {})._expand_str("$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)")
    assert fallback == "gpu"


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("argv, expected", [
    (["/no/such/script.sh"], "cannot read /no/such/script.sh"),
    (["--", "foo.bar=1"], "unknown key 'foo.bar'"),
    (["--", "actor_rollout_ref.rollout.n=abc"], "rollout.n takes a int value"),
    (["--", "trainer.logger"], "is not a verl override"),
    (["--", "data.train_batch_size=100", A + "ppo_mini_batch_size=64"], "not a multiple"),
    (["--", "data.train_files=[a, b"], "not a valid list"),
    ([], "give a verl launch script"),
    (["--", "trainer.n_gpus_per_node=eight"], "wrong type"),
    (["-o", "/no/such/dir/out.yaml", "--", "data.train_batch_size=8", A + "ppo_mini_batch_size=8"], "cannot write"),
])
def test_bad_overrides_exit_2_with_one_paragraph(argv, expected, capsys):
    rc, out, err = convert(argv, capsys)
    assert rc == 2 and out == "" and expected in err and err.startswith("from_verl.py: error:")


@pytest.mark.parametrize("text, expected", [
    ("#!/bin/bash\npython3 train.py a=1\n", "is not a verl command"),
    ("python3 -m verl.trainer.main_sft a=1\n", "not verl.trainer.main_ppo"),
    ("echo 'unbalanced\n", "could not be read"),
    ("python3 -m verl.trainer.main_ppo model=${M:?set M}\n", "M is not set"),
])
def test_bad_scripts_exit_2_without_a_traceback(text, expected, tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(text)
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "from_verl.py"), str(path)],
                       capture_output=True, text=True, env={**os.environ, "M": ""})
    assert p.returncode == 2 and expected in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_help_explains_it():
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "from_verl.py"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--allow-unmapped" in p.stdout and "examples:" in p.stdout and "docs/from_verl.md" in p.stdout


# ----------------------------------------------------------------------------- the doc's table


def doc_keys(section: str) -> set[str]:
    """verl keys (whole keys under one of verl's sections; a prefix ending in .* as the prefix) in the
    first column of the doc's table under the heading `section`."""
    text = open(os.path.join(REPO, "docs", "from_verl.md")).read()
    part = text.split(section, 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in part.splitlines():
        if line.startswith("| `"):
            for span in re.findall(r"`\+?([^`]+)`", line.split("|")[1]):
                key = re.split(r"[:\s]", span)[0].removesuffix(".*").removesuffix("*")
                if key.split(".")[0] in verl_table.VERL_SECTIONS:
                    keys.add(key)
    return keys


def test_the_doc_lists_every_key_the_converter_knows_and_no_other():
    mapped = doc_keys("## verl keys and their keys here")
    assert mapped == set(verl_table.MAPPED) | set(verl_table.NO_EFFECT), (
        mapped ^ (set(verl_table.MAPPED) | set(verl_table.NO_EFFECT)))
    unmapped = doc_keys("## verl keys with no equivalent")
    assert unmapped == {p.rstrip(".") for p in verl_table.UNMAPPED}, unmapped ^ {p.rstrip(".") for p in verl_table.UNMAPPED}
