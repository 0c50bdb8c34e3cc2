"""Conversion rules for verl's reward: its reward manager, its custom reward function (``reward.fn``),
its reward model (a discriminative entry of ``reward.models``) and, when neither is set, its scorer
by data_source (the ``verl`` component): what ``reward.components`` becomes (verl 1dda039).

Which of the three scores a sample is verl's RewardLoopWorker.compute_score
(verl/experimental/reward_loop/reward_loop.py:145-156): the custom function when its path is set,
else the reward model when it is enabled (its score alone: no rule score is added), else
default_compute_score by the row's data_source (verl/utils/reward_score/__init__.py).
"""

from __future__ import annotations

import importlib.util
import json
import os

from rlcore.verl.rules import rule

MANAGERS = {"naive": "rule scoring of each response", "dapo": "rule scoring, with DAPO's overlong shaping below"}
TOP, NESTED = "custom_reward_function.", "reward.custom_reward_function."
RM, LEGACY = "reward.reward_model.", "reward_model."  # verl's place of the reward model, and its older one
JUDGE = "reward_model"  # the reward.models entry's name (its weight in reward.components)
FN_NAME = "compute_score"  # verl's default name (verl/trainer/config/reward/reward.yaml)


@rule({"reward.reward_manager.name": ("(reward scoring)", "naive / dapo: rule scoring, as the reward here; others "
                                      "(prime, batch, gdpo, ...): unmapped"),
       "reward_model.reward_manager": ("(reward scoring)", "verl's older place of reward.reward_manager.name")})
def reward_manager(c):
    for key in ("reward.reward_manager.name", "reward_model.reward_manager"):
        name = c.get(key) if c.given(key) else None
        if name is None:
            continue
        if name in MANAGERS:
            c.ignore(key, f"{name}: {MANAGERS[name]}")
        else:
            c.refuse(key, f"verl's {name} reward manager scores in its own way: reward.components / reward.fn here")


def _fn_keys(section: str) -> dict:
    name = "as custom_reward_function.*" if section == NESTED else None
    return {section + "path": ("reward.fn", name or "the file of verl's compute_score(data_source, solution_str, "
                               "ground_truth, extra_info): reward.fn path:name, called with verl's arguments; a "
                               "relative path is resolved against the directory from_verl.py runs in (verl resolves it "
                               "against the one it was launched from) and written absolute; pkg://a.b -> a.b:name"),
            section + "name": ("reward.fn", name or "the function's name (verl's default compute_score)"),
            section + "reward_kwargs": ("reward.fn_kwargs", name or "keyword arguments of every call; they win over "
                                        "verl's own arguments (verl/trainer/ppo/reward.py:31-37)"),
            section + "reward_kwargs.*": ("reward.fn_kwargs", name or "one keyword argument of every call")}


@rule(_fn_keys(TOP) | _fn_keys(NESTED))
def custom_reward(c):
    """verl's custom_reward_function -> reward.fn + reward.fn_kwargs. The top-level section, when it
    sets anything, replaces reward.custom_reward_function (verl's migration, reward_loop.py:58-60)."""
    section = TOP if any(c.v[k][0] is not None for k in c.v if k.startswith(TOP)) else NESTED
    other = NESTED if section == TOP else TOP
    for key in [k for k in c.v if k.startswith(other) and k not in c.done]:  # (other keys: refused already)
        c.ignore(key, f"verl reads {section}* (the top-level section, when it sets anything, replaces "
                 "reward.custom_reward_function: verl/experimental/reward_loop/reward_loop.py:58-60)")
    c.reward_fn = None
    path = c.get(section + "path")
    if not path:
        for key in [k for k in c.v if k.startswith(section) and k not in c.done]:
            c.ignore(key, "read by verl only with custom_reward_function.path set")
        return
    name = c.get(section + "name") or FN_NAME
    spec, where = _fn_spec(str(path), name)
    said = f"{c.said(section + 'path')}, {section}name={name}" + ("" if c.given(section + "name") else " (verl default)")
    c.put("reward.fn", spec, said + (f" ({where})" if where else ""), section + "path")
    if not _importable(spec):
        c.unchecked.update({"reward.fn", "reward.fn_kwargs", "reward.components"})
        c.note(f"reward.fn: {spec.rpartition(':')[0]} is not on this machine ({said}; a relative path is taken from "
               "the directory from_verl.py ran in, as verl takes it from the one it was launched from): copy the file "
               "there or fix reward.fn in the YAML; the trainer exits 2 at start-up until it can load it")
    kwargs = _kwargs(c, section + "reward_kwargs")
    if kwargs:
        c.put("reward.fn_kwargs", kwargs, ", ".join(f"{k}={c.v[k][1]}" for k in c.v
                                                    if k.startswith(section + "reward_kwargs")), section + "reward_kwargs")
    c.reward_fn = section + "path"


def _fn_spec(path: str, name: str) -> tuple[str, str]:
    """(reward.fn's module:function, how the path was read) for verl's load_module path forms
    (verl/utils/import_utils.py:95-123: pkg://a.b or pkg://a/b, file://x.py, a path)."""
    if path.startswith("pkg://"):
        return f"{path[len('pkg://'):].replace('/', '.')}:{name}", ""
    path = path.removeprefix("file://")
    if os.path.isabs(path):
        return f"{path}:{name}", ""
    return f"{os.path.abspath(path)}:{name}", f"{path} taken from {os.getcwd()}"


def _importable(spec: str) -> bool:
    module = spec.rpartition(":")[0]
    if module.endswith(".py") or os.sep in module:
        return os.path.isfile(module)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _kwargs(c, key: str) -> dict:
    """``key`` as one mapping (``+...reward_kwargs={a: 1}``) merged with its dotted keys (``+...reward_kwargs.a=1``)."""
    out = dict(c.get(key) or {}) if c.given(key) and isinstance(c.get(key), dict) else {}
    for k in sorted(k for k in c.v if k.startswith(key + ".")):
        node, parts = out, k[len(key) + 1:].split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = c.get(k)
    return out


RM_ROLLOUT_REFUSED = {"quantization": "a quantized reward model", "quantization_config_file": "a quantized reward model",
                      "mtp": "multi-token prediction in the reward model's engine"}
RM_LAYOUT = ("tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
             "nnodes", "n_gpus_per_node", "enable_resource_pool")
RM_SAMPLING = ("temperature", "top_k", "top_p", "do_sample", "n", "ignore_eos")


def _rm_keys() -> dict:
    keys = {RM + "enable": ("reward.models", "True without a custom reward function: a discriminative reward.models "
                            "entry whose score alone is the reward, as in verl (no rule score is added)"),
            RM + "model_path": ("reward.models[0].path", "the reward model (a *ForSequenceClassification folder)"),
            RM + "rollout.*": ("reward.models[0]", "dtype, gpu_memory_utilization and max_model_len carried over (null: "
                               "the model's context when its folder is here, else prompt_length + response_length, at "
                               "least the policy's budget); the engine's layout, sampling, speed and memory knobs have "
                               "no effect on its score; quantization, mtp: unmapped")}
    keys |= {RM + k: ("(in-process)", "the reward model runs in-process beside the policy on every rank here")
             for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")}
    keys |= {LEGACY + k[len(RM):]: (target, f"verl's older place of {k} (its migration: reward_loop.py:62-76)")
             for k, (target, _) in keys.items()}
    keys[LEGACY + "model.path"] = keys.pop(LEGACY + "model_path")
    keys |= {LEGACY + "model.trust_remote_code": ("(none)", "False only: a reward model folder with auto_map exits 2 here"),
             LEGACY + "model.external_lib": ("(none)", "null only: no extra model library import")}
    return keys


def _rm(c, key: str) -> str:
    """The verl key that decides the reward model's ``key``: the older place when set (verl's
    migration copies it over the new one, reward_loop.py:62-76), else reward.reward_model's."""
    legacy = LEGACY + ("model.path" if key == "model_path" else key)
    return legacy if c.given(legacy) and c.get(legacy) is not None else RM + key


@rule(_rm_keys())
def reward_model(c):
    """verl's reward model (reward_loop.py:145-156 and compute_score_disrm, :223-266): the row's chat
    messages plus the decoded response through the reward model's own chat template, vLLM's classify
    with use_activation=False (the head's raw value) -> a discriminative reward.models entry."""
    keys = [k for k in c.v if k.startswith((RM, LEGACY + "enable", LEGACY + "model.", LEGACY + "rollout.",
                                            *(LEGACY + k for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes"))))]
    c.reward_judge, enable, path_key = None, _rm(c, "enable"), _rm(c, "model_path")
    if not c.get(enable):
        for key in keys:
            c.ignore(key, "read by verl only with reward_model.enable=True")
        return
    if c.reward_fn or not c.get(path_key):
        c.refuse(enable, "no reward_model.model_path: the reward model's folder" if not c.reward_fn else
                 "verl scores with the custom reward function alone, which reaches the reward model over HTTP "
                 "(reward_router_address: verl's generative reward models); here a reward model is a component of "
                 "its own (reward.models, docs/judges.md)")
        for key in keys:
            if key != enable:
                c.ignore(key, "the reward model is not used here (see reward_model.enable)")
        return
    entry = {"name": JUDGE, "path": str(c.get(path_key)), "kind": "discriminative", "activation": "none"}
    used = [enable, path_key]
    for name in ("dtype", "gpu_memory_utilization"):
        key = _rm(c, "rollout." + name)
        value = {"bf16": "bfloat16", "fp32": "float32"}.get(c.get(key), c.get(key))
        if name == "dtype" and value not in ("bfloat16", "float32"):
            c.refuse(key, "the reward model's engine in bfloat16 or float32 here")
            return
        entry[name] = value
        used.append(key)
    entry["max_model_len"], context_keys, why = _rm_context(c, entry["path"])
    c.put("reward.models", [entry], "; ".join([*map(c.said, used), why]) + " (verl: vLLM classify, the head's raw "
          "value)", enable)
    c.reward_judge = enable
    _rm_other_keys(c, [k for k in keys if k not in used + context_keys])


def _rm_context(c, path: str) -> tuple[int, list[str], str]:
    """The reward model's context, the verl keys it came from and how: verl's max_model_len, whose
    null is the model's max_position_embeddings (vllm_async_server.py:993-1002), read from the folder
    when it is here, else the reward rollout's prompt + response budget, at least the policy's."""
    key = _rm(c, "rollout.max_model_len")
    if c.get(key) is not None:
        return c.integer(key), [key], c.said(key)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        context = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
        if context:
            return int(context), [], f"max_model_len: the model's max_position_embeddings {context}, as verl's null"
    except (OSError, ValueError, AttributeError):
        pass
    p, r = _rm(c, "rollout.prompt_length"), _rm(c, "rollout.response_length")
    budget = c.integer(p) + c.integer(r)
    policy = c.out["data.max_prompt_length"][0] + c.out["rollout.max_response_length"][0]
    c.note(f"reward.models[0].max_model_len={max(budget, policy)}: verl reads the reward model's context from its "
           f"config.json (max_position_embeddings), which is not here; a longer input scores 0 "
           f"(reward/{JUDGE}_overlong_frac): raise it to the model's context if that metric is not 0")
    if budget >= policy:
        return budget, [p, r], f"max_model_len: {c.said(p)} + {c.said(r)}"
    return policy, [], f"max_model_len: the policy's prompt + response budget {policy}"


def _rm_other_keys(c, keys: list[str]) -> None:
    """The reward model's keys not carried over: unmapped where they change its score, else no effect."""
    for key in keys:
        leaf = key.removeprefix(RM).removeprefix(LEGACY).removeprefix("rollout.")
        value = c.get(key)
        if leaf in ("enable", "model_path", "model.path", "dtype", "gpu_memory_utilization", "max_model_len"):
            c.ignore(key, "verl's older place of the same key (reward_model.*) is set and wins (reward_loop.py:62-76)")
        elif leaf in RM_ROLLOUT_REFUSED and value not in (None, False, "", {}):
            c.refuse(key, RM_ROLLOUT_REFUSED[leaf])
        elif leaf == "name" and value == "trtllm":
            c.refuse(key, "verl refuses a TensorRT-LLM reward model (reward_loop.py:248)")
        elif leaf == "name":
            c.ignore(key, f"{value}: vLLM's pooling runner scores the reward model here (the same head's value)")
        elif leaf in ("engine_kwargs", "full_determinism", "disaggregation.enabled") and value:
            c.refuse(key, "another engine setting of the reward model (free-form vLLM arguments, batch-invariant "
                     "or disaggregated serving)")
        elif leaf in ("model.trust_remote_code", "model.external_lib") and value:
            c.refuse(key, "a reward model with its own code: a judge folder with auto_map exits 2 here")
        elif leaf in RM_LAYOUT:
            c.ignore(key, "the reward model runs in-process beside the policy on every rank here, with the policy "
                     "engine's TP (vLLM keeps one model-parallel group per process)")
        elif leaf in RM_SAMPLING or leaf in ("prompt_length", "response_length"):
            c.ignore(key, "a discriminative reward model samples nothing (its context: reward.models[0].max_model_len)")
        else:
            c.ignore(key, "a speed or memory knob of the reward model's engine (the judge here runs eager and sleeps "
                     "outside scoring)")


@rule({})
def components(c):
    """reward.components: the custom function, the reward model or verl's scorer by data_source,
    whichever verl's RewardLoopWorker.compute_score picks (reward_loop.py:145-156)."""
    if c.reward_fn:  # rlcore.task.rewards.CUSTOM: the component of reward.fn
        c.put("reward.components", {"custom": 1.0}, f"{c.said(c.reward_fn)}: verl scores with it alone", c.reward_fn)
    elif c.reward_judge:
        c.put("reward.components", {JUDGE: 1.0}, f"{c.said(c.reward_judge)}: verl scores with the reward model alone",
              c.reward_judge)
    else:
        c.put("reward.components", {"verl": 1.0}, "verl's default_compute_score by each row's data_source "
              f"({c.said('reward.reward_manager.name')})", "reward.reward_manager.name")
