"""Bad configurations and data files end the run before any model loads (or at the bad row), on
every rank, with one paragraph naming what is wrong and how to fix it, and exit code 2.

Most cases run in this process through the same two calls train_grpo.py makes before building
any engine (``parse_config``, then ``preflight``), so each costs milliseconds; a few go through the
real entry point, one of them under torchrun with 2 ranks (every rank must exit 2), with a probe
that proves no engine module (vllm, veomni) was even imported. tests/test_config_and_data.py runs
more cases through the entry point.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import QUIET_ENV, REPO
from workers.launch import rank_exit_codes

PROBE = os.path.join(REPO, "tests", "workers", "trainer_probe.py")


@pytest.fixture(scope="module")
def env(tiny_model, toy_data, tmp_path_factory):
    """Shared valid inputs plus every broken file the cases point at."""
    d = tmp_path_factory.mktemp("bad_inputs")
    good = open(toy_data[0]).read().splitlines()[:4]
    files = {
        "malformed": good + ["{not json"],
        "not_object": good + ["[1, 2, 3]"],
        "no_answer": good + [json.dumps({"prompt": "d 1 2 pick 1st ="})],
        "empty_prompt": good + [json.dumps({"prompt": "   ", "answer": "1"})],
        "null_prompt": good + [json.dumps({"prompt": None, "answer": "1"})],
        "number_prompt": good + [json.dumps({"prompt": 12, "answer": "1"})],
        "empty": [],
    }
    paths = {}
    for name, lines in files.items():
        paths[name] = str(d / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.write("\n".join(lines) + ("\n" if lines else ""))
    paths["not_utf8"] = str(d / "not_utf8.jsonl")
    with open(paths["not_utf8"], "wb") as f:
        f.write(("\n".join(good) + "\n").encode() + b'{"prompt": "d \xff\xfe", "answer": "1"}\n')
    (d / "a_folder.jsonl").mkdir()
    paths["folder"] = str(d / "a_folder.jsonl")
    from rlcore.demo.toy import make_tiny_moe_model

    paths["moe6"] = make_tiny_moe_model(str(d / "moe6"), num_experts=6)
    yaml = {"bad_yaml": "trainer: [unclosed\n", "unknown_key": "trainer:\n  totl_steps: 3\n",
            "wrong_type": "rollout:\n  n: eight\n"}
    for name, text in yaml.items():
        paths[name] = str(d / f"{name}.yaml")
        with open(paths[name], "w") as f:
            f.write(text)
    paths.update(_bad_models(d, tiny_model))
    paths.update(_bad_checkpoints(d))
    paths.update(_image_rows(d))
    (d / "a_file").write_text("x")
    paths["a_file"] = str(d / "a_file")
    paths["foreign_adapter"] = _foreign_adapter(d)
    paths["model"], paths["train"], paths["out"] = tiny_model, toy_data[0], str(d / "out")
    return paths


def _foreign_adapter(d) -> str:
    """A PEFT adapter folder whose q_proj takes 96 features (the tiny model's take 128)."""
    from safetensors.torch import save_file

    folder = d / "foreign_adapter"
    folder.mkdir()
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(8, 96), f"{name}.lora_B.weight": torch.zeros(128, 8)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                                            "peft_type": "LORA"}))
    return str(folder)


def _bad_models(d, tiny_model) -> dict:
    out = {}
    for name, keep in (("model_no_weights", lambda f: not f.endswith(".safetensors")),
                       ("model_no_tokenizer", lambda f: f in ("config.json", "model.safetensors")),
                       ("model_bad_config", lambda f: True)):
        folder = d / name
        folder.mkdir()
        for f in os.listdir(tiny_model):
            if keep(f):
                shutil.copy(os.path.join(tiny_model, f), folder / f)
        out[name] = str(folder)
    (d / "model_bad_config" / "config.json").write_text("{truncated")
    return out


def _image_rows(d) -> dict:
    """Image rows (shapes task style): a good file, one whose 3rd row's image is not there, one whose
    3rd row has two placeholders for one image; plus the tiny Qwen3-VL they are for (and a Qwen2.5-VL)."""
    from PIL import Image

    from rlcore.demo.vl import make_tiny_vl_model

    Image.new("RGB", (96, 96), (250, 250, 250)).save(d / "blank.png")
    good = {"prompt": "<image> how many shapes are there ?", "images": ["blank.png"], "answer": "0"}
    rows = {"vl_good": [good] * 4, "vl_missing_image": [good, good, {**good, "images": ["gone.png"]}],
            "vl_two_placeholders": [good, good, {**good, "prompt": "<image> <image> how many ?"}]}
    out = {}
    for name, lines in rows.items():
        out[name] = str(d / f"{name}.jsonl")
        with open(out[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    from rlcore import quiet

    with quiet.filtered_output():
        out["vl_model"] = make_tiny_vl_model(str(d / "tiny_vl"))
        out["vl25_model"] = make_tiny_vl_model(str(d / "tiny_vl25"), family="qwen2_5_vl")
    return out


def _bad_checkpoints(d) -> dict:
    (d / "not_a_checkpoint").mkdir()
    ckpt = d / "ckpt4" / "step_3"  # a complete-looking checkpoint written by 4 ranks
    (ckpt / "extra_state").mkdir(parents=True)
    from torch.distributed.checkpoint.metadata import Metadata

    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    for r in range(4):
        torch.save({"user": {}}, ckpt / "extra_state" / f"extra_state_rank_{r}.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "world_size": 4}))
    evil = d / "ckpt_evil" / "step_1"  # right world size, but its DCP metadata would run os.system
    (evil / "extra_state").mkdir(parents=True)
    for r in range(2):
        torch.save({"user": {}}, evil / "extra_state" / f"extra_state_rank_{r}.pt")
    (evil / ".metadata").write_bytes(pickle.dumps({"payload": os.system}))
    return {"not_a_checkpoint": str(d / "not_a_checkpoint"), "ckpt4": str(ckpt), "ckpt_evil": str(evil)}


def base_args(env) -> list[str]:
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", env["model"],
            "--data.train_files", json.dumps([env["train"]]), "--data.val_files", "[]",
            "--trainer.output_dir", env["out"]]


# (id, extra args with {placeholders} from env, text the message must contain, world size)
VL = ["--model.path", "{vl_model}", "--data.image_key", "images", "--data.apply_chat_template", "true",
      "--data.max_prompt_length", "40"]  # the tiny Qwen3-VL and its image rows
CASES = [
    # wrong types, unknown keys, broken config files
    ("type_cli", ["--rollout.n", "abc"], "rollout.n", 2),
    ("type_yaml", ["--config", "{wrong_type}"], "rollout.n", 2),
    ("unknown_key_cli", ["--trainer.totl_steps", "3"], "totl_steps", 2),
    ("unknown_key_yaml", ["--config", "{unknown_key}"], "totl_steps", 2),
    # accelerator settings, checked before any model loads (on this CPU host)
    ("flash_attention_on_cpu", ["--model.attn_implementation", "flash_attention_2"],
     "model.attn_implementation='flash_attention_2' is invalid", 2),
    ("direct_load_on_cpu", ["--rollout.weight_load", "direct"], "rollout.weight_load='direct' is invalid", 2),
    ("gpu_memory_utilization", ["--rollout.gpu_memory_utilization", "1.5"], "rollout.gpu_memory_utilization=1.5", 2),
    ("max_num_seqs", ["--rollout.max_num_seqs", "0"], "rollout.max_num_seqs=0", 2),
    ("max_num_batched_tokens", ["--rollout.max_num_batched_tokens", "16"], "rollout.max_num_batched_tokens=16", 2),
    ("micro_batch_tokens", ["--algorithm.micro_batch_tokens", "0"], "algorithm.micro_batch_tokens=0", 2),
    ("log_prob_micro_batch_size_zero", ["--algorithm.log_prob_micro_batch_size", "0"],
     "algorithm.log_prob_micro_batch_size=0 is invalid: it must be > 0", 2),
    ("log_prob_micro_batch_tokens_negative", ["--algorithm.log_prob_micro_batch_tokens", "-8"],
     "algorithm.log_prob_micro_batch_tokens=-8 is invalid: it must be > 0", 2),
    # demo_cpu.yaml: prompts up to 16 tokens, responses up to 4
    ("log_prob_micro_batch_tokens_below_a_sequence", ["--algorithm.log_prob_micro_batch_tokens", "19"],
     "algorithm.log_prob_micro_batch_tokens=19 is invalid: it must hold the longest sequence, [...] = 20 tokens; "
     "raise it to at least 20", 2),
    ("log_prob_micro_batch_tokens_below_a_conversation",
     ["--algorithm.log_prob_micro_batch_tokens", "40", "--rollout.multi_turn.enable", "true", "--tools",
      "[calculator]", "--rollout.multi_turn.max_total_tokens", "32"], "raise it to at least 48", 2),
    ("tis_cap", ["--rollout_correction.tis_cap", "0.5"], "rollout_correction.tis_cap=0.5", 2),
    ("rs_without_threshold", ["--rollout_correction.rs", "seq_mean_k3"], "rollout_correction.rs_threshold=None", 2),
    ("oversample_max", ["--algorithm.oversample_max", "0.5"], "algorithm.oversample_max=0.5", 2),
    ("entropy_target", ["--exploration.entropy_target", "-1"], "exploration.entropy_target=-1", 2),
    ("routing_replay_one_forward", ["--algorithm.routing_replay", "r2"], "algorithm.routing_replay='r2'", 2),
    ("routing_replay_dense", ["--algorithm.routing_replay", "r2", "--algorithm.ppo_epochs", "2"],
     "routing replay needs a mixture-of-experts model", 2),
    # r3 on this CPU host: vLLM's own validation refuses an engine that returns routed experts
    ("routing_replay_r3_on_cpu", ["--model.path", "{moe6}", "--algorithm.routing_replay", "r3"],
     "refuses that engine on this cpu machine: AuxOutput Connector requires Model Runner V2 [...] run R3 on CUDA GPUs, "
     "where vLLM's V2 model runner serves it, or on Ascend NPUs", 2),
    ("routing_replay_r3_multi_turn", ["--model.path", "{moe6}", "--algorithm.routing_replay", "r3",
                                      "--rollout.multi_turn.enable", "true", "--tools", "[calculator]",
                                      "--rollout.multi_turn.max_total_tokens", "32"],
     "use algorithm.routing_replay: r2 for", 2),
    # LoRA: checked against the model before it loads
    ("lora_unknown_target", ["--lora.rank", "8", "--lora.target_modules", "[qkv_proj]"],
     "lora.target_modules=['qkv_proj'] is invalid: use \"all-linear\" or a list of q_proj", 2),
    ("lora_rank_too_large", ["--lora.rank", "200"], "lora.rank=200 is invalid: it exceeds", 2),
    ("lora_on_moe", ["--lora.rank", "8", "--model.path", "{moe6}"], "LoRA on MoE policies is not supported yet", 2),
    ("lora_path_not_adapter", ["--lora.path", "{a_file}"], "is not a PEFT adapter folder", 2),
    ("lora_path_foreign", ["--lora.path", "{foreign_adapter}"], "was trained on another base model", 2),
    ("lora_strict_sync_check", ["--lora.rank", "8", "--rollout.check_sync", "strict"],
     "rollout.check_sync='strict' is invalid with LoRA", 2),
    ("lora_sleep_level_2", ["--lora.rank", "8", "--rollout.sleep_level", "2"], "rollout.sleep_level", 2),
    # mixture of experts
    ("ep_size_zero", ["--parallel.ep_size", "0"], "parallel.ep_size=0", 2),
    ("ep_not_dividing_world", ["--parallel.ep_size", "3"], "it must divide the world size 2", 2),
    ("ep_on_dense_model", ["--parallel.ep_size", "2"], "has no experts (a dense model)", 2),
    ("ep_not_dividing_experts", ["--model.path", "{moe6}", "--parallel.ep_size", "4"],
     "it must divide the model's 6 experts (e.g. 2)", 4),
    ("fused_moe_on_cpu", ["--model.moe_implementation", "triton"],
     "model.moe_implementation='triton' is invalid: triton is a fused GPU kernel", 2),
    ("eager_experts_with_ep", ["--model.path", "{moe6}", "--model.moe_implementation", "eager",
                               "--parallel.ep_size", "2"], "eager experts index the experts globally", 2),
    ("unknown_section", ["--trainerr.total_steps", "3"], "trainerr", 2),
    ("missing_config_file", ["--config", "/nonexistent/run.yaml"], "/nonexistent/run.yaml", 2),
    ("malformed_yaml", ["--config", "{bad_yaml}"], "bad_yaml.yaml) is not valid YAML", 2),
    ("bad_literal", ["--model.dtype", "float64"], "model.dtype", 2),
    # values out of range
    ("betas", ["--optim.betas", "[1.5, 0.999]"], "optim.betas=[1.5, 0.999]", 2),
    ("state_dtype_with_adamw", ["--optim.state_dtype", "float32"],
     "optim.state_dtype='float32' is invalid: it is an anyprecision_adamw option [...] set optim.optimizer: "
     "anyprecision_adamw, or leave optim.state_dtype unset", 2),
    ("kahan_with_adamw", ["--optim.kahan_summation", "false"], "optim.kahan_summation=False is invalid", 2),
    ("state_dtype_float16", ["--optim.optimizer", "anyprecision_adamw", "--optim.state_dtype", "float16"],
     "optim.state_dtype", 2),
    ("micro_batch_zero", ["--algorithm.micro_batch_size", "0"], "algorithm.micro_batch_size=0", 2),
    ("top_p", ["--rollout.top_p", "1.5"], "rollout.top_p=1.5", 2),
    ("keep_last_zero", ["--checkpoint.keep_last", "0"], "checkpoint.keep_last=0", 2),
    ("hf_every_negative", ["--checkpoint.hf_every", "-1"], "checkpoint.hf_every=-1", 2),
    ("hf_dtype", ["--checkpoint.hf_dtype", "int8"], "checkpoint.hf_dtype", 2),
    ("grace_zero", ["--trainer.preempt_grace_s", "0"], "trainer.preempt_grace_s=0", 2),
    ("skips_zero", ["--trainer.max_consecutive_skips", "0"], "trainer.max_consecutive_skips=0", 2),
    ("watchdog_negative", ["--trainer.watchdog_s", "-1"], "trainer.watchdog_s=-1", 2),
    ("total_epochs_zero", ["--trainer.total_epochs", "0"], "trainer.total_epochs=0 is invalid: it must be > 0", 2),
    ("save_every_below_never", ["--checkpoint.save_every", "-2"],
     "checkpoint.save_every=-2 is invalid: [...] or -1 (never save)", 2),
    # verl's keys (docs/from_verl.md): total_epochs resolves against the filtered prompts in preflight
    ("epochs_and_steps_disagree", ["--trainer.total_epochs", "1"],  # demo_cpu.yaml sets total_steps: 100
     "trainer.total_steps=100 is invalid: trainer.total_epochs=1 over the 200 training prompts at "
     "trainer.prompts_per_step=32 is 7 steps; set one of the two to null", 2),
    ("truncation_unknown", ["--data.truncation", "both"], "data.truncation", 2),
    ("chunked_prefill_on_cpu", ["--rollout.enable_chunked_prefill", "true"],
     "rollout.enable_chunked_prefill=True is invalid: vLLM's CPU runner cannot chunk a seeded prompt", 2),
    ("expert_parallel_on_cpu", ["--model.path", "{moe6}", "--rollout.tensor_parallel_size", "2",
                                "--rollout.enable_expert_parallel", "true"],
     "rollout.enable_expert_parallel=true is invalid on cpu: vLLM's CPU MoE kernel ignores the expert map", 2),
    ("engine_kwargs_owned", ["--rollout.engine_kwargs", "{{enable_sleep_mode: false}}"],
     "rollout.engine_kwargs.enable_sleep_mode=False is refused: the rollout sets enable_sleep_mode itself; the "
     "phase switch sleeps the engine while training: use rollout.sleep_level and rollout.free_kv_cache", 2),
    ("engine_kwargs_typo", ["--rollout.engine_kwargs", "{{max_logprob: 5}}"],
     "rollout.engine_kwargs.max_logprob is invalid: this vLLM's EngineArgs has no field 'max_logprob'; did you "
     "mean max_logprobs", 2),
    # against the world size
    ("ulysses_zero", ["--parallel.ulysses_size", "0"], "parallel.ulysses_size=0", 2),
    ("ulysses_not_dividing_world", ["--parallel.ulysses_size", "3"],
     "parallel.ulysses_size=3 is invalid: it must divide the world size 2", 2),
    ("ulysses_on_qwen2_5_vl", VL + ["--model.path", "{vl25_model}", "--data.train_files", "[{vl_good}]",
                                    "--parallel.ulysses_size", "2"],
     "a qwen2_5_vl policy under sequence parallelism is not supported", 2),
    ("fsdp_size_zero", ["--parallel.fsdp_size", "0"], "parallel.fsdp_size=0 is invalid: it must be >= 1", 2),
    ("fsdp_size_not_dividing_world", ["--parallel.fsdp_size", "3"],
     "parallel.fsdp_size=3 is invalid: it must divide the world size 2 (e.g. 1, 2; null = 2, plain FSDP)", 2),
    ("fsdp_size_under_ulysses", ["--parallel.ulysses_size", "2", "--parallel.fsdp_size", "1"],
     "parallel.fsdp_size=1 is invalid: it must be a multiple of parallel.ulysses_size 2 (e.g. 2)", 2),
    ("fsdp_size_under_ep", ["--model.path", "{moe6}", "--parallel.ep_size", "2", "--parallel.fsdp_size", "1"],
     "parallel.fsdp_size=1 is invalid: it must be a multiple of parallel.ep_size 2 (e.g. 2): VeOmni asserts", 2),
    ("tp_not_dividing_world", ["--rollout.tensor_parallel_size", "3"], "rollout.tensor_parallel_size=3", 2),
    ("prompts_not_divisible", ["--trainer.prompts_per_step", "3"], "trainer.prompts_per_step=3", 2),
    ("mini_batches_not_dividing", ["--algorithm.mini_batches", "3"], "algorithm.mini_batches=3", 2),
    ("tp_times_n_uneven", ["--rollout.tensor_parallel_size", "2", "--trainer.prompts_per_step", "1",
                           "--rollout.n", "3"], "rollout.n=3", 2),
    # lengths against the engine's context
    ("response_beyond_context", ["--rollout.max_response_length", "60"], "rollout.max_model_len=64", 2),
    ("context_beyond_model", ["--rollout.max_model_len", "1024"], "max_position_embeddings", 2),
    # model folder
    ("model_missing", ["--model.path", "/nonexistent/model"], "model.path='/nonexistent/model'", 2),
    ("model_no_safetensors", ["--model.path", "{model_no_weights}"], "safetensors", 2),
    ("model_no_tokenizer", ["--model.path", "{model_no_tokenizer}"], "no tokenizer", 2),
    ("model_bad_config_json", ["--model.path", "{model_bad_config}"], "config.json does not parse", 2),
    # data paths and files
    ("no_train_files", ["--data.train_files", "[]"], "data.train_files=[]", 2),
    ("train_file_missing", ["--data.train_files", "[/nonexistent.jsonl]"], "/nonexistent.jsonl", 2),
    ("val_file_missing", ["--data.val_files", "[/nonexistent_val.jsonl]"], "data.val_files", 2),
    ("train_file_is_folder", ["--data.train_files", "[{folder}]"], "a_folder.jsonl", 2),
    ("empty_file", ["--data.train_files", "[{empty}]"], "no usable prompt", 2),
    ("malformed_row", ["--data.train_files", "[{malformed}]"], "malformed.jsonl:5 is not valid JSON", 2),
    ("row_not_object", ["--data.train_files", "[{not_object}]"], "not_object.jsonl:5 is not an object", 2),
    ("row_without_answer", ["--data.train_files", "[{no_answer}]"], "no_answer.jsonl:5 lacks key(s) ['answer']", 2),
    ("empty_prompt", ["--data.train_files", "[{empty_prompt}]"], "empty_prompt.jsonl:5 has an empty 'prompt'", 2),
    ("null_prompt", ["--data.train_files", "[{null_prompt}]"], "null_prompt.jsonl:5 lacks key(s) ['prompt']", 2),
    ("number_prompt", ["--data.train_files", "[{number_prompt}]"], "number_prompt.jsonl:5 has a 'prompt' of type int", 2),
    ("not_utf8", ["--data.train_files", "[{not_utf8}]"], "not_utf8.jsonl:5 is not UTF-8 text", 2),
    ("prompt_key_absent", ["--data.prompt_key", "question"], "lacks key(s) ['question']", 2),
    ("all_prompts_too_long", ["--data.max_prompt_length", "4"], "no usable prompt", 2),
    ("too_long_is_error", ["--data.max_prompt_length", "4", "--data.truncation", "error"],
     "max_prompt_length=4", 2),
    # image prompts (vision-language models)
    ("images_on_text_model", ["--data.train_files", "[{vl_good}]", "--data.image_key", "images",
                              "--data.apply_chat_template", "true"], "is a text-only model (no vision_config", 2),
    ("image_missing", VL + ["--data.train_files", "[{vl_missing_image}]"],
     "vl_missing_image.jsonl:3 has a bad image 0 under 'images': image file", 2),
    ("image_placeholders", VL + ["--data.train_files", "[{vl_two_placeholders}]"],
     "vl_two_placeholders.jsonl:3 has 1 image(s) under 'images' but 2 '<image>' placeholder(s)", 2),
    ("image_limit_too_small", VL + ["--data.train_files", "[{vl_good}]", "--rollout.limit_mm_per_prompt",
                                    "{{image: 0}}"], "rollout.limit_mm_per_prompt={'image': 0} is too small", 2),
    ("truncation_cuts_images", VL + ["--data.train_files", "[{vl_good}]", "--data.truncation", "middle"],
     "data.truncation='middle' is invalid: with data.image_key='images' [...] set data.truncation: filter", 2),
    # reward, output folder, resume
    ("reward_fn_import", ["--reward.fn", "no_such_package.rewards:score", "--reward.components", "{{custom: 1.0}}"],
     "importing no_such_package.rewards failed", 2),
    ("reward_unknown_name", ["--reward.components", "{{nope: 1.0}}"], "reward.components='nope'", 2),
    # model-based rewards (reward.models): all refused before the policy loads
    ("judge_path_not_model", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {a_file}, kind: discriminative}}]"],
     "reward.models[0].path=", 2),
    ("judge_causal_lm_as_classifier", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {model}, kind: discriminative}}]"],
     "no sequence-classification or reward-model head", 2),
    ("judge_template_field_missing", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {model}, template: 'Rubric {{rubric}}: {{response}}'}}]"],
     "it names ['rubric'] but a data row has only ['answer', 'prompt']", 2),
    ("judge_parser_not_regex", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {model}, template: '{{response}}', parser: 'Score: ('}}]"],
     "reward.models[0].parser='Score: (' is invalid: it is not a valid regex", 2),
    ("judge_tp_not_policy_tp", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {model}, template: '{{response}}', tensor_parallel_size: 2}}]"],
     "must use the policy engine's TP size 1", 2),
    ("judge_unknown_key", ["--reward.components", "{{j: 1.0}}", "--reward.models", "[{{name: j, path: {model}, template: '{{response}}', parsr: x}}]"],
     "unknown keys; valid:", 2),
    ("judge_without_weight", ["--reward.models", "[{{name: j, path: {model}, template: '{{response}}'}}]"],
     "give each judge a weight in reward.components", 2),
    ("output_dir_is_file", ["--trainer.output_dir", "{a_file}"], "trainer.output_dir", 2),
    ("resume_path_missing", ["--checkpoint.resume", "/nonexistent/ckpt"], "no complete checkpoint", 2),
    ("resume_not_checkpoint", ["--checkpoint.resume", "{not_a_checkpoint}"], "no complete checkpoint", 2),
    ("resume_world_mismatch", ["--checkpoint.resume", "{ckpt4}"], "written by 4 ranks but this run has 2", 2),
    ("resume_foreign_pickle", ["--checkpoint.resume", "{ckpt_evil}"], "refusing to unpickle", 2),
]


def checks_exit_code(argv: list[str], world_size: int, rank: int = 0):
    """What train_grpo.main does up to the first engine: parse_config, then preflight."""
    import train_grpo
    from rlcore.run.ownership import release_output_dirs

    try:
        cfg = train_grpo.parse_config(argv)
        train_grpo.preflight(cfg, rank, world_size)
    except SystemExit as e:
        return e.code
    finally:
        release_output_dirs()  # the run's output_dir lock: later cases and subprocesses use the same folder
    return 0


def fill(args: list[str], env: dict) -> list[str]:
    return [a.format(**env) for a in args]


@pytest.mark.parametrize("case_id,extra,expected,world", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_before_any_model(env, capsys, case_id, extra, expected, world):
    code = checks_exit_code(base_args(env) + fill(extra, env), world)
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(part in err for part in expected.split(" [...] ")), err
    assert err.startswith("error: ") and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 3, err  # one paragraph, not a dump


@pytest.mark.unit
def test_every_case_is_distinct_and_the_valid_base_passes(env, capsys):
    assert len({c[0] for c in CASES}) == len(CASES) >= 40
    assert checks_exit_code(base_args(env), 2) == 0, capsys.readouterr().err


def run_probe(args: list[str], nproc: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """The real entry point (via a probe that reports engine imports at exit)."""
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    if nproc is None:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cmd = [sys.executable, PROBE, *args]
    else:
        # torchrun SIGTERMs the other ranks as soon as it sees one fail; polling every 5 s lets each
        # rank reach its own exit, so the test sees what every rank does by itself.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--monitor-interval=5", PROBE, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_entry_point_single_process_bad_row(env):
    proc = run_probe(base_args(env) + ["--data.train_files", json.dumps([env["not_utf8"]])])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "not_utf8.jsonl:5 is not UTF-8 text" in proc.stderr and "Traceback" not in proc.stderr
    assert "probe: rank 0 exit 2 engines_imported=[]" in proc.stderr, proc.stderr[-3000:]


def test_entry_point_two_ranks_every_rank_exits_2(env):
    expected = "trainer.prompts_per_step=3"
    proc = run_probe(base_args(env) + ["--trainer.prompts_per_step", "3"], nproc=2)
    out = proc.stdout + proc.stderr
    assert rank_exit_codes(out) == {0: 2, 1: 2}, out[-4000:]
    assert out.count("error: ") >= 2 and out.count(expected) >= 2, out[-4000:]
    for rank in (0, 1):
        assert f"probe: rank {rank} exit 2 engines_imported=[]" in out, out[-4000:]
    # torchrun's own failure report is the one traceback; the ranks print none.
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]


@pytest.mark.unit
def test_nothing_foreign_is_unpickled_by_the_trainer():
    """Static audit of the trainer's own code: every torch.load passes weights_only=True, and
    nothing calls pickle.load(s) or np.load(allow_pickle=True), but balance_batch's move of samples
    between the job's own ranks. (VeOmni and DCP unpickle the
    run's own checkpoint files; rlcore.run.checkpoint.verify_plain vets those first.)"""
    import glob
    import re

    files = [os.path.join(REPO, "train_grpo.py")] + glob.glob(os.path.join(REPO, "rlcore", "**", "*.py"), recursive=True) \
        + glob.glob(os.path.join(REPO, "scripts", "*.py"))
    calls = 0
    for path in files:
        text = open(path).read()
        for m in re.finditer(r"torch\.load\(", text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            assert "weights_only=True" in text[m.end():i], f"{path}: {text[m.start():i]}"
            calls += 1
        found = re.findall(r"pickle\.loads?\(|allow_pickle\s*=\s*True", text)
        # The one allowed: trainer.balance_batch's all-to-all unpickles what the job's own ranks sent
        # over its process group, the trust torch.distributed's all_gather_object extends; no file.
        assert found == (["pickle.loads("] if path.endswith(os.path.join("rlcore", "step", "balance.py")) else []), path
    assert calls >= 2  # the audit sees rlcore/run/checkpoint.py's loads
