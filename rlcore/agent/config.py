"""Config of multi-turn, tool-using rollouts: ``rollout.multi_turn``, ``rollout.tool_parser``,
``tools`` and ``env``; of black-box agents on the endpoint: ``rollout.agent``; and the checks that
run before any model loads."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

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
class AgentConfig:
    """Your own agent program against an OpenAI-compatible endpoint on each rank (docs/agents.md)."""

    entry: Optional[str] = None
    """"path/to/agent.py:run" or "package.module:run": called once per sample as
    run(row=..., base_url=..., api_key=...) (also model, seed, sandbox_url and kwargs, where it takes
    them), it talks to the rank's endpoint with any OpenAI client and returns its reward (a number),
    or None for the reward components to score its last completion. null = off."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of run() (JSON values)."""
    workers: Literal["process", "thread"] = "process"
    """process: each episode in its own process, forked from a fresh interpreter that imported the
    agent once (killed at its time limit); thread: in the trainer's threads (a hung one cannot be
    killed; for debugging)."""
    timeout_s: float = 600.0
    """Wall-clock limit of one episode: past it the episode fails (reward 0) and its process is killed."""
    concurrency: Optional[int] = None
    """Episodes running at once per rank (null: all of the call's)."""
    max_requests: int = 64
    """Completions one episode may ask for; a request past it is refused and the episode scored as it
    stands (finish "length")."""
    batching: Literal["continuous", "turns"] = "continuous"
    """continuous: a request joins the running batch when it arrives; turns: requests wait until every
    running episode has one, then go in together (the built-in loop's batches)."""
    segment_advantage: Literal["shared", "last"] = "shared"
    """An episode whose history is not append-only trains several segments: shared = each with the
    episode's advantage (slime's list[Sample], SkyRL's step-wise); last = only its last segment."""
    max_failure_frac: float = 0.5
    """Stop the run (exit code 5) when more than this share of a step's episodes fail (raise, hang past
    timeout_s, crash, send a malformed request)."""
    reasoning_parser: Optional[str] = None
    """vLLM's reasoning parser for the responses' reasoning field (e.g. qwen3, deepseek_r1); null = none:
    thinking stays in the content."""
    chat_template: Optional[str] = None
    """A Jinja chat template file for the requests' messages; null = the tokenizer's own."""
    model_name: str = "policy"
    """The model name /v1/models lists (a request may name any: the policy answers)."""
    port: int = 0
    """The endpoint's loopback port; 0 = a free one per rank and call (the base_url run() gets has it)."""
    sandbox: bool = False
    """Serve the agent's own code execution at {sandbox_url}/run_code (SandboxFusion's shape) in
    rollout.multi_turn's sandbox and limits (tool_timeout_s, tool_memory_mb, tools_sandbox)."""

    def __post_init__(self):
        check_positive("rollout.agent", self, "timeout_s", "concurrency", "max_requests")
        check(0.0 <= self.max_failure_frac <= 1.0, "rollout.agent.max_failure_frac", self.max_failure_frac,
              "a share between 0 and 1 (1 = never stop)")
        check(0 <= self.port < 65536, "rollout.agent.port", self.port, "a TCP port, or 0 for a free one")

    @property
    def enable(self) -> bool:
        return self.entry is not None


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
    environment class imports, the context holds prompt + conversation, the env reward is wired;
    or, with rollout.agent.entry, check_endpoint_agent."""
    mt = cfg.rollout.multi_turn
    uses = bool(cfg.tools) or cfg.env.cls is not None
    if cfg.rollout.agent.enable:
        check_endpoint_agent(cfg)
        return
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


def check_entry(ref: str) -> str | None:
    """Why ``path.py:fn`` / ``package.module:fn`` cannot be the agent, or None; read, not imported
    (the agent's module runs in its workers, rlcore/agent/zygote.py)."""
    import ast
    import importlib.util
    import os

    where, _, name = ref.rpartition(":")
    if not where or not name.isidentifier():
        return "give path/to/agent.py:function or package.module:function"
    if where.endswith(".py"):
        if not os.path.isfile(where):
            return f"no such file {where!r} (relative paths are from the directory the trainer starts in)"
        tree = ast.parse(open(where).read(), where)
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        return None if name in defined | assigned | imported else f"{where} defines no function {name!r}"
    try:
        found = importlib.util.find_spec(where) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"no module {where!r} on the path"


def _model_has_template(model_path: str) -> bool:
    import os

    if os.path.isfile(os.path.join(model_path, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model_path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def check_endpoint_agent(cfg) -> None:
    """rollout.agent against the rest of the config, before any model loads."""
    import os

    ag, r = cfg.rollout.agent, cfg.rollout
    if r.multi_turn.enable or cfg.tools or cfg.env.cls is not None:
        raise ConfigError(f"rollout.agent.entry={ag.entry!r} runs your agent, which calls its own tools; "
                          "rollout.multi_turn / tools / env.cls are the built-in loop's: use one of the two")
    check((why := check_entry(ag.entry)) is None, "rollout.agent.entry", ag.entry, why or "")
    from rlcore.agent.chat import known_parsers

    check(r.tool_parser in known_parsers(), "rollout.tool_parser", r.tool_parser,
          f"choose one of vLLM's tool parsers: {', '.join(known_parsers())}")
    if ag.reasoning_parser is not None:
        from vllm.reasoning import ReasoningParserManager

        names = sorted(ReasoningParserManager.list_registered())
        check(ag.reasoning_parser in names, "rollout.agent.reasoning_parser", ag.reasoning_parser,
              f"choose one of vLLM's reasoning parsers: {', '.join(names)}, or null")
    if ag.chat_template is not None:
        check(os.path.isfile(ag.chat_template), "rollout.agent.chat_template", ag.chat_template,
              "no such file; give a Jinja template file, or null for the tokenizer's own")
    elif not _model_has_template(cfg.model.path):
        raise ConfigError(f"rollout.agent.chat_template=None and model.path={cfg.model.path!r} has no chat template "
                          "(tokenizer_config.json, chat_template.jinja): give one, e.g. configs/chat_templates/qwen3.jinja")
    refused = {"data.image_key": cfg.data.image_key, "distill.teacher": cfg.distill.teacher,
               "algorithm.routing_replay": cfg.algorithm.routing_replay if cfg.algorithm.routing_replay == "r3" else None}
    for key, value in refused.items():
        if value:
            raise ConfigError(f"rollout.agent.entry with {key}={value!r}: agent episodes are text-only, their "
                              f"segments are not scored by a teacher and carry no routed experts; turn one of them off")
    if cfg.algorithm.adv_estimator == "reinforce_pp" and cfg.algorithm.gamma != 1.0 and ag.segment_advantage == "shared":
        raise ConfigError(f"algorithm.gamma={cfg.algorithm.gamma} discounts within one sequence, but an agent episode "
                          "may train several segments that share one advantage: set algorithm.gamma: 1.0, or "
                          "rollout.agent.segment_advantage: last")
