"""The shell reader of scripts/from_verl.py (rlcore/verl/shell.py, script.py): the bash constructs verl's
launch scripts use, read as bash reads them, and what it cannot read: exit 2 with the line and the
construct, never a traceback. In process (the unit set); tests/test_from_verl_cli.py runs UNREADABLE as a
user does."""

from __future__ import annotations

import pytest

from rlcore.verl import script as verl_script
from rlcore.verl.shell import Shell, ShellError
from test_from_verl import BASE, convert, script

pytestmark = pytest.mark.unit


def run_script(text: str, args=(), env=None):
    runner, shell = verl_script.run(text, list(args), env if env is not None else {"HOME": "/home/u"})
    return runner.launches[-1][1], shell


def test_shell_reading():
    text = r"""#!/bin/bash
set -x  # comments go
export VLLM_X=1
MODEL=${MODEL_PATH:-Qwen/Qwen3-8B}
tbs=$(( 64 * 2 ))
FLAGS="trainer.nnodes=1 \
    trainer.n_gpus_per_node=8"
ARR=(
    data.train_batch_size=${tbs}   # an array, with a comment that's got a quote
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
    "${@:2}" 2>&1 | tee log.txt
"""
    argv, shell = run_script(text, ["skipped", "trainer.total_epochs=2"])
    assert argv == ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "data.train_files=/home/u/data/train.parquet",
                    "trainer.project_name=a b", "data.train_batch_size=128", "trainer.logger=['console','wandb']",
                    "trainer.device=cuda", "actor_rollout_ref.rollout.n=5", "trainer.nnodes=1",
                    "trainer.n_gpus_per_node=8", "trainer.total_epochs=2"]
    assert shell.exports == {"VLLM_X": "1"}


def test_shell_expansions():
    sh = Shell(["x", "y", "z"], {"E": "env", "EMPTY": ""})
    sh.vars.update({"V": "var", "L": ["a", "b"], "P": "/data/gsm8k/train.parquet"})
    cases = {"${V}": "var", "$E": "env", "${E:-d}": "env", "${EMPTY:-d}": "d", "${EMPTY-d}": "", "${NO:=set}": "set",
             "${V:+alt}": "alt", "${NO2:+alt}": "", "$1": "x", "'$V'": "$V", '"$V-$E"': "var-env",
             "$((3 * (2 + 1) / 2))": "4", "${L[1]}": "b", "a\\ b": "a b", "${P//gsm8k/math}": "/data/math/train.parquet",
             "${P/a/A}": "/dAta/gsm8k/train.parquet", "${P##*/}": "train.parquet", "${P%.parquet}": "/data/gsm8k/train",
             "${P#/}": "data/gsm8k/train.parquet", "${V:1:1}": "a", "${V^^}": "VAR", "${#V}": "3"}
    for raw, want in cases.items():
        assert sh._expand_str(raw) == want, raw
    assert sh.vars["NO"] == "set"
    assert sh.expand('"${L[@]}"') == ["a", "b"] and sh.expand("$@") == ["x", "y", "z"]
    assert sh.expand('"${@:2}"') == ["y", "z"] and sh.expand("${@:2:1}") == ["y"]
    fallback = Shell([], {})._expand_str("$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)")
    assert fallback == "gpu"


def test_trailing_backslash_at_the_end_of_the_file():
    for tail in ("a=1 \\", "a=1 \\\n", "a=1 \\\n\n"):
        argv, _ = run_script("python3 -m verl.trainer.main_ppo \\\n    b=2 \\\n    " + tail)
        assert argv == ["b=2", "a=1"], tail


def test_division_by_a_variable_defined_later_is_bashs_error_with_its_line(tmp_path, capsys):
    path = script(tmp_path, "X=1\nmini=$(( 64 / per_gpu ))\nper_gpu=8\npython3 -m verl.trainer.main_ppo a=1\n")
    rc, _, err = convert([path], capsys)
    assert rc == 2 and "line 3:" in err and "division by 0" in err and "per_gpu" in err


UNREADABLE = [  # (script, what the error says); also run as a user does in tests/test_from_verl_cli.py
    ("ARR=(\n  a=1\n  b='2\n)\npython3 -m verl.trainer.main_ppo a=1\n", "line 2"),
    ("x=${V/}\npython3 -m verl.trainer.main_ppo a=$(( 1 +* ))\n", "line 3"),
    ("echo 'unbalanced\n", "single quote"),
    ("python3 -m verl.trainer.main_ppo model=${M:?set M}\n", "M is not set"),
    ("if [ 1 = 1 ]; then\n  echo\n", "'if' without 'fi'"),
    ("#!/bin/bash\npython3 train.py a=1\n", "starts no verl training"),
    ("python3 -m verl.trainer.main_sft a=1\n", "not a GRPO-family trainer"),
]


@pytest.mark.parametrize("body, expected", UNREADABLE)
def test_unreadable_scripts_exit_2_with_the_line_and_the_construct(body, expected, tmp_path, capsys, monkeypatch):
    """In process: an exception escaping cli.main would fail the test (no traceback is possible)."""
    rc, out, err = convert([script(tmp_path, body)], capsys, env={"M": ""}, monkeypatch=monkeypatch)
    assert rc == 2 and out == "" and expected in err and err.startswith("from_verl.py: error:"), err


def test_an_empty_variable_where_an_integer_is_needed_names_the_key_and_the_variable(tmp_path, capsys):
    path = script(tmp_path, "NNODES=\npython3 -m verl.trainer.main_ppo " + " ".join(BASE) + " trainer.nnodes=${NNODES}\n")
    rc, _, err = convert([path], capsys)
    assert rc == 2 and "trainer.nnodes is empty" in err and "NNODES" in err and "invalid literal" not in err
