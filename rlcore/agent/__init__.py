"""Multi-turn, tool-using rollouts on the colocated engine (a rollout capability: it may import vLLM).

- :mod:`rlcore.agent.loop`: conversations turn by turn, one batched generate per turn.
- :mod:`rlcore.agent.chat`: token-exact tool deltas from the chat template; vLLM's tool parsers.
- :mod:`rlcore.agent.tools`: built-in and user tools, their schemas, a bounded pool.
- :mod:`rlcore.agent.sandbox`: the python tool's child process, its backends and limits
  (:mod:`rlcore.agent.sandbox_backends`, :mod:`rlcore.agent.sandbox_remote`).
- :mod:`rlcore.agent.config`: the config sections and their checks.

May import: vLLM (its tool parsers: the agent is a rollout capability), transformers, rlcore.task
(custom reward functions load as tools do), the ground floor. Not VeOmni, not rlcore.config (its
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
    """The rank's Agent (rlcore.agent.loop) for ``rollout``'s TP group, or None when multi-turn is off."""
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


def describe(agent) -> str:
    from rlcore.agent import sandbox

    names = ", ".join(agent.runner.tools) or "none"
    text = (f"multi-turn: {agent.max_turns} turns, {agent.max_total_tokens} tokens per conversation, tools: {names}"
            + (", environment" if agent.env_factory else ""))
    if any(t.sandboxed for t in agent.runner.tools.values()):
        text += "\n" + sandbox.describe(agent.runner.limits)
    return text
