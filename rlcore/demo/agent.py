"""The agent demo's agent (configs/demo_agent_cpu.yaml): the tool demo's task (rlcore.demo.tool), played by
a program of its own against the rank's OpenAI-compatible endpoint with the official ``openai`` client,
as any agent harness would. It imports only ``openai``: the trainer runs it in its worker processes.

Each episode: the question goes to the model with the ``lookup`` tool (a reply ends at its call, as the
tool demo's turns do); a reply that calls ``lookup``
gets the row's secret digit as the tool's answer and the model is asked again; a reply without a call
is the answer, worth 1 when its first word is the secret, plus ``call_bonus`` if the episode called
the tool (the bonus makes calls common enough early for the model to learn to read the answer, as in
the tool demo); no answer within ``max_turns`` replies earns 0. Every other request the agent compacts its history: the assistant's call is dropped
and only the question and the tool's answer stay (as harnesses summarise long contexts), so the
trainer's recording sees a history that is not an extension of the last request and trains the
episode as two segments.
"""

from __future__ import annotations

from openai import OpenAI

# One client for every episode of the process, made when the module is imported: the trainer's worker
# zygote imports this file once and forks each episode from it, so an episode starts with the client
# already built (making one costs about 25 ms, mostly its TLS context) and only points it at its own
# endpoint and key (with_options: 0.2 ms). Nothing is connected before the fork.
_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="unset", max_retries=0)
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Reveal this question's secret digit.",
                                           "parameters": {"type": "object", "properties": {}, "required": []}}}


def compact(messages: list[dict]) -> list[dict]:
    """The question and the tool answers only: what a summarising harness keeps."""
    return [m for m in messages if m["role"] in ("system", "user", "tool")]


def run(row: dict, base_url: str, api_key: str, max_turns: int = 4, call_bonus: float = 0.2,
        compact_every: int = 2) -> float:
    """One episode; ``compact_every`` 0 keeps the history append-only (scripts/bench_agent.py compares
    that with the built-in loop)."""
    client = _CLIENT.with_options(base_url=base_url, api_key=api_key)
    secret, called = str(row["answer"]), False
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(max_turns):
        if compact_every and turn % compact_every == compact_every - 1:
            messages = compact(messages)
        # A reply ends at its call: the stop string, kept in the text for the endpoint's tool parser (vLLM's
        # include_stop_str_in_output), as the tool demo's stop_on ends a turn at its call token.
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP], stop=["</tool_call>"],
                                               extra_body={"include_stop_str_in_output": True}).choices[0].message
        if not reply.tool_calls:
            words = (reply.content or "").split()
            return float(bool(words) and words[0] == secret) + call_bonus * called
        called = True
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": secret if call.function.name == "lookup" else "?"})
    return 0.0  # no answer within max_turns (as the tool demo's SecretEnv: calling forever earns nothing)
