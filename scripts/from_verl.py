#!/usr/bin/env python
"""Turn a verl launch script (or its override list) into this project's YAML config.

Each key it knows is converted with a comment naming the verl key and value it came from; the
table is scripts/verl_table.py (documented in docs/from_verl.md); the shell reading is
scripts/verl_shell.py. Keys with no equivalent are listed with the reason and the run exits 2,
unless --allow-unmapped (then they end the YAML as comments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from dataclasses import fields, is_dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import verl_table as K  # noqa: E402
from verl_table import BadInput, count_rows, fmt, parse_value  # noqa: E402
import verl_shell  # noqa: E402

A, R, REF = K.A, K.R, K.REF
# verl's defaults that differ from this project's, written when the script leaves them unset
VERL_DEFAULTS = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    A + "optim.weight_decay": 0.01, "trainer.save_freq": -1, "trainer.logger": ["console", "wandb"],
    "trainer.val_before_train": True, "trainer.balance_batch": True, "trainer.total_epochs": 30,
}


def project_keys() -> dict[str, type]:
    """Every dotted key of this project's Config and its field type (rlcore/config)."""
    import typing

    sys.path.insert(0, REPO)
    from rlcore.config import Config

    out = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            t = hints[f.name]
            if is_dataclass(t):
                walk(t, prefix + f.name + ".")
            else:
                out[prefix + f.name] = t
    walk(Config, "")
    return out


def split_overrides(argv: list[str]) -> tuple[dict[str, tuple[object, str]], list[tuple[str, str]]]:
    """key -> (value, as written) of the overrides (the last one wins, as in Hydra), and the
    launcher flags (--config-path, --config-name, ...) that have no equivalent."""
    values, flags = {}, []
    for arg in argv:
        if arg.startswith("-"):
            flags.append((arg, "Hydra's config search: this project reads one YAML (--config)"))
            continue
        if "=" not in arg:
            raise BadInput(f"{arg!r} is not a verl override: each argument after verl.trainer.main_ppo is key=value")
        key, text = arg.split("=", 1)
        if key.startswith("~"):
            flags.append((arg, "Hydra's key deletion has no equivalent"))
            continue
        key = key.lstrip("+")
        kind, why = K.lookup(key)
        if kind == "unknown":
            raise BadInput(f"unknown key {key!r} (in {arg!r}): {why}. Fix or remove the override.")
        values[key] = (parse_value(text), text)
    return values, flags


def cast(target: str, value, types: dict[str, type], verl_key: str):
    """value in the type of this project's key; a wrong type is a BadInput naming both keys."""
    import typing

    t = types.get(target)
    args = typing.get_args(t)
    if value is None and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), t) if args and typing.get_origin(t) is typing.Union else t
    origin = typing.get_origin(base) or base
    if origin is typing.Literal:
        origin = type(typing.get_args(base)[0])
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool), str: isinstance(value, (str, int, float)),
          list: isinstance(value, (list, str)), tuple: isinstance(value, list), dict: isinstance(value, dict)}.get(origin, True)
    if not ok:
        raise BadInput(f"{verl_key}={value!r}: {target} takes a {getattr(origin, '__name__', origin)} value; "
                       f"fix the value in the script")
    if origin is float:
        return float(value)
    if origin is str:
        return str(value)
    if origin is list and isinstance(value, str):
        return [value]
    return value


class Converter:
    def __init__(self, values: dict, types: dict[str, type]):
        self.v, self.types = values, types
        self.out: dict[str, tuple[object, str]] = {}  # this key -> (value, comment)
        self.unmapped: list[tuple[str, str, str]] = []  # (verl key, value, why)
        self.no_effect: list[tuple[str, str, str]] = []
        self.notes: list[str] = []

    def get(self, key, default=None):
        return self.v[key][0] if key in self.v else VERL_DEFAULTS.get(key, default)

    def said(self, key) -> str:
        """'key=value' as the script wrote it, or '(verl default)'."""
        if key in self.v:
            return f"{key}={self.v[key][1]}"
        return f"{key}={json.dumps(VERL_DEFAULTS[key])} (verl default)" if key in VERL_DEFAULTS else f"{key} unset"

    def put(self, target: str, value, comment: str, verl_key: str):
        if value == "" and verl_key in self.v:
            self.notes.append(f"{verl_key} is empty in the script (an unset variable?): {target} left out")
            return
        if target not in self.types:
            if verl_key in self.v:
                self.unmapped.append((verl_key, str(value), f"{target} is not a key of this checkout yet"))
            else:
                self.notes.append(f"{target} (verl's default {verl_key}={value}) is not a key of this checkout yet")
            return
        self.out[target] = (cast(target, value, self.types, verl_key), comment)

    def run(self) -> None:
        done = set()
        for key in list(self.v):
            kind, info = K.lookup(key)
            if kind == "no_effect" and self.v[key][0] not in K.NO_EFFECT_ONLY.get(key, [self.v[key][0]]):
                self.unmapped.append((key, self.v[key][1], f"only {K.NO_EFFECT_ONLY[key]} has an equivalent here: {info}"))
                done.add(key)
            elif kind == "no_effect":
                self.no_effect.append((key, self.v[key][1], info))
                done.add(key)
            elif kind == "unmapped":
                self.unmapped.append((key, self.v[key][1], info))
                done.add(key)
        for handler in dict.fromkeys(h for h in CONVERTERS.values() if h is not None):
            handler(self)  # each conversion once, in this order (steps before optim, batch before both)
        done.update(CONVERTERS)
        for key in self.v:
            if key in done or key.startswith(R + "engine_kwargs."):
                continue
            target, _ = K.MAPPED[key]
            self.put(target, self.get(key), self.said(key), key)
        self.engine_kwargs()

    # ------------------------------------------------------------------ the conversions
    def batch(self):
        tbs, mini = self.get("data.train_batch_size"), self.get(A + "ppo_mini_batch_size")
        self.put("trainer.prompts_per_step", tbs, self.said("data.train_batch_size"), "data.train_batch_size")
        mini = 256 if mini is None else mini
        if not isinstance(tbs, int) or not isinstance(mini, int) or mini <= 0 or tbs % mini:
            raise BadInput(f"data.train_batch_size={tbs} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
                           f"{mini} (verl refuses this too): make the mini-batch divide the batch")
        what = self.said(A + "ppo_mini_batch_size") if A + "ppo_mini_batch_size" in self.v else "ppo_mini_batch_size=256 (verl default)"
        self.put("algorithm.mini_batches", tbs // mini, f"{tbs} / {what}", A + "ppo_mini_batch_size")

    def ulysses(self) -> int:
        return int(self.get(A + "ulysses_sequence_parallel_size") or self.get(A + "fsdp_config.ulysses_sequence_parallel_size")
                   or self.get(A + "veomni.ulysses_parallel_size") or 1)

    def tokens(self):
        if self.get(A + "use_dynamic_bsz"):
            per_gpu, u = self.get(A + "ppo_max_token_len_per_gpu", 16384), self.ulysses()
            self.put("algorithm.micro_batch_tokens", int(per_gpu) * u,
                     f"{self.said(A + 'ppo_max_token_len_per_gpu')} per GPU x Ulysses {u}", A + "ppo_max_token_len_per_gpu")
        elif A + "ppo_max_token_len_per_gpu" in self.v:
            self.no_effect.append((A + "ppo_max_token_len_per_gpu", self.v[A + "ppo_max_token_len_per_gpu"][1],
                                   "used by verl only with use_dynamic_bsz=True"))

    def log_prob(self):
        sizes = [(k, self.get(k)) for k in (R + "log_prob_micro_batch_size_per_gpu", REF + "log_prob_micro_batch_size_per_gpu")
                 if self.get(k) is not None]
        if sizes:
            key, size = min(sizes, key=lambda kv: kv[1])
            note = " (the smaller of rollout's and ref's)" if len({s for _, s in sizes}) > 1 else ""
            self.put("algorithm.log_prob_micro_batch_size", size, " and ".join(self.said(k) for k, _ in sizes) + note, key)
        budgets = [(p + "log_prob_max_token_len_per_gpu", self.get(p + "log_prob_max_token_len_per_gpu", 16384))
                   for p in (R, REF) if self.get(p + "log_prob_use_dynamic_bsz")]
        if budgets:
            key, per_gpu = min(budgets, key=lambda kv: kv[1])
            u = self.ulysses()
            self.put("algorithm.log_prob_micro_batch_tokens", int(per_gpu) * u,
                     f"{self.said(key)} per GPU x Ulysses {u} (log_prob_use_dynamic_bsz=True)", key)

    def kl(self):
        if not self.get(A + "use_kl_loss"):
            self.put("algorithm.kl_loss_coef", 0.0, self.said(A + "use_kl_loss") if A + "use_kl_loss" in self.v
                     else "use_kl_loss unset (verl default False)", A + "use_kl_loss")
            return
        self.put("algorithm.kl_loss_coef", self.get(A + "kl_loss_coef", 0.001), self.said(A + "kl_loss_coef"), A + "kl_loss_coef")
        kind = self.get(A + "kl_loss_type", "low_var_kl")
        if str(kind).rstrip("+") not in K.KL_ALIASES:
            self.unmapped.append((A + "kl_loss_type", str(kind), f"no KL estimator {kind!r} here (k1, k2, k3, abs, low_var_kl)"))
            return
        if str(kind).endswith("+"):
            self.notes.append(f"kl_loss_type={kind}: verl's straight-through '+' variant; the plain estimator is used here")
        self.put("algorithm.kl_loss_type", K.KL_ALIASES[str(kind).rstrip("+")], self.said(A + "kl_loss_type"), A + "kl_loss_type")

    def adv(self):
        name = self.get("algorithm.adv_estimator")
        if name is not None and name not in K.ADV_ALIASES:
            self.unmapped.append(("algorithm.adv_estimator", str(name), "estimators here: grpo, rloo, reinforce_plus_plus(_baseline)"))
        elif name is not None:
            self.put("algorithm.adv_estimator", K.ADV_ALIASES[name], self.said("algorithm.adv_estimator"), "algorithm.adv_estimator")

    def truncation(self):
        filt, trunc = self.get("data.filter_overlong_prompts"), self.get("data.truncation", "error")
        if filt:
            self.put("data.truncation", "filter", f"{self.said('data.filter_overlong_prompts')} (filtered before "
                     f"data.truncation={trunc} could apply)", "data.filter_overlong_prompts")
        elif trunc in ("error", "left", "right", "middle"):
            self.put("data.truncation", trunc, self.said("data.truncation") if "data.truncation" in self.v
                     else "data.truncation unset (verl default error)", "data.truncation")
        else:
            self.unmapped.append(("data.truncation", str(trunc), "left, right, middle or error"))

    def lengths(self):
        p, r = self.get("data.max_prompt_length"), self.get("data.max_response_length")
        self.put("data.max_prompt_length", p, self.said("data.max_prompt_length"), "data.max_prompt_length")
        self.put("rollout.max_response_length", r, self.said("data.max_response_length"), "data.max_response_length")
        if R + "max_model_len" not in self.v:
            self.put("rollout.max_model_len", int(p) + int(r), "max_prompt_length + max_response_length", "data.max_response_length")

    def steps(self):
        self.total_steps = None
        if "trainer.total_training_steps" in self.v and self.get("trainer.total_training_steps") is not None:
            self.total_steps = self.get("trainer.total_training_steps")
            self.put("trainer.total_steps", self.total_steps, self.said("trainer.total_training_steps"), "trainer.total_training_steps")
            if "trainer.total_epochs" in self.v:
                self.no_effect.append(("trainer.total_epochs", self.v["trainer.total_epochs"][1],
                                       "total_training_steps wins over it in verl"))
            return
        epochs, rows = self.get("trainer.total_epochs"), count_rows(self.get("data.train_files"))
        tbs = self.get("data.train_batch_size")
        if rows is not None and rows // tbs > 0:
            self.total_steps = epochs * (rows // tbs)
            self.put("trainer.total_steps", self.total_steps,
                     f"{self.said('trainer.total_epochs')} x ({rows} rows // {tbs}) as verl counts", "trainer.total_epochs")
        else:
            self.put("trainer.total_epochs", epochs, self.said("trainer.total_epochs") + " (training files not readable here: "
                     "steps are counted at start-up)", "trainer.total_epochs")

    def optim(self):
        opt = int(self.get(A + "ppo_epochs", 1)) * int(self.out["algorithm.mini_batches"][0])
        self.put("optim.weight_decay", self.get(A + "optim.weight_decay"), self.said(A + "optim.weight_decay"), A + "optim.weight_decay")
        warm, ratio = self.get(A + "optim.lr_warmup_steps", -1), self.get(A + "optim.lr_warmup_steps_ratio", 0.0)
        if warm is not None and warm >= 0:
            self.put("optim.warmup_steps", int(warm) * opt, f"{self.said(A + 'optim.lr_warmup_steps')} training steps x {opt} "
                     "optimizer steps each", A + "optim.lr_warmup_steps")
        elif ratio:
            if self.total_steps is None:
                self.unmapped.append((A + "optim.lr_warmup_steps_ratio", str(ratio), "needs the step count: set "
                                      "trainer.total_training_steps or make data.train_files readable here"))
            else:
                self.put("optim.warmup_steps", int(ratio * self.total_steps) * opt, f"{self.said(A + 'optim.lr_warmup_steps_ratio')}"
                         f" x {self.total_steps} steps x {opt} optimizer steps each", A + "optim.lr_warmup_steps_ratio")
        for key in ("optim.lr_scheduler_type", "optim.warmup_style", "optim.lr_decay_style"):
            if self.get(A + key) is not None:
                sched = self.get(A + key)
                if sched not in ("constant", "cosine"):
                    self.unmapped.append((A + key, str(sched), "constant or cosine here"))
                else:
                    self.put("optim.lr_schedule", sched, self.said(A + key), A + key)
                break
        else:
            if self.get("model_engine") == "veomni":
                self.put("optim.lr_schedule", "cosine", "model_engine=veomni (verl's optim/veomni.yaml: lr_scheduler_type "
                         "cosine)", "model_engine")
        if self.get(A + "optim.lr_min") is not None:
            self.put("optim.min_lr_ratio", float(self.get(A + "optim.lr_min")) / float(self.get(A + "optim.lr", 1e-3)),
                     f"{self.said(A + 'optim.lr_min')} / lr", A + "optim.lr_min")

    def model_engine(self):
        engine = self.get("model_engine")
        if engine in ("megatron", "torchtitan"):  # (actor.strategy=megatron: NO_EFFECT_ONLY)
            self.unmapped.append(("model_engine", str(engine), "Megatron / TorchTitan are not backends here: VeOmni FSDP2"))

    def rollout_name(self):
        name = self.get(R + "name", "vllm")
        if name != "vllm":
            self.unmapped.append((R + "name", str(name), "vLLM is the only rollout engine here"))

    def trackers(self):
        loggers = self.get("trainer.logger")
        loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
        trackers = []
        for name in loggers:
            if name in K.TRACKERS:
                trackers.append(K.TRACKERS[name])
            elif name != "console":
                why = "no SwanLab tracker here yet (rlcore/trackers.py's registry takes one)" if name == "swanlab" else "no such tracker here"
                self.unmapped.append(("trainer.logger", name, why))
        self.put("logging.trackers", trackers, self.said("trainer.logger") + " (console is always on here)", "trainer.logger")
        if "trainer.project_name" in self.v:
            if "wandb" in trackers:
                self.put("logging.wandb.project", self.get("trainer.project_name"), self.said("trainer.project_name"), "trainer.project_name")
            if "mlflow" in trackers:
                self.put("logging.mlflow_experiment", self.get("trainer.project_name"), self.said("trainer.project_name"), "trainer.project_name")
        if "trainer.experiment_name" in self.v and "wandb" in trackers:
            self.put("logging.wandb.name", self.get("trainer.experiment_name"), self.said("trainer.experiment_name"), "trainer.experiment_name")

    def freqs(self):
        save = self.get("trainer.save_freq")
        self.put("checkpoint.save_every", -1 if save is None or save < 0 else save, self.said("trainer.save_freq"), "trainer.save_freq")
        if "trainer.test_freq" in self.v:
            test = self.get("trainer.test_freq")
            self.put("trainer.val_every", max(int(test), 0), self.said("trainer.test_freq"), "trainer.test_freq")
        if self.get("data.val_files") or "trainer.val_before_train" in self.v:
            self.put("trainer.val_before_train", self.get("trainer.val_before_train"), self.said("trainer.val_before_train"),
                     "trainer.val_before_train")

    def simple_default(key):
        def handler(self):
            self.put(K.MAPPED[key][0], self.get(key), self.said(key), key)
        return handler

    def resume(self):
        if "trainer.resume_mode" not in self.v:
            return
        mode = self.get("trainer.resume_mode", "auto")
        target = {"auto": "auto", "disable": "never"}.get(mode) or self.get("trainer.resume_from_path")
        if not target:
            raise BadInput(f"trainer.resume_mode={mode} needs trainer.resume_from_path (a checkpoint folder)")
        self.put("checkpoint.resume", target, self.said("trainer.resume_mode"), "trainer.resume_mode")

    def expert_parallel(self):
        if R + "expert_parallel_size" not in self.v:
            return
        size, tp = int(self.get(R + "expert_parallel_size")), int(self.get(R + "tensor_model_parallel_size", 2))
        # verl spreads vLLM's EP over data-parallel x TP ranks of one engine (rollout.py:292); an engine
        # here is one TP group, so its EP spans tensor_parallel_size ranks and is off at TP 1.
        on = size > 1 and tp > 1
        if size > 1 and not on:
            self.notes.append(f"{R}expert_parallel_size={size} with tensor_model_parallel_size=1: an engine here is one "
                              f"TP group, so vLLM's expert parallelism stays off (each engine holds every expert); "
                              f"raise rollout.tensor_parallel_size to shard the experts over an engine's ranks")
        self.put("rollout.enable_expert_parallel", on, self.said(R + "expert_parallel_size")
                 + ("" if on or size <= 1 else " (off at TP 1: each engine is one TP group here)"), R + "expert_parallel_size")

    def fsdp_size(self):
        for key in (A + "fsdp_config.fsdp_size", A + "veomni.fsdp_size"):
            if key in self.v and int(self.get(key)) > 0:
                self.put("parallel.fsdp_size", int(self.get(key)), self.said(key), key)
            elif key in self.v:
                self.no_effect.append((key, self.v[key][1], "-1: shard over every rank, as here by default"))

    def clip(self):
        if A + "clip_ratio" in self.v:
            for target in ("algorithm.clip_low", "algorithm.clip_high"):
                self.put(target, self.get(A + "clip_ratio"), self.said(A + "clip_ratio"), A + "clip_ratio")

    def overlong(self):
        cfg = "reward_model.reward_kwargs.overlong_buffer_cfg."
        if self.get(cfg + "enable") is False:
            self.put("algorithm.overlong_buffer_len", 0, self.said(cfg + "enable"), cfg + "enable")
            self.v.pop(cfg + "len", None)

    def attention(self):
        name = self.get(A + "veomni.attn_implementation")
        if name is None:
            return
        # verl's VeOmni engine names its kernels veomni_flash_attention_N[_with_sp] (Ulysses is parallel.ulysses_size here)
        plain = str(name).removeprefix("veomni_").removesuffix("_with_sp")
        if plain.startswith("flash_attention"):  # auto: the first flash kernel that imports on CUDA, torch_npu's on NPU
            self.put("model.attn_implementation", "auto", self.said(A + "veomni.attn_implementation") + " (auto picks the "
                     "flash kernel the machine has)", A + "veomni.attn_implementation")
        elif plain in ("sdpa", "eager"):
            self.put("model.attn_implementation", plain, self.said(A + "veomni.attn_implementation"), A + "veomni.attn_implementation")
        else:
            self.unmapped.append((A + "veomni.attn_implementation", str(name), "no such attention kernel here "
                                  "(auto, sdpa, eager, flash_attention_2/_3/_4)"))

    def launcher(self):
        self.gpus = int(self.get("trainer.n_gpus_per_node", 8))
        self.nodes = int(self.get("trainer.nnodes", 1))

    def owned_engine_kwargs(self, kwargs: dict) -> dict:
        """vLLM arguments the rollout owns move to their key (rlcore/rollout/engine_keys.py OWNED: "use rollout.X"),
        or are unmapped with its reason; vLLM's renamed ones take their new name."""
        try:
            from rlcore.rollout.engine_keys import OWNED
        except ImportError:
            OWNED = {}
        if "disable_mm_preprocessor_cache" in kwargs:  # vLLM 0.10 replaced it by mm_processor_cache_gb=0
            if kwargs.pop("disable_mm_preprocessor_cache"):
                kwargs["mm_processor_cache_gb"] = 0
                self.notes.append("engine_kwargs.vllm.disable_mm_preprocessor_cache=True -> mm_processor_cache_gb=0 "
                                  "(vLLM's replacement; the old name is gone from vllm 0.32's EngineArgs)")
        for name in [n for n in kwargs if n in OWNED]:
            value, why, verl_key = kwargs.pop(name), OWNED[name], R + "engine_kwargs.vllm." + name
            target = why[4:] if why.startswith("use rollout.") and " " not in why[4:] else None
            if target and (R + name) in self.v:
                self.notes.append(f"+{verl_key} ignored: {R + name} sets {target}")
            elif target:  # over a value derived here (max_model_len = prompt + response)
                self.put(target, value, f"+{verl_key}={self.v[verl_key][1]}", verl_key)
            elif not target:
                self.unmapped.append((verl_key, str(value), f"the rollout sets {name} itself: {why}"))
        return kwargs

    def engine_kwargs(self):
        kwargs, said = {}, []
        for key, (value, text) in self.v.items():
            if key.startswith(R + "engine_kwargs.vllm."):
                node = kwargs
                *path, leaf = key[len(R + "engine_kwargs.vllm."):].split(".")
                for part in path:
                    node = node.setdefault(part, {})
                node[leaf] = value
                said.append(f"{key[len(R + 'engine_kwargs.'):]}={text}")
        kwargs = self.owned_engine_kwargs(kwargs)
        if kwargs:
            self.put("rollout.engine_kwargs", kwargs, "+actor_rollout_ref.rollout.engine_kwargs." + ", ".join(said),
                     R + "engine_kwargs.vllm")


C = Converter
CONVERTERS = {
    "model_engine": C.model_engine, R + "name": C.rollout_name, "data.train_batch_size": C.batch,
    A + "ppo_mini_batch_size": None, A + "use_dynamic_bsz": C.tokens, A + "ppo_max_token_len_per_gpu": None,
    R + "log_prob_micro_batch_size_per_gpu": C.log_prob, REF + "log_prob_micro_batch_size_per_gpu": C.log_prob,
    R + "log_prob_use_dynamic_bsz": C.log_prob, REF + "log_prob_use_dynamic_bsz": C.log_prob,
    R + "log_prob_max_token_len_per_gpu": None, REF + "log_prob_max_token_len_per_gpu": None,
    A + "use_kl_loss": C.kl, A + "kl_loss_coef": None, A + "kl_loss_type": None,
    "algorithm.adv_estimator": C.adv, "data.truncation": C.truncation, "data.filter_overlong_prompts": None,
    "data.max_prompt_length": C.lengths, "data.max_response_length": None,
    "trainer.total_epochs": C.steps, "trainer.total_training_steps": None,
    A + "optim.weight_decay": C.optim, A + "optim.lr_warmup_steps": None,
    A + "optim.lr_warmup_steps_ratio": None, A + "optim.lr_scheduler_type": None,
    A + "optim.warmup_style": None, A + "optim.lr_decay_style": None, A + "optim.lr_min": None,
    "trainer.logger": C.trackers, "trainer.project_name": None, "trainer.experiment_name": None,
    "trainer.save_freq": C.freqs, "trainer.test_freq": None, "trainer.val_before_train": None,
    "trainer.balance_batch": C.simple_default("trainer.balance_batch"),
    "trainer.resume_mode": C.resume, "trainer.resume_from_path": None,
    R + "expert_parallel_size": C.expert_parallel, A + "fsdp_config.fsdp_size": C.fsdp_size, A + "veomni.fsdp_size": C.fsdp_size,
    A + "clip_ratio": C.clip, "reward_model.reward_kwargs.overlong_buffer_cfg.enable": C.overlong,
    A + "veomni.attn_implementation": C.attention, "trainer.n_gpus_per_node": C.launcher, "trainer.nnodes": C.launcher,
}


def to_yaml(conv: Converter, source: str, allow_unmapped: bool) -> str:
    lines = [f"# Converted from {source} by scripts/from_verl.py: each key's comment names the verl key it came from.",
             "# Check it: python scripts/check_config.py --config THIS.yaml --device cuda (or npu) --nproc N", ""]
    tree: dict = {}
    for key in sorted(conv.out, key=lambda k: (k.split(".")[0], k)):
        node, parts = tree, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = conv.out[key]

    def emit(node, depth):
        for name, item in node.items():
            if isinstance(item, dict):
                lines.append("  " * depth + f"{name}:")
                emit(item, depth + 1)
            else:
                value, comment = item
                lines.append("  " * depth + f"{name}: {fmt(value)}  # {comment}")
    emit(tree, 0)
    if conv.no_effect:
        lines += ["", "# verl keys that need no key here:"] + [f"#   {k}={v}: {why}" for k, v, why in conv.no_effect]
    if conv.unmapped and allow_unmapped:
        lines += ["", "# verl keys with no equivalent here (--allow-unmapped):"] + [f"#   {k}{'=' + v if v else ''}: {why}" for k, v, why in conv.unmapped]
    return "\n".join(lines) + "\n"


def launch_lines(conv: Converter, out: str, device: str, exports: dict[str, str]) -> list[str]:
    tracker = conv.out.get("logging.trackers", ([], ""))[0]
    lines = []
    if conv.nodes > 1:
        gpus = "" if device == "npu" else f" --gpus-per-node={conv.gpus}"
        lines.append(f"mkdir -p logs && sbatch --nodes={conv.nodes}{gpus} scripts/slurm/train_grpo.sbatch {out}"
                     "   # docs/cluster.md: NPROC_PER_NODE, IFNAME, the shared output_dir")
    else:
        lines.append(f"torchrun --nproc_per_node={conv.gpus} train_grpo.py --config {out}")
    lines.append(f"dry run first: python scripts/check_config.py --config {out} --device {device} "
                 f"--nproc {conv.gpus} --nnodes {conv.nodes}")
    if "wandb" in tracker:
        lines.append("WANDB_MODE: wandb is offline here unless logging.wandb.mode or WANDB_MODE=online says otherwise "
                     "(upload later with `wandb sync`)")
    if device == "npu":
        lines.append("Ascend (docs/install.md): ASCEND_RT_VISIBLE_DEVICES, HCCL_CONNECT_TIMEOUT, TASK_QUEUE_ENABLE=1, "
                     "OMP_NUM_THREADS=1; no expandable_segments:True in PYTORCH_NPU_ALLOC_CONF")
    if exports:
        lines.append("the script exported: " + " ".join(f"{k}={v}" for k, v in exports.items()))
    return lines


def read_input(args) -> tuple[list[str], str, verl_shell.Shell | None]:
    """The overrides, where they came from, and the Shell that read the script (None for an argv)."""
    if args.script is None:
        if not args.rest:
            raise BadInput("give a verl launch script, or the overrides after --")
        return args.rest, "the override list", None
    try:
        text = open(args.script).read()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {args.script}: {e}") from e
    try:
        launches, shell = verl_shell.run(text, args.rest)
    except (verl_shell.ShellError, ValueError, IndexError) as e:
        raise BadInput(f"{args.script}: the shell script could not be read: {e}") from e
    if not launches:
        raise BadInput(f"{args.script} is not a verl command: no `python3 -m verl.trainer.main_ppo` line was reached"
                       + (f" ({'; '.join(shell.notes)})" if shell.notes else ""))
    argv0, argv = launches[-1]
    if argv0[-1] != "verl.trainer.main_ppo":
        raise BadInput(f"{args.script} runs {argv0[-1]}, not verl.trainer.main_ppo (the PPO/GRPO trainer)")
    return argv, args.script, shell


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="from_verl.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("Turn a verl launch script (python3 -m verl.trainer.main_ppo key=value ...) into this project's "
                    "YAML config. The script is read, not run: its variables, ${VAR:-default}, arrays, case/if "
                    "branches and the environment decide the overrides. Every key is converted with a comment naming "
                    "the verl key and value; keys with no equivalent are listed with the reason and exit 2 "
                    "unless --allow-unmapped. The table is docs/from_verl.md.", 100),
        epilog="examples:\n  python scripts/from_verl.py run_qwen3_8b_fsdp.sh -o qwen3_8b.yaml\n"
               "  DEVICE=npu python scripts/from_verl.py run_qwen3_8b_fsdp.sh --allow-unmapped\n"
               "  python scripts/from_verl.py -- data.train_batch_size=256 actor_rollout_ref.actor.ppo_mini_batch_size=64\n"
               "arguments after -- are the script's $@ (or, without a script, the overrides themselves).")
    p.add_argument("script", nargs="?", help="the verl launch script (a shell file)")
    p.add_argument("-o", "--output", help="write the YAML here (default: stdout)")
    p.add_argument("--allow-unmapped", action="store_true", help="write keys with no equivalent as comments, exit 0")
    p.add_argument("--device", choices=["cuda", "npu"], help="the target device (default: trainer.device, or npu when "
                   "the script's DEVICE is npu, else cuda)")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.rest = argv[split + 1:]
    try:
        overrides, source, shell = read_input(args)
        values, flags = split_overrides(overrides)
        conv = Converter(values, project_keys())
        conv.run()
        conv.unmapped += [(flag, "", why) for flag, why in flags]
        device = args.device or {"npu": "npu"}.get(str(values.get("trainer.device", ("",))[0]) or
                                                  (shell.scalar("DEVICE") if shell else ""), "cuda")
        if device == "npu":
            conv.put("parallel.device", "npu", "the script targets Ascend NPUs", "trainer.device")
        out = args.output or "OUT.yaml"
        text = to_yaml(conv, source, args.allow_unmapped)
    except BadInput as e:
        print(f"from_verl.py: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:  # int("8x") of a launcher flag, a list where a number belongs
        print(f"from_verl.py: error: a value in the script has the wrong type ({e}); fix it and run again", file=sys.stderr)
        return 2
    for note in (shell.notes if shell else []) + conv.notes:
        print(f"from_verl.py: note: {note}", file=sys.stderr)
    if conv.unmapped and not args.allow_unmapped:
        print("from_verl.py: error: these verl keys have no equivalent here (--allow-unmapped writes the rest and "
              "lists them as comments):", file=sys.stderr)
        for key, value, why in conv.unmapped:
            print(f"  {key}{'=' + value if value else ''}: {why}", file=sys.stderr)
        return 2
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as e:
            print(f"from_verl.py: error: cannot write {args.output}: {e}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    for line in launch_lines(conv, out, device, shell.exports if shell else {}):
        print(f"from_verl.py: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
