"""Multi-turn, tool-using rollouts on the colocated engine (a rollout capability: it may import vLLM).

- :mod:`rlcore.agent.loop`: conversations turn by turn, one batched generate per turn.
- :mod:`rlcore.agent.serve`: black-box agents (``rollout.agent.entry``) against an OpenAI-compatible
  endpoint per rank (:mod:`rlcore.agent.endpoint`, :mod:`rlcore.agent.openai_api`), recorded
  token-exactly in segments (:mod:`rlcore.agent.episode`), run in worker processes
  (:mod:`rlcore.agent.workers`, :mod:`rlcore.agent.zygote`).
- :mod:`rlcore.agent.chat`: token-exact tool deltas from the chat template; vLLM's tool parsers.
- :mod:`rlcore.agent.tools`: built-in and user tools, their schemas, a bounded pool.
- :mod:`rlcore.agent.sandbox`: the python tool's child process, its backends and limits
  (:mod:`rlcore.agent.sandbox_backends`, :mod:`rlcore.agent.sandbox_remote`).
- :mod:`rlcore.agent.config`: the config sections and their checks.

May import: vLLM (its tool parsers and request models: the agent is a rollout capability), the rollout
wing's engine stepping (rlcore.rollout.serving), transformers, rlcore.task (custom reward functions
load as tools do), the ground floor. Not VeOmni, not rlcore.config (its
sections are imported by the config, not the reverse).
"""

from __future__ import annotations


def renderer_for(cfg, tokenizer):
    """The chat renderer with the run's tool schemas, or None when multi-turn is off."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    from rlcore.agent.chat import ChatRenderer
    from rlcore.agent.config import configured_tools, load_env_class

    schemas = [t.schema for t in configured_tools(cfg.tools).values()]
    if cfg.env.cls is not None:
        schemas += list(getattr(load_env_class(cfg.env.cls), "tool_schemas", []) or [])
    template = None
    if mt.chat_template is not None:
        with open(mt.chat_template) as f:
            template = f.read()
    from rlcore.agent.chat import TemplateError
    from rlcore.errors import ConfigError

    try:
        return ChatRenderer(tokenizer, schemas, template, mt.first_turn_prefix or "")
    except TemplateError as e:
        raise ConfigError(f"rollout.multi_turn.chat_template={mt.chat_template!r}: {e}") from e


def tp_share(tp_size: int, tp_rank: int, dp_rank: int):
    """With TP > 1: ``share(obj)`` -> the object of this rank's TP leader (an all-gather over all
    ranks; every rank calls it once per turn). None with TP 1."""
    if tp_size == 1:
        return None
    from rlcore.dist import all_gather_objects

    leader = dp_rank * tp_size  # TP rank 0 of this replica (rlcore.colocate_rollout: rank = dp * tp + tp_rank)
    return lambda obj: all_gather_objects(obj)[leader]


def build_agent(cfg, tokenizer, rollout):
    """The rank's Agent (rlcore.agent.loop) for ``rollout``'s TP group, its EndpointAgent
    (rlcore.agent.serve) with rollout.agent.entry, or None when both are off."""
    if cfg.rollout.agent.enable:
        return build_endpoint_agent(cfg, tokenizer, rollout)
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    import functools

    from rlcore.agent.chat import ToolCallParser
    from rlcore.agent.config import configured_tools, load_env_class, sandbox_limits
    from rlcore.agent.loop import Agent
    from rlcore.agent.tools import ToolRunner

    renderer = renderer_for(cfg, tokenizer)
    tools = configured_tools(cfg.tools)
    limits = sandbox_limits(mt)
    env_factory = None
    if cfg.env.cls is not None:
        env_factory = functools.partial(load_env_class(cfg.env.cls), **cfg.env.kwargs)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in mt.stop_on]
    return Agent(tokenizer, renderer, ToolCallParser(cfg.rollout.tool_parser, tokenizer, renderer.tools),
                 ToolRunner(tools, limits, mt.tool_workers), mt.max_turns, mt.max_total_tokens,
                 mt.max_tool_response_tokens, env_factory, stop_ids, leader=rollout.tp_rank == 0,
                 share=tp_share(rollout.tp_size, rollout.tp_rank, rollout.dp_rank))


def build_endpoint_agent(cfg, tokenizer, rollout):
    """The rank's EndpointAgent; the group leader's worker zygote is started here, so an agent
    module that does not import stops the run now (exit 2)."""
    import dataclasses
    import functools
    import os

    from rlcore.agent import sandbox
    from rlcore.agent.config import sandbox_limits
    from rlcore.agent.openai_api import OpenAIService
    from rlcore.agent.serve import EndpointAgent
    from rlcore.agent.workers import AgentLoadError, make_runner
    from rlcore.errors import ConfigError

    ag, r = cfg.rollout.agent, cfg.rollout
    template = None
    if ag.chat_template is not None:
        with open(ag.chat_template) as f:
            template = f.read()
    service = OpenAIService(tokenizer, tool_parser=r.tool_parser, reasoning_parser=ag.reasoning_parser,
                            chat_template=template, model_name=ag.model_name, max_model_len=r.max_model_len,
                            max_tokens=r.max_response_length,
                            sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k})
    code = functools.partial(sandbox.run_python, limits=sandbox_limits(r.multi_turn)) if ag.sandbox else None
    port = ag.port + int(os.environ.get("LOCAL_RANK", "0")) if ag.port else 0  # the ranks of a node apart
    agent = EndpointAgent(dataclasses.replace(ag, port=port), service, rollout,
                          runner_factory=lambda wake: make_runner(ag.workers, ag.entry, ag.kwargs, wake),
                          leader=rollout.tp_rank == 0, tp_size=rollout.tp_size, sandbox=code)
    weight = (cfg.reward.components or {}).get("env")
    agent.reward_note = (f"the number run() returns is the env reward component (weight {weight:g})" if weight else
                         "reward.components has no env: a number run() returns is not used (the components score "
                         "each episode's last completion)")
    if agent.leader:
        try:
            agent.start_workers()
        except AgentLoadError as e:
            raise ConfigError(str(e)) from e
    return agent


def describe(agent) -> str:
    from rlcore.agent import sandbox

    from rlcore.agent.serve import EndpointAgent

    if isinstance(agent, EndpointAgent):
        c = agent.cfg
        return (f"agent: {c.entry} in {c.workers} workers, {c.timeout_s:g} s per episode, {c.batching} batching, "
                f"segments train with the {c.segment_advantage} advantage; an OpenAI endpoint per rank on "
                f"127.0.0.1 during generation; {agent.reward_note}")

    names = ", ".join(agent.runner.tools) or "none"
    text = (f"multi-turn: {agent.max_turns} turns, {agent.max_total_tokens} tokens per conversation, tools: {names}"
            + (", environment" if agent.env_factory else ""))
    if any(t.sandboxed for t in agent.runner.tools.values()):
        text += "\n" + sandbox.describe(agent.runner.limits)
    return text
