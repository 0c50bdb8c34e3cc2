"""Config of multi-turn, tool-using rollouts: ``rollout.multi_turn``, ``rollout.tool_parser``,
``tools`` and ``env``; and the checks that run before any model loads."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.config_algo import _check_positive, check
from rlcore.exit_codes import ConfigError


@dataclass
class MultiTurnConfig:
    """Conversations over several turns with tool calls (off: one response per prompt)."""

    enable: bool = False
    """Run each sample as a conversation: generate, run its tool calls, append the answers, repeat."""
    max_turns: int = 4
    """Model turns per conversation at most."""
    max_total_tokens: int = 512
    """Tokens after the prompt per conversation (model turns and tool answers together); each model
    turn is also capped by rollout.max_response_length."""
    max_tool_response_tokens: int = 256
    """A tool or environment message is cut to this many tokens of content."""
    chat_template: Optional[str] = None
    """A Jinja chat template file that renders tools (e.g. configs/chat_templates/qwen3.jinja);
    null = the tokenizer's own."""
    first_turn_prefix: Optional[str] = None
    """Text the first model turn starts with, written into the prompt (not trained): e.g. the
    opening of a call (<tool_call> and a newline, for hermes) makes every conversation start with
    one, like tool_choice=required, for a model that does not call tools by itself. The parser reads
    the first turn with it."""
    stop_on: list[str] = field(default_factory=list)
    """Tokens that end a model turn besides EOS (e.g. a call's closing token, when the vocabulary
    has it as one token): the turn's calls run without waiting for the end-of-turn token."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call (the python tool's process is killed at it)."""
    tool_cpu_s: int = 10
    """python tool: CPU seconds of its process."""
    tool_memory_mb: int = 1024
    """python tool: address space of its process, MiB."""
    tool_output_bytes: int = 16384
    """Output of one call kept at most (the python tool is killed past it)."""
    tool_workers: int = 8
    """Tool calls of a turn that run at the same time on a rank."""

    def __post_init__(self):
        _check_positive("rollout.multi_turn", self, "max_turns", "max_total_tokens", "max_tool_response_tokens",
                        "tool_timeout_s", "tool_cpu_s", "tool_memory_mb", "tool_output_bytes", "tool_workers")


@dataclass
class EnvConfig:
    """A user environment for tasks that are not plain tools (with rollout.multi_turn.enable)."""

    cls: Optional[str] = None
    """"path/file.py:Class" or "package.module:Class" with reset(row) -> messages and
    step(messages) -> (new messages, reward or None, done); its reward is the "env" component of
    reward.components. null = no environment (tools only)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class."""


@functools.lru_cache(maxsize=8)
def _tools(specs_json: str) -> dict:
    from rlcore.agent.tools import load_tools
    from rlcore.rewards import load_custom_fn

    return load_tools(json.loads(specs_json), load_custom_fn)


def configured_tools(specs: list) -> dict:
    """name -> Tool of the ``tools`` config, loaded once per process: the config check, the prompt
    renderer and the agent share them (a user's tool file is imported, and runs, once)."""
    return _tools(json.dumps(specs, sort_keys=True))


@functools.lru_cache(maxsize=8)
def load_env_class(ref: str):
    from rlcore.rewards import load_custom_fn

    cls = load_custom_fn(ref)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{ref} has no {' / '.join(missing)} method; an environment needs reset(row) -> messages "
                         "and step(messages) -> (new messages, reward or None, done)")
    return cls


def check_agent(cfg) -> None:
    """Before any model loads: the parser exists, every tool imports and matches its schema, the
    environment class imports, the context holds prompt + conversation, the env reward is wired."""
    mt = cfg.rollout.multi_turn
    uses = bool(cfg.tools) or cfg.env.cls is not None
    if not mt.enable:
        if uses:
            raise ConfigError(f"tools={cfg.tools!r} / env.cls={cfg.env.cls!r} are set but rollout.multi_turn.enable="
                              "false, so no tool would ever run; set rollout.multi_turn.enable: true")
        if "env" in (cfg.reward.components or {}):
            raise ConfigError("reward.components lists 'env' but no environment is configured; set env.cls or "
                              "remove the env component")
        return
    from rlcore.agent.chat import known_parsers

    parsers = known_parsers()
    if cfg.rollout.tool_parser not in parsers:
        raise ConfigError(f"rollout.tool_parser={cfg.rollout.tool_parser!r} is not one of vLLM's tool parsers: "
                          f"choose from {', '.join(parsers)} (hermes for Qwen2.5/Qwen3 <tool_call> JSON)")
    try:
        configured_tools(cfg.tools)
    except ValueError as e:
        raise ConfigError(f"tools: {e}") from e
    if cfg.env.cls is not None:
        try:
            load_env_class(cfg.env.cls)
        except ValueError as e:
            raise ConfigError(f"env.cls={cfg.env.cls!r} is invalid: {e}") from e
    elif not cfg.tools:
        raise ConfigError("rollout.multi_turn.enable=true with no tools and no env.cls: list tools (e.g. "
                          "tools: [calculator]) or set env.cls")
    components = cfg.reward.components or {}
    if cfg.env.cls is None and "env" in components:
        raise ConfigError("reward.components lists 'env' but env.cls is not set; set env.cls or drop the component")
    need = cfg.data.max_prompt_length + mt.max_total_tokens
    check(need <= cfg.rollout.max_model_len, "rollout.multi_turn.max_total_tokens", mt.max_total_tokens,
          f"data.max_prompt_length + it = {need} must fit rollout.max_model_len={cfg.rollout.max_model_len}; "
          "lower it or raise rollout.max_model_len")
    if mt.chat_template is not None:
        import os

        check(os.path.isfile(mt.chat_template), "rollout.multi_turn.chat_template", mt.chat_template,
              "no such file; give a Jinja template file, or null for the tokenizer's own")
