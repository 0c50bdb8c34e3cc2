"""Conversion rules for the run around the algorithm: the engine, batch sizes and lengths, data,
rollout, steps, logging, checkpoints and the launcher (rlcore/verl/rules_train.py: the algorithm).

Each rule names the verl keys it converts and what they become (docs/from_verl.md's table).
verl's semantics, checked against verl 1dda039, are in the comments that say why.
"""

from __future__ import annotations

import re

from rlcore.verl.keys import A, M, R, REF
from rlcore.verl.rules import rule
from rlcore.verl.values import BadInput, count_rows

ENGINES = {"dp": None, "fsdp": None, "fsdp2": None, "fsdp_turbo": None, "veomni": None,
           "megatron": "Megatron-Core is not a backend here: VeOmni's FSDP2 trains the model (another engine's "
                       "numerics and parallel layout); the run would not be verl's Megatron run",
           "torchtitan": "TorchTitan is not a backend here: VeOmni's FSDP2 trains the model"}


@rule({"model_engine": ("(the engine's defaults)", "dp / fsdp and veomni: verl's defaults of that engine (veomni: a "
                        "cosine schedule); megatron / torchtitan: unmapped"),
       A + "model_engine": ("(the engine's defaults)", "as model_engine"),
       A + "strategy": ("(VeOmni's FSDP2)", "fsdp / fsdp2 / fsdp_turbo / veomni / dp: VeOmni's FSDP2 trains here; "
                        "megatron (also ppo_megatron_trainer's default): unmapped")})
def model_engine(c):
    """The training engine: given by model_engine (Hydra's defaults group) or the actor's strategy,
    or by the config --config-name selects (ppo_megatron_trainer: strategy megatron)."""
    decided = False
    for key in ("model_engine", A + "model_engine", A + "strategy"):
        engine = c.get(key) if c.given(key) or key == A + "strategy" else None
        if engine is None or (key == A + "strategy" and not c.given(key) and decided):
            continue
        decided = decided or c.given(key)
        reason = ENGINES.get(engine, f"no engine {engine!r} here: VeOmni's FSDP2")
        if engine in ("fsdp2", "fsdp_turbo"):
            reason = None
        if reason:
            c.refuse(key, reason)
        else:
            c.ignore(key, f"{engine}: VeOmni's FSDP2 trains the model here")


@rule({R + "name": ("(vLLM)", "the rollout engine: vLLM here; sglang / trtllm sample the same policy with the "
                    "same settings (no effect on what is trained, kernel-level numerics aside)")})
def rollout_name(c):
    name = c.get(R + "name", "vllm")
    if name not in ("vllm", "???"):
        c.ignore(R + "name", f"{name}: vLLM samples here, from the same policy with the same sampling settings "
                 "(kernel-level numerics differ between any two engines)")


@rule({"data.train_batch_size": ("trainer.prompts_per_step", "prompts per step (verl counts prompts too; n samples each)"),
       A + "ppo_mini_batch_size": ("algorithm.mini_batches", "verl counts prompts per mini-batch; here mini-batches per "
                                   "step = train_batch_size / ppo_mini_batch_size")})
def batch(c):
    tbs, mini = c.integer("data.train_batch_size"), c.integer(A + "ppo_mini_batch_size")
    if tbs <= 0:
        c.refuse("data.train_batch_size", "a step without a prompt count (verl's fully asynchronous trainer counts "
                                          "rollout steps instead)")
        return
    if mini <= 0 or tbs % mini:
        raise BadInput(f"data.train_batch_size={tbs} is not a multiple of {A}ppo_mini_batch_size={mini} (verl refuses "
                       "this too): make the mini-batch divide the batch")
    c.put("trainer.prompts_per_step", tbs, c.said("data.train_batch_size"), "data.train_batch_size")
    c.put("algorithm.mini_batches", tbs // mini, f"{tbs} / {c.said(A + 'ppo_mini_batch_size')}", A + "ppo_mini_batch_size")


def ulysses(c) -> int:
    for key in (A + "ulysses_sequence_parallel_size", A + "fsdp_config.ulysses_sequence_parallel_size",
                A + "veomni.ulysses_parallel_size"):
        if c.given(key) and (c.integer(key) or 1) > 1:
            return c.integer(key)
    return 1


def data_parallel(c) -> int:
    """verl's data-parallel size: every rank of every node, over the Ulysses group."""
    return max(c.integer("trainer.n_gpus_per_node") * c.integer("trainer.nnodes") // ulysses(c), 1)


@rule({A + "use_dynamic_bsz": ("algorithm.micro_batch_tokens", "True: token-budget micro-batches (with "
                               "ppo_max_token_len_per_gpu)"),
       A + "ppo_max_token_len_per_gpu": ("algorithm.micro_batch_tokens", "per GPU in verl, per Ulysses group here: x "
                                         "parallel.ulysses_size"),
       A + "ppo_micro_batch_size": ("algorithm.micro_batch_size", "verl's deprecated global size: divided by the "
                                    "data-parallel size, as verl does")})
def micro_batches(c):
    if c.get(A + "use_dynamic_bsz"):
        per_gpu, u = c.integer(A + "ppo_max_token_len_per_gpu"), ulysses(c)
        c.put("algorithm.micro_batch_tokens", per_gpu * u, f"{c.said(A + 'ppo_max_token_len_per_gpu')} per GPU x "
              f"Ulysses {u}", A + "ppo_max_token_len_per_gpu")
    elif c.given(A + "ppo_max_token_len_per_gpu"):
        c.ignore(A + "ppo_max_token_len_per_gpu", "used by verl only with use_dynamic_bsz=True")
    if c.get(A + "ppo_micro_batch_size") is not None and not c.given(A + "ppo_micro_batch_size_per_gpu"):
        dp = data_parallel(c)
        c.put("algorithm.micro_batch_size", max(c.integer(A + "ppo_micro_batch_size") // dp, 1),
              f"{c.said(A + 'ppo_micro_batch_size')} / {dp} data-parallel ranks", A + "ppo_micro_batch_size")


@rule({R + "log_prob_micro_batch_size_per_gpu": ("algorithm.log_prob_micro_batch_size", "sequences per no-gradient "
                                                 "forward; one size here for the old-policy and reference forwards: "
                                                 "the smaller of the two"),
       REF + "log_prob_micro_batch_size_per_gpu": ("algorithm.log_prob_micro_batch_size", "as the rollout's"),
       R + "log_prob_micro_batch_size": ("algorithm.log_prob_micro_batch_size", "verl's deprecated global size: "
                                         "divided by the data-parallel size"),
       REF + "log_prob_micro_batch_size": ("algorithm.log_prob_micro_batch_size", "as the rollout's"),
       R + "log_prob_use_dynamic_bsz": ("algorithm.log_prob_micro_batch_tokens", "True (verl's default: "
                                        "actor.use_dynamic_bsz): token-budget log-prob forwards"),
       REF + "log_prob_use_dynamic_bsz": ("algorithm.log_prob_micro_batch_tokens", "as the rollout's"),
       R + "log_prob_max_token_len_per_gpu": ("algorithm.log_prob_micro_batch_tokens", "per GPU in verl (default: "
                                              "actor.ppo_max_token_len_per_gpu), per Ulysses group here"),
       REF + "log_prob_max_token_len_per_gpu": ("algorithm.log_prob_micro_batch_tokens", "as the rollout's; the "
                                                "smaller of the two")})
def log_prob(c):
    sizes, dp = [], None
    for p in (R, REF):
        if c.get(p + "log_prob_micro_batch_size_per_gpu") is not None:
            sizes.append((p + "log_prob_micro_batch_size_per_gpu", c.integer(p + "log_prob_micro_batch_size_per_gpu"), ""))
        elif c.get(p + "log_prob_micro_batch_size") is not None:
            dp = dp or data_parallel(c)
            sizes.append((p + "log_prob_micro_batch_size", max(c.integer(p + "log_prob_micro_batch_size") // dp, 1),
                          f" / {dp} data-parallel ranks"))
    if sizes:
        key, size, how = min(sizes, key=lambda s: s[1])
        note = " (the smaller of rollout's and ref's)" if len({s[1] for s in sizes}) > 1 else ""
        c.put("algorithm.log_prob_micro_batch_size", size, " and ".join(c.said(k) + h for k, _, h in sizes) + note, key)
    budgets = [(p + "log_prob_max_token_len_per_gpu", c.integer(p + "log_prob_max_token_len_per_gpu"))
               for p in (R, REF) if c.get(p + "log_prob_use_dynamic_bsz")]
    if budgets:
        key, per_gpu = min(budgets, key=lambda b: b[1])
        u = ulysses(c)
        c.put("algorithm.log_prob_micro_batch_tokens", per_gpu * u,
              f"{c.said(key)} per GPU x Ulysses {u} ({c.said(key.replace('max_token_len_per_gpu', 'use_dynamic_bsz'))})", key)


@rule({"data.truncation": ("data.truncation", "error / left / right / middle as in verl"),
       "data.filter_overlong_prompts": ("data.truncation", "True: filter (verl filters before it truncates)")})
def truncation(c):
    filt, trunc = c.get("data.filter_overlong_prompts"), c.get("data.truncation", "error")
    if filt:
        c.put("data.truncation", "filter", f"{c.said('data.filter_overlong_prompts')} (filtered before data.truncation="
              f"{trunc} could apply)", "data.filter_overlong_prompts")
    elif trunc in ("error", "left", "right", "middle"):
        c.put("data.truncation", trunc, c.said("data.truncation"), "data.truncation")
    else:
        c.refuse("data.truncation", "left, right, middle or error")


@rule({"data.max_prompt_length": ("data.max_prompt_length", "prompt tokens at most"),
       "data.max_response_length": ("rollout.max_response_length", "response tokens; rollout.max_model_len = prompt + "
                                    "response unless given"),
       R + "prompt_length": ("data.max_prompt_length", "the rollout's prompt budget (verl's default: "
                             "data.max_prompt_length); one budget here"),
       R + "response_length": ("rollout.max_response_length", "the rollout's response budget (verl's default: "
                               "data.max_response_length): what vLLM samples up to"),
       R + "max_model_len": ("rollout.max_model_len", "vLLM's context length (verl's null: prompt + response)")})
def lengths(c):
    p, r = c.integer(R + "prompt_length"), c.integer(R + "response_length")
    if p != c.integer("data.max_prompt_length"):
        c.note(f"{R}prompt_length={p} differs from data.max_prompt_length={c.integer('data.max_prompt_length')}: "
               f"verl filters prompts by the data's and generates from the rollout's; one budget here (the rollout's)")
    for value, key, data_key, target in ((p, R + "prompt_length", "data.max_prompt_length", "data.max_prompt_length"),
                                         (r, R + "response_length", "data.max_response_length",
                                          "rollout.max_response_length")):
        source = key if c.given(key) else data_key  # the rollout's budget defaults to the data's
        c.put(target, value, c.said(source), source)
    if c.get(R + "max_model_len") is not None:
        c.put("rollout.max_model_len", c.integer(R + "max_model_len"), c.said(R + "max_model_len"), R + "max_model_len")
    else:
        c.put("rollout.max_model_len", p + r, "prompt + response budgets (verl's max_model_len null)", R + "max_model_len")


@rule({"trainer.total_epochs": ("trainer.total_steps", "epochs x (rows // train_batch_size), verl's count, when the "
                                "training files are readable here; else trainer.total_epochs"),
       "trainer.total_training_steps": ("trainer.total_steps", "training steps (wins over total_epochs, as in verl)")})
def steps(c):
    c.total_steps = None
    if c.get("trainer.total_training_steps") is not None:
        c.total_steps = c.integer("trainer.total_training_steps")
        c.put("trainer.total_steps", c.total_steps, c.said("trainer.total_training_steps"), "trainer.total_training_steps")
        if c.given("trainer.total_epochs"):
            c.ignore("trainer.total_epochs", "total_training_steps wins over it in verl")
        return
    epochs, rows = c.integer("trainer.total_epochs"), count_rows(c.get("data.train_files"))
    tbs = c.integer("data.train_batch_size")
    if rows is not None and tbs > 0 and rows // tbs > 0:
        c.total_steps = epochs * (rows // tbs)
        c.put("trainer.total_steps", c.total_steps, f"{c.said('trainer.total_epochs')} x ({rows} rows // {tbs}) as verl "
              "counts", "trainer.total_epochs")
    else:
        c.put("trainer.total_epochs", epochs, c.said("trainer.total_epochs") + " (training files not readable here: "
              "steps are counted at start-up)", "trainer.total_epochs")


TRACKERS = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
ALWAYS = {"console": "console is always on here", "file": "metrics.jsonl in trainer.output_dir is always written here"}


@rule({"trainer.logger": ("logging.trackers", "console and file are always on here; wandb, mlflow, tensorboard; "
                          "swanlab unmapped"),
       "trainer.project_name": ("logging.wandb.project", "also logging.mlflow_experiment with mlflow"),
       "trainer.experiment_name": ("logging.wandb.name", "the run's name")})
def trackers(c):
    loggers = c.get("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    chosen, unknown = [TRACKERS[n] for n in loggers if n in TRACKERS], [n for n in loggers if n not in TRACKERS | ALWAYS]
    for name in unknown:  # a tracker only logs: no effect on training, but the user loses its records
        c.ignore("trainer.logger", f"{name}: no such tracker here yet (rlcore/trackers.py's registry takes one); "
                 "metrics.jsonl and the other trackers hold the run's metrics")
    always = "; ".join(ALWAYS[n] for n in loggers if n in ALWAYS)
    c.put("logging.trackers", chosen, c.said("trainer.logger") + (f" ({always})" if always else ""), "trainer.logger")
    project, name = c.get("trainer.project_name"), c.get("trainer.experiment_name")
    if "wandb" in chosen:
        c.put("logging.wandb.project", project, c.said("trainer.project_name"), "trainer.project_name")
        c.put("logging.wandb.name", name, c.said("trainer.experiment_name"), "trainer.experiment_name")
    if "mlflow" in chosen:
        c.put("logging.mlflow_experiment", project, c.said("trainer.project_name"), "trainer.project_name")


@rule({"trainer.default_local_dir": ("trainer.output_dir", "checkpoints and logs; verl's default "
                                     "checkpoints/{project_name}/{experiment_name} is written when unset, so two "
                                     "scripts never share a folder")})
def output_dir(c):
    path = c.get("trainer.default_local_dir")
    if not path:  # an empty variable: verl's own default then
        path = f"checkpoints/{c.get('trainer.project_name')}/{c.get('trainer.experiment_name')}"
    c.put("trainer.output_dir", path, c.said("trainer.default_local_dir"), "trainer.default_local_dir")


@rule({"trainer.save_freq": ("checkpoint.save_every", "steps between checkpoints; -1 (verl's default) never"),
       "trainer.test_freq": ("trainer.val_every", "steps between validations; -1 -> 0 (none)"),
       "trainer.val_before_train": ("trainer.val_before_train", "verl's default True is written when there are val files"),
       "trainer.balance_batch": ("trainer.balance_batch", "reorder samples so ranks get even token counts; verl's "
                                 "default True is written when unset")})
def frequencies(c):
    save = c.integer("trainer.save_freq")
    c.put("checkpoint.save_every", -1 if save < 0 else save, c.said("trainer.save_freq"), "trainer.save_freq")
    test = c.integer("trainer.test_freq")
    c.put("trainer.val_every", max(test, 0), c.said("trainer.test_freq"), "trainer.test_freq")
    if c.get("data.val_files") or c.given("trainer.val_before_train"):
        c.put("trainer.val_before_train", bool(c.get("trainer.val_before_train")), c.said("trainer.val_before_train"),
              "trainer.val_before_train")
    c.put("trainer.balance_batch", bool(c.get("trainer.balance_batch")), c.said("trainer.balance_batch"),
          "trainer.balance_batch")


@rule({"trainer.resume_mode": ("checkpoint.resume", "auto -> auto, disable -> never, resume_path -> "
                               "trainer.resume_from_path"),
       "trainer.resume_from_path": ("checkpoint.resume", "a checkpoint folder")})
def resume(c):
    mode = c.get("trainer.resume_mode", "auto")
    target = {"auto": "auto", "disable": "never"}.get(mode) or c.get("trainer.resume_from_path")
    if not target:
        raise BadInput(f"trainer.resume_mode={mode} needs trainer.resume_from_path (a checkpoint folder)")
    c.put("checkpoint.resume", target, c.said("trainer.resume_mode"), "trainer.resume_mode")


@rule({R + "expert_parallel_size": ("rollout.enable_expert_parallel", "> 1: vLLM's expert parallelism over its TP "
                                    "group (verl's vllm_async_server: enable_expert_parallel = size > 1)")})
def expert_parallel(c):
    if not c.given(R + "expert_parallel_size"):
        return
    size, tp = c.integer(R + "expert_parallel_size"), c.integer(R + "tensor_model_parallel_size")
    # verl spreads vLLM's EP over data-parallel x TP ranks of one engine (rollout.py:292); an engine
    # here is one TP group, so its EP spans tensor_parallel_size ranks and is off at TP 1.
    on = size > 1 and tp > 1
    if size > 1 and not on:
        c.note(f"{R}expert_parallel_size={size} with tensor_model_parallel_size=1: an engine here is one TP group, so "
               "vLLM's expert parallelism stays off (each engine holds every expert); raise rollout.tensor_parallel_size "
               "to shard the experts over an engine's ranks")
    c.put("rollout.enable_expert_parallel", on, c.said(R + "expert_parallel_size")
          + ("" if on or size <= 1 else " (off at TP 1: each engine is one TP group here)"), R + "expert_parallel_size")


@rule({A + "fsdp_config.fsdp_size": ("parallel.fsdp_size", "HSDP shard group size; -1 = all ranks (left out)"),
       A + "veomni.fsdp_size": ("parallel.fsdp_size", "HSDP shard group size; -1 = all ranks (left out)")})
def fsdp_size(c):
    for key in (A + "fsdp_config.fsdp_size", A + "veomni.fsdp_size"):
        if c.given(key) and c.integer(key) > 0:
            c.put("parallel.fsdp_size", c.integer(key), c.said(key), key)
        elif c.given(key):
            c.ignore(key, "-1: shard over every rank, as here by default")


@rule({A + "veomni.attn_implementation": ("model.attn_implementation", "training attention kernel")})
def attention(c):
    name = c.get(A + "veomni.attn_implementation") if c.given(A + "veomni.attn_implementation") else None
    if name is None:
        return
    # verl's VeOmni engine names its kernels veomni_flash_attention_N[_with_sp] (Ulysses is parallel.ulysses_size here)
    plain = str(name).removeprefix("veomni_").removesuffix("_with_sp")
    key = A + "veomni.attn_implementation"
    if plain.startswith("flash_attention"):  # auto: the first flash kernel that imports on CUDA, torch_npu's on NPU
        c.put("model.attn_implementation", "auto", c.said(key) + " (auto picks the flash kernel the machine has)", key)
    elif plain in ("sdpa", "eager"):
        c.put("model.attn_implementation", plain, c.said(key), key)
    else:
        c.refuse(key, "no such attention kernel here (auto, sdpa, eager, flash_attention_2/_3/_4)")


@rule({"trainer.n_gpus_per_node": ("torchrun --nproc_per_node", "a launcher flag here, not a config key"),
       "trainer.nnodes": ("sbatch --nodes", "a launcher flag here (scripts/slurm/train_grpo.sbatch)"),
       "trainer.device": ("parallel.device", "cuda or npu (also inferred from the script's Ascend variables)")})
def launcher(c):
    c.gpus, c.nodes = c.integer("trainer.n_gpus_per_node"), c.integer("trainer.nnodes")
    device = c.get("trainer.device")
    if c.given("trainer.device") and device not in ("cuda", "npu"):
        c.refuse("trainer.device", "cuda or npu (cpu is for this project's tests and demo)")


@rule({M + "trust_remote_code": ("model.trust_remote_code", "load the model folder's own modeling code"),
       "data.trust_remote_code": ("model.trust_remote_code", "one switch here for the tokenizer, VeOmni and vLLM")})
def remote_code(c):
    keys = [k for k in (M + "trust_remote_code", "data.trust_remote_code") if c.get(k)]
    if keys:
        c.put("model.trust_remote_code", True, " and ".join(c.said(k) for k in keys), keys[0])


VL_NAME = re.compile(r"(?i)(-vl\b|_vl\b|\bvl-|-vl-|vl[_-]?\d|minicpm-o|glm-?4\.1v|glm-4v|qwen2-vl|qwen2\.5-vl)")


@rule({"data.image_key": ("data.image_key", "row key of the images (verl's default images), written for a "
                          "vision-language run")})
def images(c):
    """verl reads images from every row's ``images`` (data.image_key) when the model takes them; here
    the key is set for a vision-language run only (a text model with it set would refuse its rows)."""
    vl = c.given("data.image_key") or c.given(A + "freeze_vision_tower") or VL_NAME.search(str(c.get(M + "path", "")))
    if vl:
        c.put("data.image_key", c.get("data.image_key", "images"), c.said("data.image_key") + " (a vision-language "
              "run)" if not c.given("data.image_key") else c.said("data.image_key"), "data.image_key")


@rule({R + "engine_kwargs.vllm.*": ("rollout.engine_kwargs", "+...engine_kwargs.vllm.X=v: free-form vLLM arguments "
                                    "{X: v}; the ones the rollout sets itself move to their key")})
def engine_kwargs(c):
    kwargs, said = {}, []
    for key, (value, text) in c.v.items():
        if key.startswith(R + "engine_kwargs.vllm."):
            node = kwargs
            *path, leaf = key[len(R + "engine_kwargs.vllm."):].split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
            said.append(f"{key[len(R + 'engine_kwargs.'):]}={text}")
    kwargs = owned_engine_kwargs(c, kwargs)
    if kwargs:
        c.put("rollout.engine_kwargs", kwargs, "+actor_rollout_ref.rollout.engine_kwargs." + ", ".join(said),
              R + "engine_kwargs.vllm")


def owned_engine_kwargs(c, kwargs: dict) -> dict:
    """vLLM arguments the rollout owns move to their key (rlcore/rollout/engine_keys.py OWNED: "use rollout.X"),
    or are unmapped with its reason; vLLM's renamed ones take their new name."""
    from rlcore.rollout.engine_keys import OWNED

    if "disable_mm_preprocessor_cache" in kwargs:  # vLLM 0.10 replaced it by mm_processor_cache_gb=0
        if kwargs.pop("disable_mm_preprocessor_cache"):
            kwargs["mm_processor_cache_gb"] = 0
            c.note("engine_kwargs.vllm.disable_mm_preprocessor_cache=True -> mm_processor_cache_gb=0 "
                   "(vLLM's replacement; the old name is gone from vllm 0.32's EngineArgs)")
    for name in [n for n in kwargs if n in OWNED]:
        value, why, verl_key = kwargs.pop(name), OWNED[name], R + "engine_kwargs.vllm." + name
        target = why[4:] if why.startswith("use rollout.") and " " not in why[4:] else None
        if target and c.given(R + name):
            c.note(f"+{verl_key} ignored: {R + name} sets {target}")
        elif target:  # over a value derived here (max_model_len = prompt + response)
            c.put(target, value, f"+{verl_key}={c.v[verl_key][1]}", verl_key)
        else:
            c.refuse(verl_key, f"the rollout sets {name} itself: {why}")
    return kwargs


@rule({R + "dtype": ("rollout.dtype", "vLLM's dtype: bfloat16 (verl's default) or float32; float16 unmapped")})
def rollout_dtype(c):
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(c.get(R + "dtype"), c.get(R + "dtype"))
    if dtype in ("bfloat16", "float32"):
        c.put("rollout.dtype", dtype, c.said(R + "dtype"), R + "dtype")
    else:
        c.refuse(R + "dtype", "vLLM samples in bfloat16 or float32 here (another dtype: other numerics)")


@rule({R + "val_kwargs.n": ("val.n", "validation samples per prompt (here besides the greedy pass@1)"),
       R + "val_kwargs.temperature": ("val.temperature", "validation temperature (of the n samples)"),
       R + "val_kwargs.top_p": ("val.top_p", "validation top-p (of the n samples)"),
       R + "val_kwargs.do_sample": ("val.n", "False (verl's default): greedy, as val/pass@1 here; True: sampled"),
       R + "val_kwargs.top_k": ("(none)", "-1 (verl's default): no top-k, as here; another value: unmapped")})
def validation(c):
    sample, n = c.get(R + "val_kwargs.do_sample"), c.integer(R + "val_kwargs.n")
    if c.get(R + "val_kwargs.top_k", -1) not in (-1, 0, None):
        c.refuse(R + "val_kwargs.top_k", "validation top-k sampling: validation samples with val.temperature and "
                 "val.top_p only")
    elif c.given(R + "val_kwargs.top_k"):
        c.ignore(R + "val_kwargs.top_k", "-1: no top-k, as validation samples here")
    if not sample:  # verl's greedy validation: val/pass@1 here is greedy; extra greedy samples would repeat it
        c.ignore(R + "val_kwargs.do_sample", "False: greedy validation, val/pass@1 here")
        return
    c.ignore(R + "val_kwargs.do_sample", "True: sampled validation; here val/pass@1 is greedy and val/mean@n samples")
    if n > 1:
        c.put("val.n", n, c.said(R + "val_kwargs.n"), R + "val_kwargs.n")
    else:
        c.note(f"{R}val_kwargs.do_sample=True with n=1: verl's validation score is one sampled response per prompt; "
               "here val/pass@1 is greedy (set val.n > 1 for sampled val/mean@n)")
    for key, target in ((R + "val_kwargs.temperature", "val.temperature"), (R + "val_kwargs.top_p", "val.top_p")):
        if c.get(key):
            c.put(target, c.get(key), c.said(key), key)


@rule({"data.prompt_key": ("data.prompt_key", "row key of the prompt (verl's default prompt: a list of chat "
                           "messages), written explicitly"),
       "data.val_max_samples": ("val.max_samples", "validation prompts at most (verl's -1: all, 0 here)")})
def verl_rows(c):
    """verl's rows: ``prompt`` (chat messages, the template always applied), ``reward_model.ground_truth``,
    ``data_source``, ``extra_info`` (examples/data_preprocess/gsm8k.py); the keys that read them."""
    c.put("data.prompt_key", c.get("data.prompt_key", "prompt"), c.said("data.prompt_key"), "data.prompt_key")
    c.put("data.answer_key", "reward_model.ground_truth", "verl's rows keep the answer in reward_model.ground_truth",
          "data.prompt_key")
    c.put("data.apply_chat_template", True, "verl always applies the chat template to the prompt's messages",
          "data.prompt_key")
    samples = c.integer("data.val_max_samples")
    if samples is not None and samples > 0:
        c.put("val.max_samples", samples, c.said("data.val_max_samples"), "data.val_max_samples")


# chat-template arguments whose value is the template's own default (Qwen3's enable_thinking, gpt-oss's
# reasoning_effort): the prompt is the same without them
TEMPLATE_DEFAULTS = {"enable_thinking": True, "reasoning_effort": "medium"}


@rule({"data.apply_chat_template_kwargs.*": ("(none)", "enable_thinking=True / reasoning_effort=medium: the chat "
                                             "templates' own defaults (Qwen3, gpt-oss); other values: unmapped")})
def chat_template_kwargs(c):
    for key in [k for k in c.v if k.startswith("data.apply_chat_template_kwargs.")]:
        name = key.rsplit(".", 1)[1]
        if name in TEMPLATE_DEFAULTS and c.get(key) == TEMPLATE_DEFAULTS[name]:
            c.ignore(key, f"{c.get(key)}: the chat template's own default (the prompt is the same without it)")
        else:
            c.refuse(key, "no chat-template arguments here (they change the prompt)")


@rule({M + "override_config.*": ("(none)", "dropout set to 0: models here run with config.json's dropout, 0.0 in "
                                 "Qwen/Llama/Mistral/DeepSeek configs; max_position_embeddings: no effect when the local "
                                 "model's RoPE does not read it; any other override: unmapped")})
def override_config(c):
    for key in [k for k in c.v if k.startswith(M + "override_config.")]:
        if ("dropout" in key or key.endswith("pdrop")) and c.get(key) in (0, 0.0):
            c.ignore(key, "dropout 0: the model runs with its config.json's dropout here, 0.0 for Qwen/Llama/Mistral/"
                     "DeepSeek (a config with dropout > 0 would train with it)")
        elif key.endswith(".max_position_embeddings"):
            max_position_embeddings(c, key)
        else:
            c.refuse(key, "the model's config.json is used as is: edit it in a copy of the model folder")


def max_position_embeddings(c, key: str) -> None:
    """verl sets the override on the trainer's HF config only (verl/workers/config/model.py:204-220; vLLM gets
    no hf_overrides from it, vllm_async_server.py:282-323) and bounds vLLM's max_model_len by it
    (vllm_async_server.py:993-1002). With RoPE that does not read it (no rope_scaling: the rotary table is
    computed per position) nothing trained changes, and vLLM's context here is rollout.max_model_len. With
    rope_scaling (YaRN, dynamic NTK, longrope read max_position_embeddings) it changes the positions' encoding,
    and a model folder that is not here cannot be read: unmapped in both cases."""
    limit, path = c.integer(key), c.get(M + "path")
    config = _local_config(path)
    if config is None:
        c.refuse(key, f"model.path {path!r} is not a local model folder here, so whether its RoPE reads "
                      f"max_position_embeddings cannot be told: download the model, set the script's model path to the "
                      f"folder and convert again")
        return
    scaling = [cfg.get("rope_scaling") for cfg in (config, config.get("text_config") or {}) if cfg.get("rope_scaling")]
    scaling = [s for s in scaling if s.get("rope_type", s.get("type")) not in (None, "default", "mrope")]
    if scaling:
        c.refuse(key, f"the model's rope_scaling {scaling[0]} reads max_position_embeddings, so the override changes "
                      f"the positions' encoding: edit config.json in a copy of the model folder and point model.path at it")
        return
    context = c.out.get("rollout.max_model_len", (None,))[0]
    if context is not None and context > limit:
        raise BadInput(f"{key}={limit} is below rollout.max_model_len={context} (prompt + response): verl refuses "
                       f"this too (vllm_async_server.py:998-1001); raise the override or shorten the lengths")
    c.ignore(key, f"{limit}: verl sets it on the trainer's config only, and this model's RoPE ({path}) does not read "
                  f"it; vLLM's context is rollout.max_model_len" + (f" ({context})" if context is not None else ""))


def _local_config(path) -> dict | None:
    import json
    import os

    try:
        with open(os.path.join(str(path), "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None