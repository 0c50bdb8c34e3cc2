"""The ``distill`` config section (on-policy distillation) and its checks, which run before
anything loads: the teacher folder is a causal LM, its tokenizer is the student's, and the
combination with the rest of the config makes sense."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rlcore.algo.distill import DIVERGENCES, MODES
from rlcore.errors import ConfigError, check
from rlcore.hf_folder import config_or_empty, read_config


@dataclass
class DistillConfig:
    """A teacher scores every sampled token of the student (an in-process vLLM engine beside the
    policy's, asleep except while it scores); the per-token reverse KL becomes the advantage."""

    teacher: Optional[str] = None
    """Local HF folder of the teacher model (same tokenizer as model.path); null = no distillation."""
    mode: str = "reverse_kl"
    """reverse_kl: per-token advantage -(log p_student(y_t) - log p_teacher(y_t)) on the sampled tokens;
    topk: a divergence over the teacher's top-k tokens (plus a tail bin) at every response position,
    added to the loss (GKD)."""
    topk: int = 16
    """topk mode: k, the teacher's most likely tokens per position (at most 20: vLLM's max_logprobs)."""
    divergence: str = "jsd"
    """topk mode: forward_kl (teacher || student), reverse_kl (student || teacher) or jsd (GKD's, with beta)."""
    beta: float = 0.5
    """topk mode, jsd: the mixture weight of the teacher (GKD's beta; 0.5 = the symmetric JSD)."""
    coef: float = 1.0
    """Weight of the distillation advantage."""
    advantage_clamp: Optional[float] = None
    """reverse_kl: the per-token log-ratio is clamped to [-advantage_clamp, advantage_clamp] before it
    becomes the advantage (verl's distillation_loss.loss_max_clamp); null = not clamped."""
    reward_weight: float = 0.0
    """Weight of the reward's group advantage (reward.components) beside it; 0 = distillation alone
    (rewards are still scored and logged: reward/mean shows the task's progress)."""
    temperature: Optional[float] = None
    """Temperature of the teacher's log-probs; null = rollout.temperature (the student's sampling one)."""
    max_model_len: Optional[int] = None
    """Teacher context; null = rollout.max_model_len + 1 (vLLM scores a sequence as a prompt that
    must leave room for one generated token)."""
    kv_cache_gb: float = 0.25
    """CPU: the teacher's KV cache."""
    gpu_memory_utilization: float = 0.3
    """Accelerators: the teacher engine's share of device memory while it scores."""
    sleep_level: Optional[int] = None
    """Accelerators, outside scoring: 1 = weights to host memory, 2 = discarded and reloaded from
    teacher; null = 1. CPU: its KV cache buffer is freed, or its storages under rollout.emulate_sleep."""
    dtype: Optional[str] = None
    """The teacher's dtype; null = the policy's rollout dtype."""

    def __post_init__(self):
        check(self.mode in MODES, "distill.mode", self.mode, f"choose one of {', '.join(MODES)}")
        check(1 <= self.topk <= 20, "distill.topk", self.topk,
              "it must be in [1, 20] (vLLM returns at most max_logprobs = 20 log-probs per position)")
        check(self.divergence in DIVERGENCES, "distill.divergence", self.divergence,
              f"choose one of {', '.join(sorted(DIVERGENCES))}")
        check(0 < self.beta < 1, "distill.beta", self.beta, "it must be in (0, 1), e.g. 0.5")
        check(self.advantage_clamp is None or self.advantage_clamp > 0, "distill.advantage_clamp",
              self.advantage_clamp, "it must be > 0, or null for no clamp")
        check(self.coef > 0, "distill.coef", self.coef, "it must be > 0 (to turn distillation off, unset distill.teacher)")
        check(self.reward_weight >= 0, "distill.reward_weight", self.reward_weight,
              "it must be >= 0 (0 = distillation alone)")
        check(self.temperature is None or self.temperature > 0, "distill.temperature", self.temperature,
              "it must be > 0, or null for rollout.temperature")
        check(self.max_model_len is None or self.max_model_len > 0, "distill.max_model_len", self.max_model_len,
              "it must be > 0, or null for rollout.max_model_len + 1")
        check(self.kv_cache_gb > 0, "distill.kv_cache_gb", self.kv_cache_gb, "it must be > 0 GiB")
        check(0 < self.gpu_memory_utilization < 1, "distill.gpu_memory_utilization", self.gpu_memory_utilization,
              "it must be in (0, 1): the teacher engine's share of the device while it scores")
        check(self.sleep_level in (None, 1, 2), "distill.sleep_level", self.sleep_level,
              "choose 1 (weights to host) or 2 (discarded, reloaded from distill.teacher), or null")
        check(self.dtype in (None, "float32", "bfloat16"), "distill.dtype", self.dtype,
              "choose float32, bfloat16 or null")

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    def loss_options(self) -> dict | None:
        """What the train phase needs for the top-k loss term (rlcore.algo.grpo), or None."""
        if not self.enabled or self.mode != "topk":
            return None
        return {"divergence": self.divergence, "beta": self.beta, "coef": self.coef}

    # what rlcore.rollout.judge.JudgeEngine reads of an engine's section (rlcore.protocols.EngineSection)
    name = "teacher"
    generative = True

    @property
    def path(self) -> str:
        return self.teacher or ""


def check_distill(d: DistillConfig, *, model_path: str, image_key: str | None, dynamic_sampling: bool) -> None:
    """The section against the rest of the config (``model.path``, ``data.image_key``,
    ``algorithm.dynamic_sampling``) and the teacher's folder, before anything loads."""
    if not d.enabled:
        return
    check_teacher_model(d.teacher)
    if d.reward_weight == 0:
        check(not dynamic_sampling, "algorithm.dynamic_sampling", True,
              "it keeps the groups whose rewards differ, but distill.reward_weight=0 trains on the teacher's signal "
              "alone, which every sample has: set algorithm.dynamic_sampling: false, or distill.reward_weight > 0")
    if image_key is not None:
        from rlcore.rollout.settings import is_multimodal_config

        check(is_multimodal_config(config_or_empty(d.teacher)), "distill.teacher", d.teacher,
              f"the prompts carry images (data.image_key={image_key!r}) but the teacher's config.json has "
              "no vision config: a text-only teacher cannot read them; use a vision-language teacher of the "
              "student's family")
    mismatch = tokenizer_difference(model_path, d.teacher)
    if mismatch:
        raise ConfigError(f"distill.teacher={d.teacher!r} does not share model.path's tokenizer: {mismatch}. "
                          "Per-token distillation compares the two models' log-probs of the same token ids, so "
                          "vocabulary, special tokens and chat template must be equal. For a teacher of another "
                          "family, distill its outputs offline (SFT on teacher samples) or pick a teacher of the "
                          "student's family")


def check_teacher_model(path: str) -> dict:
    """The teacher folder is a causal LM with tokenizer files (before anything loads); its config.json."""
    try:
        config = read_config(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher={path!r} is not a model folder ({e}); point it at a local HF model "
                          "(config.json, *.safetensors, tokenizer files)") from None
    archs = config.get("architectures") or []
    if any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs):
        raise ConfigError(f"distill.teacher={path!r} is a {archs[0]} (a score head, no token distribution): "
                          "the teacher must be a causal LM (*ForCausalLM)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"distill.teacher={path!r} has no tokenizer files; copy the teacher's tokenizer into it")
    return config


def tokenizer_difference(student: str, teacher: str) -> str | None:
    """The first difference between the two folders' tokenizers (vocabulary, special tokens, chat
    template), or None when they are the same."""
    from transformers import AutoTokenizer

    loaded = []
    for key, path in (("model.path", student), ("distill.teacher", teacher)):
        try:
            loaded.append(AutoTokenizer.from_pretrained(path))
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a folder without one
            raise ConfigError(f"{key}={path!r}: its tokenizer does not load ({type(e).__name__}: {e}); the "
                              "distillation check compares the two tokenizers: copy the model's tokenizer files "
                              "into the folder") from None
    a, b = loaded
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary of {len(vb)} tokens, the student's has {len(va)}"
    for token, i in sorted(va.items(), key=lambda kv: kv[1]):
        if vb.get(token) != i:
            return f"token {token!r} is id {i} for the student, {vb.get(token)} for the teacher"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            return f"{attr} {getattr(b, attr, None)}, the student's is {getattr(a, attr, None)}"
    if sorted(a.all_special_ids) != sorted(b.all_special_ids):
        return f"special token ids {sorted(b.all_special_ids)}, the student's are {sorted(a.all_special_ids)}"
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        return "the chat templates differ"
    return None
