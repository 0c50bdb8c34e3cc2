"""Agents for tests/test_agent_endpoint.py, written as a user writes them: the official ``openai``
client, nothing of rlcore. ``run`` picks its behaviour from the row's ``mode``:

  append     three chat turns, each reply and a new user message appended (an unmodified SDK loop)
  compact    four turns; before every other turn the history is rewritten (the assistant's messages
             dropped, a summary in their place): not append-only
  strip      append, but each reply goes back with its first word cut (as a harness strips thinking)
  text       /v1/completions, each prompt the previous prompt + the returned text + more text
  required   two chat turns offering a strict calculator tool with tool_choice "required" (one call per
             reply: parallel_tool_calls false; a random model would otherwise chain calls up to its
             token budget), each call answered by a tool message; returns how many replies called it
  named      the same with tool_choice naming the calculator
  raise      raises after one request
  hang       one request, then sleeps past the episode's time limit
  crash      one request, then the process dies (os._exit)
  malformed  a request whose messages are not a list
  wrong_key  a request with a key that is no episode's
  outside    tries the endpoint's port on this host's non-loopback addresses; reward 1 when refused
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

from openai import OpenAI


def run(row: dict, base_url: str, api_key: str, model: str = "policy", seed: str = "") -> float | None:
    mode = row["mode"]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if mode in ("append", "compact", "strip"):
        return _chat(client, model, mode, row)
    if mode in ("required", "named"):
        return _forced(client, model, mode, row)
    if mode == "text":
        prompt = row["prompt"]
        for more in (" and", " then"):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=row["max_tokens"])
            prompt = prompt + out.choices[0].text + more
        return None  # scored by the reward components
    if mode == "malformed":
        _post(base_url, api_key, {"model": model, "messages": "not a list"})
        return 1.0
    if mode == "wrong_key":
        OpenAI(base_url=base_url, api_key="not-" + api_key, max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}])
        return 1.0
    if mode == "outside":
        return _outside(base_url)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4)
    if mode == "raise":
        raise RuntimeError("the agent's own bug")
    if mode == "hang":
        time.sleep(3600)
    if mode == "crash":
        os._exit(3)
    raise ValueError(f"unknown mode {mode!r}")


def _chat(client, model: str, mode: str, row: dict) -> float:
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": row["prompt"]}]
    turns = 4 if mode == "compact" else 3
    for turn in range(turns):
        if mode == "compact" and turn % 2 == 1:  # a summarising harness: earlier replies folded into one note
            notes = " ".join((m.get("content") or "")[:12] for m in messages if m["role"] == "assistant")
            messages = [m for m in messages if m["role"] in ("system", "user")][:2] + [
                {"role": "user", "content": f"Notes so far: {notes}"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=row["max_tokens"])
        echoed = reply.choices[0].message.model_dump(exclude_none=True)
        if mode == "strip":
            echoed["content"] = " ".join((echoed.get("content") or "").split()[1:])
        messages.append(echoed)
        messages.append({"role": "user", "content": f"And {turn + 2} * 3 ?"})
    return float(len(messages))


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Apply an operation.", "strict": True,
    "parameters": {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "mul"]}},
                   "required": ["op"], "additionalProperties": False}}}


def _forced(client, model: str, mode: str, row: dict) -> float:
    choice = "required" if mode == "required" else {"type": "function", "function": {"name": "calculator"}}
    messages = [{"role": "user", "content": row["prompt"]}]
    called = 0
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=row["forced_tokens"]).choices[0].message
        called += bool(reply.tool_calls) and all(c.function.name == "calculator" for c in reply.tool_calls)
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "3"})
    return float(called)


def _post(base_url: str, api_key: str, body: dict) -> None:
    req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as e:
        if e.code == 400:
            return
        raise


def _outside(base_url: str) -> float:
    """1.0 when no non-loopback address of this host reaches the endpoint's port (0.5: no such address)."""
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    addresses = set()
    for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
        addresses.add(info[4][0])
    try:  # the address of the default route's interface (no packet is sent by a UDP connect)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addresses.add(s.getsockname()[0])
    except OSError:
        pass
    outside = [a for a in addresses if not a.startswith("127.")]
    if not outside:
        return 0.5
    for address in outside:
        try:
            socket.create_connection((address, port), timeout=2).close()
            return 0.0  # reached: the endpoint listens beyond loopback
        except OSError:
            pass
    return 1.0
