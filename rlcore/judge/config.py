"""One entry of ``reward.models``: a reward model served by its own colocated vLLM engine.

An entry is a reward component like ``math``: its ``name`` is the key of its weight in
``reward.components``. Entries arrive as plain mappings (YAML list items) and are checked here
field by field, so a typo names the valid keys instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from rlcore.errors import ConfigError, check
from rlcore.hf_folder import read_config

KINDS = ("generative", "discriminative")
DEFAULT_PARSER = r"(-?\d+(?:\.\d+)?)"  # the last number of the judge's answer


@dataclass
class JudgeConfig:
    """A generative judge (samples an answer, a parser reads the score) or a discriminative reward
    model (a sequence-classification head scored by vLLM's pooling runner)."""

    name: str = ""
    """Component name: its weight is reward.components[name]; metrics reward/<name>."""
    path: str = ""
    """Local HF folder of the judge model (config.json, weights, tokenizer)."""
    kind: str = "generative"
    """generative (LLM-as-judge) or discriminative (ForSequenceClassification / reward model)."""
    template: Optional[str] = None
    """What the judge reads: a Jinja template ({{ prompt }}, {{ response }}, {{ answer }}, any row
    field) or a format string ({prompt}, {response}, ...). Generative: required, sent as the user
    message of the judge's chat template (chat_template: false sends it as is). Discriminative:
    null = the judge's chat template over [user: prompt, assistant: response]."""
    chat_template: bool = True
    """Generative: wrap the rendered template in the judge tokenizer's chat template."""
    parser: str = DEFAULT_PARSER
    """Generative: a regex (the first group of its last match is the score; default: the last
    number) or "path/file.py:function" / "package.module:function" (text -> float or None)."""
    parse_fail_value: float = 0.0
    """Score of an answer the parser cannot read (counted in reward/<name>_parse_fail_frac)."""
    score_range: Optional[list[float]] = None
    """[lo, hi]: scores are mapped linearly to [0, 1] and clipped (a 1-10 rubric: [1, 10]); null = as parsed."""
    pass_threshold: float = 1.0
    """A sample passes this component (reward/accuracy, val/accuracy) when its value is >= this (1, as
    for the rule rewards; e.g. 0.5 for a sigmoid head or a [lo, hi] rubric mapped to [0, 1])."""
    activation: str = "none"
    """Discriminative: none (the head's raw value) or sigmoid."""
    max_tokens: int = 64
    """Generative: answer tokens at most."""
    temperature: float = 0.0
    """Generative: 0 = greedy (the default: reproducible scores)."""
    tensor_parallel_size: Optional[int] = None
    """null = rollout.tensor_parallel_size (the only value an in-process engine can have, see check_judge)."""
    max_model_len: int = 2048
    """Judge context: the rendered prompt plus max_tokens."""
    kv_cache_gb: float = 0.25
    """CPU: the judge's KV cache."""
    gpu_memory_utilization: float = 0.2
    """Accelerators: the judge engine's share of device memory while it is awake."""
    sleep_level: Optional[int] = None
    """Accelerators, while the judge is not scoring: 1 = weights to host memory, 2 = discarded and
    reloaded from path; null = 1. CPU: its KV cache buffer is freed (vLLM has no sleep on CPU), or,
    under rollout.emulate_sleep, its storages as on accelerators."""
    dtype: Optional[str] = None
    """The judge's dtype; null = the policy's rollout dtype."""
    timeout_s: Optional[float] = None
    """Per sample, for a function parser; null = no limit (generation is bounded by max_tokens)."""

    @property
    def generative(self) -> bool:
        return self.kind == "generative"


def parse_judges(entries: list[Any] | None) -> list[JudgeConfig]:
    """``reward.models`` as JudgeConfigs: every field checked, an unknown key named with the valid ones."""
    out, fields = [], {f.name for f in dataclasses.fields(JudgeConfig)}
    for i, entry in enumerate(entries or []):
        where = f"reward.models[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}={entry!r}: each entry is a mapping with name, path, kind, ...")
        unknown = sorted(set(entry) - fields)
        check(not unknown, where, unknown, f"unknown keys; valid: {', '.join(sorted(fields))}")
        judge = JudgeConfig(**entry)
        _check_fields(judge, where)
        out.append(judge)
    names = [j.name for j in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    check(not dupes, "reward.models", dupes, "each judge needs its own name")
    return out


def _check_fields(j: JudgeConfig, where: str) -> None:
    from rlcore.judge.prompts import compile_parser, compile_template

    check(bool(j.name) and j.name.isidentifier(), f"{where}.name", j.name,
          "give it a name (letters, digits, _): its weight goes under reward.components[name]")
    check(j.kind in KINDS, f"{where}.kind", j.kind, f"choose one of {', '.join(KINDS)}")
    check(bool(j.path), f"{where}.path", j.path, "set the local folder of the judge model")
    check(not j.generative or bool(j.template), f"{where}.template", j.template,
          "a generative judge needs a template naming {{ response }} (and e.g. {{ prompt }}, {{ answer }})")
    if j.template is not None:
        try:
            compile_template(j.template)
        except ValueError as e:
            check(False, f"{where}.template", j.template, str(e))
    if j.generative:
        try:
            compile_parser(j.parser)
        except ValueError as e:
            check(False, f"{where}.parser", j.parser, str(e))
    check(j.activation in ("none", "sigmoid"), f"{where}.activation", j.activation, "choose none or sigmoid")
    check(j.score_range is None or (len(j.score_range) == 2 and j.score_range[0] < j.score_range[1]),
          f"{where}.score_range", j.score_range, "give [lo, hi] with lo < hi, e.g. [1, 10]")
    check(j.max_tokens > 0 and j.max_model_len > 0, f"{where}.max_tokens", j.max_tokens,
          "max_tokens and max_model_len must be > 0")
    check(0 < j.gpu_memory_utilization < 1, f"{where}.gpu_memory_utilization", j.gpu_memory_utilization,
          "it must be in (0, 1): the judge engine's share of the device while it scores")
    check(j.kv_cache_gb > 0, f"{where}.kv_cache_gb", j.kv_cache_gb, "it must be > 0 GiB")
    check(j.temperature >= 0, f"{where}.temperature", j.temperature, "it must be >= 0 (0 = greedy)")
    check(j.sleep_level in (None, 1, 2), f"{where}.sleep_level", j.sleep_level,
          "choose 1 (weights to host) or 2 (discarded, reloaded from path), or null")
    check(j.dtype in (None, "float32", "bfloat16"), f"{where}.dtype", j.dtype, "choose float32, bfloat16 or null")
    check(j.timeout_s is None or j.timeout_s > 0, f"{where}.timeout_s", j.timeout_s, "it must be > 0 or null")


def check_judges(cfg) -> None:
    """``reward.models`` and ``val.reward_components`` against the rest of the config (rlcore.config.Config)
    and the judges' folders, before anything loads."""
    from rlcore.task.rewards import CUSTOM, ENV, REWARDS

    judges = cfg.reward.judges()
    for i, j in enumerate(judges):
        check_judge_model(j, f"reward.models[{i}]")
        check_judge_world(j, f"reward.models[{i}]", cfg.rollout.tensor_parallel_size)
    valid = {*REWARDS, *(j.name for j in judges), *([CUSTOM] if cfg.reward.fn else []), ENV}
    for name in cfg.val.reward_components or {}:
        check(name in valid, "val.reward_components", name, f"choose from {', '.join(sorted(valid))}")
    used = {*cfg.reward.effective_components(), *(cfg.val.reward_components or {})}
    unused = [j.name for j in judges if j.name not in used]
    check(not unused, "reward.models", unused, "give each judge a weight in reward.components (or in "
          f"val.reward_components for validation only), e.g. {unused[0] if unused else ''}: 1.0")


def check_judge_data(judges: list[JudgeConfig], rows: list) -> None:
    """Every field a judge's template names exists in the data rows (``rows``: dicts)."""
    for i, j in enumerate(judges):
        if not j.template:
            continue
        from rlcore.judge.prompts import Template

        template = Template(j.template)
        for row in rows:
            missing = template.missing(row or {})
            check(not missing, f"reward.models[{i}].template", j.template,
                  f"it names {missing} but a data row has only {sorted(row or {})} (besides prompt, response, "
                  "answer): fix the field names or the data")


def check_judge_world(j: JudgeConfig, where: str, rollout_tp: int) -> None:
    """The judge's TP against this launch. vLLM keeps one set of model-parallel groups per process
    (vllm 0.32 distributed/parallel_state.py:2392 ``ensure_model_parallel_initialized`` asserts
    that a second engine's TP equals the first one's), so an in-process judge shares the policy
    engine's TP size: its TP group is the policy engine's (rollout.tensor_parallel_size is checked
    against the world size in rlcore.run.preflight)."""
    tp = j.tensor_parallel_size or rollout_tp
    check(tp == rollout_tp, f"{where}.tensor_parallel_size", tp,
          f"an in-process judge must use the policy engine's TP size {rollout_tp} (vLLM keeps one model-parallel "
          f"group per process); set it to {rollout_tp} or leave it null")


def check_judge_model(j: JudgeConfig, where: str) -> dict:
    """The judge folder is a model of the right kind (before anything loads); its config.json."""
    cfg_path = os.path.join(j.path, "config.json")
    try:
        config = read_config(j.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}.path={j.path!r} is not a model folder ({cfg_path}: {e}); point it at a local "
                          "HF model (config.json, *.safetensors, tokenizer files)") from None
    archs = config.get("architectures") or []
    scorer = any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs)
    if j.generative and scorer:
        raise ConfigError(f"{where}.path={j.path!r} is a {archs[0]} (a score head, no text): use kind: discriminative")
    if not j.generative and not scorer:
        raise ConfigError(f"{where}.path={j.path!r} has architectures {archs}, no sequence-classification or "
                          "reward-model head: use kind: generative with a template and parser, or a "
                          "*ForSequenceClassification / *ForRewardModel folder")
    if not any(os.path.isfile(os.path.join(j.path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{where}.path={j.path!r} has no tokenizer files; copy the judge's tokenizer into it")
    return config
