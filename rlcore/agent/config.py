"""Config of multi-turn, tool-using rollouts: ``rollout.multi_turn``, ``rollout.tool_parser``,
``tools`` and ``env``; and the checks that run before any model loads."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.errors import ConfigError, check, check_positive


@dataclass
class ToolsSandboxConfig:
    """Where the python tool (and user tools with sandboxed: true) run: docs/tools.md has the table
    of threats against backends."""

    backend: str = "auto"
    """auto (the strongest that works here: bwrap, namespaces, uid, process), bwrap (bubblewrap),
    namespaces (unprivileged user namespaces, no bwrap needed), uid (a root trainer where namespaces
    are forbidden: a uid per call, weaker), process (a plain child, weakest), remote (your own
    SandboxFusion-style service at url)."""
    strict: bool = False
    """Refuse to start unless the backend in effect is bwrap, namespaces or remote."""
    url: Optional[str] = None
    """backend remote: the service's base URL (POST {url}/run_code), e.g. http://sandbox:8080."""
    python: Optional[str] = None
    """The interpreter the child runs (null: the trainer's own base installation). The uid backend
    needs one every user can read, e.g. /usr/bin/python3, when the trainer's sits under /root."""
    uid_base: int = 1_000_000_000
    """Root trainers: calls run as uids above uid_base, one per concurrent call, in a block of 256
    per process (keyed by its pid, so the ranks of a node never share one); the range is 2^30 uids
    wide: pick one no real user or service holds."""
    max_procs: int = 0
    """Further processes one call may start (RLIMIT_NPROC, not enforced for uid 0; and the call's
    control group's pids cap, which is, at max_procs + 6 with the sandbox's own processes)."""
    cgroup: str = "auto"
    """A control group per call (memory, processes, CPU bounded for the whole call; every process
    killed at its end): auto (where this process may make one: cgroup v2 delegated to its group or
    parent, or a writable v1 hierarchy), off, required (refuse to start without one)."""
    cpus: Optional[float] = 1.0
    """The CPU quota of a call's control group, in CPUs (null: none)."""

    def __post_init__(self):
        from rlcore.agent.sandbox import BACKENDS

        key = "rollout.multi_turn.tools_sandbox"
        check(self.backend in BACKENDS, f"{key}.backend", self.backend, f"choose one of {', '.join(BACKENDS)}")
        check(self.backend != "remote" or bool(self.url), f"{key}.url", self.url,
              "backend: remote needs the service's URL, e.g. url: http://sandbox-host:8080")
        check(self.cgroup in ("auto", "off", "required"), f"{key}.cgroup", self.cgroup,
              "choose auto, off or required")
        check(self.cpus is None or self.cpus > 0, f"{key}.cpus", self.cpus, "it must be > 0 (or null: no quota)")
        check(self.url is None or str(self.url).startswith(("http://", "https://")), f"{key}.url", self.url,
              "give an http:// or https:// URL")
        check(0 < self.uid_base < 2**32 - 2**16 - 2**30, f"{key}.uid_base", self.uid_base,
              f"a uid between 1 and {2**32 - 2**16 - 2**30} (uids uid_base .. uid_base + 2^30 are used)")
        check(self.max_procs >= 0, f"{key}.max_procs", self.max_procs, "it must be >= 0")
        check(self.python is None or bool(self.python), f"{key}.python", self.python,
              "give an interpreter path, or null for the trainer's own")


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
    tools_sandbox: ToolsSandboxConfig = field(default_factory=ToolsSandboxConfig)
    """Isolation of the python tool and of sandboxed user tools."""

    def __post_init__(self):
        check_positive("rollout.multi_turn", self, "max_turns", "max_total_tokens", "max_tool_response_tokens",
                        "tool_timeout_s", "tool_cpu_s", "tool_memory_mb", "tool_output_bytes", "tool_workers")
        check(self.tool_workers <= 256, "rollout.multi_turn.tool_workers", self.tool_workers,
              "at most 256 calls run at once per rank (each sandboxed call takes a uid of the rank's block)")


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
    from rlcore.task.rewards import load_custom_fn

    return load_tools(json.loads(specs_json), load_custom_fn)


def configured_tools(specs: list) -> dict:
    """name -> Tool of the ``tools`` config, loaded once per process: the config check, the prompt
    renderer and the agent share them (a user's tool file is imported, and runs, once)."""
    return _tools(json.dumps(specs, sort_keys=True))


@functools.lru_cache(maxsize=8)
def load_env_class(ref: str):
    from rlcore.task.rewards import load_custom_fn

    cls = load_custom_fn(ref)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{ref} has no {' / '.join(missing)} method; an environment needs reset(row) -> messages "
                         "and step(messages) -> (new messages, reward or None, done)")
    return cls


def sandbox_limits(mt):
    """The sandbox's Limits from rollout.multi_turn (its tool_* limits and tools_sandbox)."""
    from rlcore.agent.sandbox import Limits

    sb = mt.tools_sandbox
    sb = ToolsSandboxConfig(**sb) if isinstance(sb, dict) else sb
    return Limits(timeout_s=mt.tool_timeout_s, cpu_s=mt.tool_cpu_s, memory_mb=mt.tool_memory_mb,
                  output_bytes=mt.tool_output_bytes, max_procs=sb.max_procs, backend=sb.backend, strict=sb.strict,
                  python=sb.python, url=sb.url, uid_base=sb.uid_base, cgroup=sb.cgroup, cpus=sb.cpus)


def _check_sandbox(mt) -> None:
    """The configured backend runs on this host (probed once), and strict accepts it."""
    from rlcore.agent.sandbox import SandboxUnavailable, check as check_sandbox

    try:
        check_sandbox(sandbox_limits(mt))
    except SandboxUnavailable as e:
        raise ConfigError(f"rollout.multi_turn.tools_sandbox: {e}") from e


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
        tools = configured_tools(cfg.tools)
    except ValueError as e:
        raise ConfigError(f"tools: {e}") from e
    if any(t.sandboxed for t in tools.values()):
        _check_sandbox(mt)
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
