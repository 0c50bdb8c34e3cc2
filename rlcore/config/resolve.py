"""Dependent defaults, filled in once after parsing (``resolve``): the values a config leaves at
``None`` or ``"auto"`` that depend on another field, the model folder or the device (dtype,
attention, MoE kernels, vLLM's sleep level, block size, eager mode, the sync check). The device
choices themselves (``pick_*``) belong to the engines that make them; this module only asks.
"""

from __future__ import annotations

import dataclasses
import os

from rlcore.agent.config import check_agent
from rlcore.algo.log_prob import check_log_prob_tokens
from rlcore.config.lora import check_lora
from rlcore.config.sections import Config
from rlcore.distill.config import check_distill
from rlcore.errors import ConfigError
from rlcore.hf_folder import model_num_experts
from rlcore.judge.config import check_judges
from rlcore.rollout.engine_keys import check_config as check_engine_keys
from rlcore.task import verl_rows


def _share_prompt(cfg: Config, attn: str) -> bool:
    """algorithm.share_prompt: null = on where the attention takes a dense mask, but for Ulysses,
    whose packed rows are attended sequence by sequence with no mask at all, where a shared prompt
    costs each rank the row's whole (S, S) mask (rlcore.engine.ulysses)."""
    return attn in ("sdpa", "eager") and cfg.parallel.ulysses_size == 1


def _lora_sleep_level(cfg: Config, level: int) -> int:
    """LoRA pushes only the adapter: vLLM's base weights must survive the sleep (level 1 keeps
    them in host memory; level 2 discards them, and nothing would write them back)."""
    if not cfg.lora.enabled:
        return level
    if cfg.rollout.sleep_level == 2:
        raise ConfigError("rollout.sleep_level=2 is invalid with LoRA (lora.rank > 0): level 2 discards vLLM's base "
                          "weights and the LoRA sync pushes only the adapter; set rollout.sleep_level: 1 (or null)")
    return min(level, 1)


SYNC_CHECK_EVERY_WARN = 10  # rollout.check_sync_every's default under warn (see its field)
PARTIAL_IS_LEVEL = "token"  # rollout_correction.is_level's default with rollout.partial (docs/partial_rollouts.md)


def _correction(cfg: Config):
    """rollout_correction with its partial-rollouts default: null is_level becomes PARTIAL_IS_LEVEL
    when rollout.partial is on and no other correction (tis_cap, rs) or vLLM's own log-probs as the
    ratio's denominator (algorithm.use_rollout_logprobs) is set; ``off`` stays off."""
    c = cfg.rollout_correction
    if (cfg.rollout.partial.enable and c.is_level is None and c.tis_cap is None and c.rs is None
            and not cfg.algorithm.use_rollout_logprobs):
        return dataclasses.replace(c, is_level=PARTIAL_IS_LEVEL)
    return c


def _check_sync(cfg: Config) -> str:
    """The sync check scores prompt log-probs in vLLM, which an engine built with LoRA cannot (vllm
    0.32: its LoRA logits processor indexes only the sampled rows, lora/punica_wrapper/punica_cpu.py:
    349 -> lora/ops/torch_ops/lora_ops.py:78, even for requests without an adapter)."""
    mode = cfg.rollout.check_sync
    if not cfg.lora.enabled:
        return mode or "warn"
    if mode in ("warn", "strict"):
        raise ConfigError(f"rollout.check_sync={mode!r} is invalid with LoRA (lora.rank > 0): vLLM's LoRA engine "
                          f"cannot score the probe's prompt log-probs; set rollout.check_sync: off (or null). The "
                          f"adapter's sync shows in rollout/mismatch_kl and rollout/mismatch_max every step")
    return "off"


def _check_sync_every(r, mode: str) -> int:
    """null: every sync under strict (it promises to stop before a bad sync's samples train), every
    SYNC_CHECK_EVERY_WARN-th under warn (the probe costs a trainer all-gather of the weights)."""
    if r.check_sync_every is not None:
        return r.check_sync_every
    return 1 if mode == "strict" else SYNC_CHECK_EVERY_WARN


DEFAULT_TOTAL_STEPS = 10  # trainer.total_steps when neither it nor trainer.total_epochs is set


def _total_steps(t) -> int | None:
    """trainer.total_steps null: DEFAULT_TOTAL_STEPS, unless trainer.total_epochs is set (then it stays
    null here and ``rlcore.run.preflight.resolve_total_steps`` computes it once the data is read)."""
    if t.total_steps is None and t.total_epochs is None:
        return DEFAULT_TOTAL_STEPS
    return t.total_steps


def _has_vision(model_path: str) -> bool:
    from rlcore.hf_folder import config_or_empty
    from rlcore.rollout.settings import is_multimodal_config

    return is_multimodal_config(config_or_empty(model_path))


def check_routing_replay(mode: str | None, model_path: str, experts: int) -> None:
    """Before loading: replay needs a mixture-of-experts model of a family VeOmni's replay hook is
    wired into (its own list, veomni/utils/moe_router_replay.py)."""
    if mode is None:
        return
    from rlcore.engine.replay import supported_model_types
    from rlcore.hf_folder import config_or_empty

    model_type = config_or_empty(model_path).get("model_type")
    families = ", ".join(sorted(supported_model_types()))
    if not experts or model_type not in supported_model_types():
        raise ConfigError(f"algorithm.routing_replay={mode!r} is invalid for model.path={model_path!r} "
                          f"(model_type {model_type!r}, {experts} experts): routing replay needs a mixture-of-"
                          f"experts model of a family replay is wired for ({families}); "
                          f"set algorithm.routing_replay: null")


def check_partial(cfg: Config) -> None:
    """rollout.partial against what it supports (single-turn text prompts, one group size)."""
    if not cfg.rollout.partial.enable:
        return
    others = {"data.image_key": cfg.data.image_key, "algorithm.routing_replay": cfg.algorithm.routing_replay}
    for key, value in others.items():
        if value:
            raise ConfigError(f"rollout.partial.enable=true with {key}={value!r}: partial rollouts support "
                              f"text prompts without routing replay for now; turn one of them off")
    if cfg.rollout.multi_turn.enable and cfg.env.cls:
        raise ConfigError(f"rollout.partial.enable=true with env.cls={cfg.env.cls!r}: a suspended conversation is "
                          f"checkpointed as plain data, and an environment's state is not; use plain tools "
                          f"(tools: ...) with partial rollouts, or turn rollout.partial off")
    if cfg.algorithm.dynamic_sampling and cfg.reward.models:
        raise ConfigError(f"rollout.partial.enable=true with algorithm.dynamic_sampling=true and reward.models="
                          f"{[m.get('name') if isinstance(m, dict) else m for m in cfg.reward.models]!r}: the filter "
                          f"scores each group as it finishes, a chunk at a time, and a judge's engine would be woken "
                          f"for every chunk; turn algorithm.dynamic_sampling or rollout.partial off, or score with "
                          f"rule-based rewards")


def resolve(cfg: Config, device_type: str) -> Config:
    """A copy of ``cfg`` with every default that depends on another field or on the device filled
    in (the ``null`` / ``auto`` values documented on the fields), checked where the combination
    is what matters. Call once, after parsing; resolving a resolved config changes nothing."""
    from rlcore.engine.attention import pick_attn_implementation
    from rlcore.engine.moe import pick_moe_implementation
    from rlcore.rollout.settings import pick_block_size, pick_enforce_eager, pick_sleep_level, pick_weight_load

    accel = device_type != "cpu"
    found = verl_rows.detect(cfg.data.train_files, cfg.data.prompt_key)  # verl's rows: their keys and reward
    cfg = dataclasses.replace(cfg, data=verl_rows.resolve_data(cfg.data, found))
    m, r, o = cfg.model, cfg.rollout, cfg.offload
    if r.emulate_sleep and accel:
        raise ConfigError(f"rollout.emulate_sleep=true is for CPU runs (tests, debugging); on {device_type} vLLM's "
                          f"sleep mode is real: set rollout.emulate_sleep: false")
    if r.emulate_ascend_moe and not r.emulate_sleep:
        raise ConfigError("rollout.emulate_ascend_moe=true emulates what an Ascend engine's wake-up does to the "
                          "experts, on a CPU engine that sleeps as a device's: set rollout.emulate_sleep: true too")
    params = accel if o.params is None else o.params
    check_sync = _check_sync(cfg)
    experts = model_num_experts(m.path)
    try:
        weight_load = pick_weight_load(device_type, r.weight_load, moe=experts > 0)
    except ValueError as e:
        raise ConfigError(f"rollout.weight_load={r.weight_load!r} is invalid: {e}") from e
    try:
        block_size = pick_block_size(device_type, r.block_size, r.enable_prefix_caching)
    except ValueError as e:
        raise ConfigError(f"rollout.block_size={r.block_size!r} is invalid on {device_type}: {e}") from e
    dtype = m.dtype or ("bfloat16" if accel else "float32")
    try:
        attn = pick_attn_implementation(m.attn_implementation, device_type, dtype=dtype)[0]
    except ValueError as e:
        raise ConfigError(f"model.attn_implementation={m.attn_implementation!r} is invalid: {e}") from e
    try:
        moe = pick_moe_implementation(m.moe_implementation, device_type, cfg.parallel.ep_size)
    except ValueError as e:
        raise ConfigError(f"model.moe_implementation={m.moe_implementation!r} is invalid: {e}") from e
    check_routing_replay(cfg.algorithm.routing_replay, m.path, experts)
    check_lora(cfg.lora, m.path, experts, vision=_has_vision(m.path))
    check_agent(cfg)
    check_judges(cfg)
    check_distill(cfg.distill, model_path=cfg.model.path, image_key=cfg.data.image_key,
                  dynamic_sampling=cfg.algorithm.dynamic_sampling)
    check_partial(cfg)
    check_engine_keys(cfg, device_type)  # rollout.enable_chunked_prefill / enable_expert_parallel / engine_kwargs
    mt = cfg.rollout.multi_turn  # a sample packs its prompt and its response (a multi-turn conversation's whole tail)
    check_log_prob_tokens(cfg.algorithm, cfg.rollout.max_model_len if cfg.rollout.agent.enable  # an agent's segment
                          else cfg.data.max_prompt_length + (mt.max_total_tokens if mt.enable
                                                             else cfg.rollout.max_response_length))
    if cfg.algorithm.use_rollout_logprobs and cfg.rollout_correction.options() is not None:
        raise ConfigError("rollout_correction.is_level/rs compare the trainer's old log-probs with vLLM's, but "
                          "algorithm.use_rollout_logprobs=true replaces the former with the latter (every ratio 1): "
                          "set algorithm.use_rollout_logprobs: false, or turn is_level and rs off")
    share = cfg.algorithm.share_prompt
    if share and attn not in ("sdpa", "eager"):
        raise ConfigError(f"algorithm.share_prompt=true needs a dense attention mask, but model.attn_implementation "
                          f"resolves to {attn!r} on {device_type}: set model.attn_implementation: sdpa, or "
                          f"algorithm.share_prompt: false (or null to decide per device)")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(m, dtype=dtype, attn_implementation=attn, moe_implementation=moe),
        algorithm=dataclasses.replace(cfg.algorithm,
                                      share_prompt=_share_prompt(cfg, attn) if share is None else share,
                                      oversample=accel if cfg.algorithm.oversample is None else cfg.algorithm.oversample),
        rollout=dataclasses.replace(
            r, sleep_level=_lora_sleep_level(cfg, pick_sleep_level(device_type, r.sleep_level, r.emulate_sleep)),
            weight_load=weight_load,
            dtype=r.dtype or dtype, check_sync=check_sync, check_sync_every=_check_sync_every(r, check_sync),
            block_size=block_size,
            enforce_eager=pick_enforce_eager(device_type, r.enforce_eager)),
        offload=dataclasses.replace(o, params=params, optimizer=accel if o.optimizer is None else o.optimizer,
                                    ref=params if o.ref is None else o.ref),
        reward=dataclasses.replace(cfg.reward, components=cfg.reward.effective_components(verl_rows=found is not None)),
        rollout_correction=_correction(cfg),
        val=dataclasses.replace(cfg.val, max_response_length=cfg.val.max_response_length or r.max_response_length),
        distill=dataclasses.replace(cfg.distill, temperature=cfg.distill.temperature or r.temperature,
                                    max_model_len=cfg.distill.max_model_len or r.max_model_len + 1),
        trainer=dataclasses.replace(cfg.trainer, total_steps=_total_steps(cfg.trainer),
                                    output_dir=cfg.trainer.output_dir or os.path.join("outputs", "run")),
    )
