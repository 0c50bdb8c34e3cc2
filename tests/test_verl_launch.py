"""The launch line scripts/from_verl.py prints runs as printed from any directory (issue 64, point 6).

verl's own examples/grpo_trainer/run_qwen3_8b_fsdp.sh is converted in one folder, with CPU-size
overrides passed as the script's arguments (its "$@": verl's way of overriding a script) and the
model and data paths pointing at the tests' tiny chat model and at rows written as verl's
examples/data_preprocess writes them (a ``prompt`` of chat messages, ``reward_model.ground_truth``,
``data_source``). The printed line is then run unchanged by bash in another folder, under the real
torchrun (a cold start: the launch itself is what is tested), and trains its one step there.
Not a unit test."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import QUIET_ENV, REPO

SCRIPT = os.path.join(REPO, "tests", "fixtures", "verl", "run_qwen3_8b_fsdp.sh")
A, R, REF = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."


def verl_rows(path: str, n: int) -> str:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them, on the tool demo's vocabulary."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "secret ?"}],
                                "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
                                "extra_info": {"split": "train", "index": i}}) + "\n")
    return path


def test_the_printed_launch_line_runs_from_another_folder(tmp_path):
    from rlcore.demo.tool import make_tool_model

    model = make_tool_model(str(tmp_path / "model"))
    train, val = verl_rows(str(tmp_path / "train.jsonl"), 16), verl_rows(str(tmp_path / "val.jsonl"), 4)
    cpu = [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
           "data.train_batch_size=4", A + "ppo_mini_batch_size=4", R + "n=2", "data.max_prompt_length=16",
           "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.n_gpus_per_node=1",
           "trainer.nnodes=1", "trainer.logger=['console']", "trainer.val_before_train=False", "trainer.test_freq=-1",
           "trainer.save_freq=-1", R + "tensor_model_parallel_size=1", R + "enable_chunked_prefill=False",
           R + "dtype=float32", A + "use_dynamic_bsz=False", A + "ppo_micro_batch_size_per_gpu=4",
           R + "log_prob_micro_batch_size_per_gpu=4", REF + "log_prob_micro_batch_size_per_gpu=4",
           A + "use_kl_loss=False", "trainer.default_local_dir=run"]
    convert_dir, run_dir = tmp_path / "convert_here", tmp_path / "run_here"
    convert_dir.mkdir()
    run_dir.mkdir()
    env = {**os.environ, **QUIET_ENV, "HOME": str(tmp_path), "DEVICE": "gpu"}
    env.pop("PYTHONPATH", None)
    conv = subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), os.path.join(REPO, "scripts", "from_verl.py"),
                           SCRIPT, "-o", "qwen3_8b.yaml", "--", *cpu], cwd=convert_dir, env=env, capture_output=True,
                          text=True, timeout=120)
    assert conv.returncode == 0, conv.stderr
    line = next(x for x in conv.stderr.splitlines() if "torchrun" in x).removeprefix("from_verl.py: ")
    assert str(convert_dir / "qwen3_8b.yaml") in line
    proc = subprocess.run(["bash", "-c", line], cwd=run_dir, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    with open(run_dir / "run" / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows if "actor/lr" in r] == [1]
    assert "step 1/1" in proc.stdout
