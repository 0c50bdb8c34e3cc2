"""The agent endpoint's parts without the engine (rlcore/agent/): the worker zygote against every way an
agent ends, the episode's recording, segments as training rows against a hand computation, the
OpenAI surface (append rule, stop strings, refused requests) on the tool demo's tokenizer, the HTTP
side with the official openai client (keys, streaming, malformed bodies, loopback only), and bad
configs (exit 2 before any model loads). The engine and the trainer: tests/test_agent_endpoint.py and
tests/test_agent_endpoint_e2e.py.
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import REPO

AGENT_SRC = textwrap.dedent('''
    import asyncio, os, time

    def run(row, base_url, api_key, bonus=0.0):
        mode = row["mode"]
        if mode == "number":
            return row["value"] + bonus
        if mode == "none":
            return None
        if mode == "dict":
            return {"reward": 0.5}
        if mode == "text":
            return "yes"
        if mode == "raise":
            raise ValueError("bad agent")
        if mode == "exit":
            os._exit(7)
        if mode == "sleep":
            time.sleep(60)
        if mode == "args":
            return float(len(base_url) + len(api_key))

    async def arun(row, base_url, api_key):
        await asyncio.sleep(0.01)
        return 2.0
''')


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agent_file") / "my_agent.py"
    path.write_text(AGENT_SRC)
    return str(path)


def _drain(runner, count: int, timeout: float = 30.0) -> dict:
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        for eid, ok, reward, error in runner.events():
            out[eid] = (ok, reward, error)
        time.sleep(0.02)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_workers_report_every_way_an_agent_ends(agent_file, kind):
    from rlcore.agent.workers import make_runner

    wake = threading.Event()
    runner = make_runner(kind, f"{agent_file}:run", {"bonus": 0.25}, wake)
    modes = ["number", "none", "dict", "text", "raise", "args"] + (["exit", "sleep"] if kind == "process" else [])
    try:
        for i, mode in enumerate(modes):
            runner.start(i, {"row": {"mode": mode, "value": 1.0}, "base_url": "http://x", "api_key": "k"})
        if kind == "process":
            time.sleep(1.0)
            runner.kill(modes.index("sleep"))  # a hung agent: its process group is killed
        got = _drain(runner, len(modes))
    finally:
        runner.close()
    assert wake.is_set()
    by = {mode: got[i] for i, mode in enumerate(modes)}
    assert by["number"] == (True, 1.25, None) and by["none"] == (True, None, None) and by["dict"] == (True, 0.5, None)
    assert by["args"] == (True, float(len("http://x") + 1), None)
    assert not by["text"][0] and "return a number, None" in by["text"][2]
    assert not by["raise"][0] and "ValueError: bad agent" in by["raise"][2]
    if kind == "process":
        assert by["exit"] == (False, None, "the agent's process exited with code 7 before it returned")
        assert by["sleep"] == (False, None, "the agent's process killed by signal 9 before it returned")


@pytest.mark.unit
def test_an_async_agent_runs_and_a_broken_module_stops_at_start(agent_file, tmp_path):
    from rlcore.agent.workers import AgentLoadError, make_runner

    runner = make_runner("process", f"{agent_file}:arun", {}, threading.Event())
    try:
        runner.start(0, {"row": {}, "base_url": "u", "api_key": "k"})
        assert _drain(runner, 1)[0] == (True, 2.0, None)
    finally:
        runner.close()
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\ndef run(row, base_url, api_key):\n    return 1.0\n")
    with pytest.raises(AgentLoadError, match="No module named 'no_such_module_here'"):
        make_runner("process", f"{broken}:run", {}, threading.Event())


@pytest.mark.unit
def test_check_entry_reads_the_file_without_running_it(agent_file, tmp_path):
    from rlcore.agent.config import check_entry

    assert check_entry(f"{agent_file}:run") is None and check_entry(f"{agent_file}:arun") is None
    assert "defines no function 'walk'" in check_entry(f"{agent_file}:walk")
    assert "no such file" in check_entry(f"{tmp_path}/none.py:run")
    assert "give path/to/agent.py:function" in check_entry("just_a_name")
    assert check_entry("json:dumps") is None and "no module" in check_entry("no_such_pkg_xyz.mod:run")


# --------------------------------------------------------------------------------------------- episodes


@pytest.mark.unit
def test_an_episode_records_segments_and_ends_once():
    from rlcore.agent.episode import Episode, episode_metrics, summarise

    ep = Episode(0, [9])
    assert ep.response_ids == [] and ep.versions == []  # before it ran
    with ep.lock:
        assert ep.record([1, 2], None, [3, 4], [-0.1, -0.2])
        assert ep.record([1, 2, 3, 4, 5], [5], [6], [-0.3])  # extends: context 5 at mask 0
        assert ep.record([1, 2, 3, 4, 9], [9], [7], [-0.4])  # the segment grew meanwhile: a new one
    assert [s.ids() for s in ep.segments] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 7]]
    assert ep.segments[0].env_mask == [1, 1, 0, 1] and ep.segments[0].logprobs == [-0.1, -0.2, 0.0, -0.3]
    assert ep.appended == 1 and ep.final_text_ids() == [7]
    assert ep.end(True, 0.7) and not ep.end(False, failure="timeout") and (ep.finish, ep.env_reward) == ("stop", 0.7)
    assert not ep.record([1], None, [2], [0.0])  # closed: a late completion is dropped
    failed, over = Episode(1, [9]), Episode(2, [9])
    failed.end(False, 1.0, "raised", "boom")
    over.stop_requests()
    over.end(False, None, "raised", "the refusal's consequence")
    assert (failed.finish, failed.env_reward, failed.failure) == ("failed", 0.0, "raised")
    assert (over.finish, over.env_reward, over.failure) == ("length", 0.0, None)
    assert failed.all_segments()[0].env_mask == [0]  # no request: a placeholder row, nothing trained
    again = Episode.from_plain(json.loads(json.dumps(ep.plain())))
    assert [s.ids() for s in again.segments] == [s.ids() for s in ep.segments] and again.closed
    ep.requests, ep.prompt_tokens, ep.cached_tokens = 3, 20, 5
    m = summarise(episode_metrics([ep, failed, over]))
    assert m["agent/failures"] == 1 and m["agent/failure_frac"] == pytest.approx(1 / 3)
    assert m["agent/segments_mean"] == pytest.approx(2 / 3) and m["agent/append_only_frac"] == pytest.approx(1 / 2)
    assert m["agent/cached_prompt_frac"] == 0.25 and m["agent/length_frac"] == pytest.approx(1 / 3)


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["shared", "last"])
def test_segments_become_rows_with_their_episodes_advantage(mode):
    """Two groups of 2 episodes (1, 2, 1 and 3 segments): GRPO's advantage per episode, computed by hand,
    on every trained token of each of its rows; the rows padded to a multiple of 4; the step's reward
    and length metrics once per episode."""
    from rlcore.agent.episode import Segment
    from rlcore.algo.batch import RolloutBatch, advantages_for, rollout_metrics
    from rlcore.algo.config import AlgorithmConfig
    from rlcore.step.segments import expand

    def seg(p, r, m):
        return Segment(p, r, m, [-0.5 * k for k in m])

    episodes = [[seg([1], [2, 3], [1, 1])],
                [seg([1], [4], [1]), seg([5, 6], [7, 8, 9], [1, 0, 1])],
                [seg([1], [2], [1])],
                [seg([1], [3], [1]), seg([4], [5], [1]), seg([6], [7, 8], [0, 1])]]
    scores = torch.tensor([1.0, 0.0, 0.2, 0.8])
    last = [e[-1] for e in episodes]
    batch = RolloutBatch(prompt_ids=[s.prompt_ids for s in last], response_ids=[s.response_ids for s in last],
                         rollout_logp=[s.logprobs for s in last], answers=["a"] * 4,
                         finish_reasons=["stop"] * 4, group_size=2, env_mask=[s.env_mask for s in last],
                         segments=episodes)
    adv = advantages_for(batch, scores, AlgorithmConfig(adv_estimator="grpo"))
    hand = [(1.0 - 0.5) / ((0.5 ** 2 * 2) ** 0.5 + 1e-6), (0.0 - 0.5) / ((0.5 ** 2 * 2) ** 0.5 + 1e-6),
            (0.2 - 0.5) / ((0.3 ** 2 * 2) ** 0.5 + 1e-6), (0.8 - 0.5) / ((0.3 ** 2 * 2) ** 0.5 + 1e-6)]
    out, new_adv, new_scores, metrics = expand(batch, adv, scores, mode, multiple=4)
    kept = [e if mode == "shared" else e[-1:] for e in episodes]
    owner = [i for i, e in enumerate(kept) for _ in e]
    rows = len(owner)
    assert len(out) == -(-rows // 4) * 4 and metrics["agent/train_rows"] == rows
    assert out.seg_index[:rows] == [len(e) - 1 - k for e in kept for k in range(len(e))]
    assert out.seg_index[rows:] == [-1] * (len(out) - rows) and out.keep[rows:] == [0.0] * (len(out) - rows)
    mask, flat = out.response_mask(), [s for e in kept for s in e]
    for r, (i, s) in enumerate(zip(owner, flat)):
        assert out.prompt_ids[r] == s.prompt_ids and out.response_ids[r] == s.response_ids
        on = mask[r] > 0
        assert torch.allclose(new_adv[r][on], torch.full_like(new_adv[r][on], hand[i]), atol=1e-5)
        assert (new_adv[r][~on] == 0).all() and new_scores[r] == scores[i]
    m = rollout_metrics(out, new_scores, new_adv, {}, world_size=1, tp_size=1)
    assert m["reward/mean"] == pytest.approx(scores.mean().item())
    trained = sum(sum(s.env_mask) for e in kept for s in e)
    assert m["rollout/tokens"] == trained and m["rollout/response_len_mean"] == pytest.approx(trained / 4)


# --------------------------------------------------------------------------------------------- OpenAI surface


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlcore.agent.openai_api import OpenAIService
    from rlcore.demo.tool import make_tool_tokenizer

    folder = str(tmp_path_factory.mktemp("tool_tok"))
    make_tool_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    return OpenAIService(tok, tool_parser="hermes", reasoning_parser=None, chat_template=None, model_name="policy",
                         max_model_len=40, max_tokens=3, sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Reveal the secret.",
                                           "parameters": {"type": "object", "properties": {}, "required": []}}}


def _serve(service, job, ids):
    job.sample = (ids, [-1.0] * len(ids), "stop", 0)
    job.episode.record(job.prompt_ids, job.delta, ids, job.sample[1])
    service.served(job)
    out = service.chat_response(job) if job.kind == "chat" else service.text_response(job)
    job.episode.history, job.episode.requests = job.history, job.episode.requests + 1
    return out


def test_a_history_that_echoes_the_reply_extends_the_sampled_ids(service):
    from rlcore.agent.episode import Episode

    tok, ep = service.tokenizer, Episode(0, [1])
    call, eos, seven = tok.convert_tokens_to_ids('<tool_call>{"name":"lookup","arguments":{}}</tool_call>'), 1, tok.convert_tokens_to_ids("7")
    first = [{"role": "user", "content": "secret ?"}]
    job = service.chat_job(ep, service.parse("chat", {"messages": first, "tools": [LOOKUP]}))
    assert tok.decode(job.prompt_ids) == "tools lookup <eos> user secret ? <eos> assistant" and job.delta is None
    reply = _serve(service, job, [call, eos])["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    echoed = {**reply["message"], "tool_calls": [{**reply["message"]["tool_calls"][0], "id": "another-id",
                                                  "function": {"name": "lookup", "arguments": "{ }"}}]}
    second = first + [echoed, {"role": "tool", "content": "7"}]
    job2 = service.chat_job(ep, service.parse("chat", {"messages": second, "tools": [LOOKUP]}))
    assert job2.prompt_ids == job.prompt_ids + [call, eos] + job2.delta  # the sampled ids, then the delta
    assert tok.decode(job2.delta) == "tool 7 <eos> assistant"
    _serve(service, job2, [seven])  # cut: no EOS, so the next request cannot extend it
    third = second + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "?"}]
    assert service.chat_job(ep, service.parse("chat", {"messages": third, "tools": [LOOKUP]})).delta is None
    rewritten = [{"role": "user", "content": "secret ?"}, {"role": "tool", "content": "7"}]
    assert service.chat_job(ep, service.parse("chat", {"messages": rewritten, "tools": [LOOKUP]})).delta is None
    assert [len(s.response_ids) for s in ep.segments] == [2 + len(job2.delta) + 1]


def test_an_agent_that_strips_the_reasoning_starts_a_segment(tmp_path):
    """Qwen3's template and reasoning parser: a reply's thinking comes back in ``reasoning``; a history
    that echoes it extends the sampled ids, one that drops it (stripped thinking) is rendered anew."""
    from transformers import AutoTokenizer

    from rlcore.agent.episode import Episode
    from rlcore.agent.openai_api import OpenAIService
    from rlcore.demo.tool import make_chatml_tool_model

    folder = make_chatml_tool_model(str(tmp_path / "qwen3"), os.path.join(REPO, "configs", "chat_templates",
                                                                           "qwen3.jinja"))
    tok = AutoTokenizer.from_pretrained(folder)
    service = OpenAIService(tok, tool_parser="hermes", reasoning_parser="qwen3", chat_template=None,
                            model_name="policy", max_model_len=512, max_tokens=32,
                            sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    first = [{"role": "user", "content": "What is 12 + 7 ?"}]
    sampled = tok("<think>\n12 + 7 = 19\n</think>\n\n19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for keep_reasoning, extends in ((True, True), (False, False)):
        ep = Episode(0, [1])
        job = service.chat_job(ep, service.parse("chat", {"messages": first}))
        message = _serve(service, job, sampled)["choices"][0]["message"]
        assert message["reasoning"].strip() == "12 + 7 = 19" and message["content"].strip() == "19"
        echoed = {k: v for k, v in message.items() if keep_reasoning or k not in ("reasoning", "reasoning_content")}
        nxt = service.chat_job(ep, service.parse("chat", {"messages": first + [echoed, {"role": "user", "content": "+ 1 ?"}]}))
        assert (nxt.delta is not None) == extends
        if extends:
            assert nxt.prompt_ids[: len(job.prompt_ids) + len(sampled)] == job.prompt_ids + sampled


def test_stop_strings_cut_the_text_and_the_next_request_starts_a_segment(service):
    from rlcore.agent.episode import Episode

    tok, ep = service.tokenizer, Episode(0, [1])
    job = service.text_job(ep, service.parse("text", {"prompt": "secret", "max_tokens": 3, "stop": ["?"]}))
    assert job.stops == {"stop": ["?"], "stop_token_ids": []} and job.max_tokens == 3
    out = _serve(service, job, tok.convert_tokens_to_ids(["7", "?", "8"]))
    assert out["choices"][0]["text"] == "7 " and job.history.text is None
    job2 = service.text_job(ep, service.parse("text", {"prompt": "secret 7 more"}))
    assert job2.delta is None
    plain = service.text_job(Episode(1, [1]), service.parse("text", {"prompt": "secret", "max_tokens": 9}))
    assert plain.max_tokens == 3  # clamped to rollout.max_response_length


def test_requests_the_endpoint_cannot_serve_are_refused_with_the_reason(service, caplog):
    from rlcore.agent.episode import Episode
    from rlcore.agent.openai_api import ApiError

    with pytest.raises(ApiError, match="n=2") as e:
        service.parse("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert e.value.ends == "malformed" and e.value.status == 400
    with pytest.raises(ApiError, match="invalid request") as e:
        service.parse("chat", {"messages": "x"})
    with pytest.raises(ApiError, match="context holds 40") as e:
        service.chat_job(Episode(0, [1]), service.parse("chat", {"messages": [{"role": "user", "content": "? " * 50}]}))
    assert e.value.code == "context_length_exceeded" and e.value.ends == "length"
    with caplog.at_level("WARNING", logger="rlcore.agent"):
        for _ in range(2):
            service.parse("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": 0.2,
                                   "logit_bias": {"5": 10}, "tool_choice": "required", "tools": [LOOKUP]})
    said = [r.getMessage() for r in caplog.records]
    assert sum("temperature=0.2" in s for s in said) == 1 and sum("logit_bias" in s for s in said) == 1
    assert not any("tool_choice" in s for s in said)  # served as asked: tests below


def _service(tok, tool_parser: str | None, **sampling):
    from rlcore.agent.openai_api import OpenAIService

    return OpenAIService(tok, tool_parser=tool_parser, reasoning_parser=None, chat_template=None, model_name="policy",
                         max_model_len=40, max_tokens=3,
                         sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, **sampling})


def test_tool_choice_required_and_named_get_vllms_grammar_and_parse(service):
    """As vLLM 0.32's server: hermes (an xgrammar structural tag of its own call format) constrains
    required to at least one call and a named function to that one call; pythonic (no structural tag)
    gets the JSON schema of a list of {name, parameters} and its reply is read as that JSON; auto is
    not constrained. A constrained sample is scored again (one context position kept free for it)."""
    from rlcore.agent.episode import Episode

    def job(svc, choice, tools=(LOOKUP,)):
        body = {"messages": [{"role": "user", "content": "secret ?"}], "tools": list(tools), "tool_choice": choice}
        return svc.chat_job(Episode(0, [1]), svc.parse("chat", body))

    named = {"type": "function", "function": {"name": "lookup"}}
    auto, required, one = job(service, "auto"), job(service, "required"), job(service, named)
    assert auto.constraint is None and not auto.rescore and auto.max_tokens == 3
    if _vllm_minor() < 32:  # the Ascend pin's: hermes constrains by the tools' JSON schema, as its server does
        _required_by_json_schema_as_vllm_0_23(service, required, one, named)
        return
    for j, first_only in ((required, False), (one, True)):
        tag = json.loads(j.constraint.structural_tag)["format"]
        assert tag["at_least_one"] and tag["stop_after_first"] == first_only and j.rescore
        assert tag["tags"][0]["begin"] == '<tool_call>\n{"name": "lookup", "arguments": '
    room = service.chat_job(Episode(1, [1]), service.parse("chat", {
        "messages": [{"role": "user", "content": "? " * 31}], "tools": [LOOKUP], "tool_choice": "required"}))
    assert len(room.prompt_ids) == 37 and room.max_tokens == 2  # 40 - 37, one position kept
    call = service.tokenizer.convert_tokens_to_ids('<tool_call>{"name":"lookup","arguments":{}}</tool_call>')
    reply = _serve(service, one, [call, 1])["choices"][0]
    assert reply["message"]["tool_calls"][0]["function"]["name"] == "lookup" and reply["finish_reason"] == "stop"
    assert _serve(service, required, [call, 1])["choices"][0]["finish_reason"] == "tool_calls"

    pythonic = _service(service.tokenizer, "pythonic")
    j = job(pythonic, "required")
    schema = j.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["lookup"]}
    assert job(pythonic, named).constraint.json == {"type": "object", "properties": {}, "required": []}
    j.sample = ([1], [-1.0], "stop", 0)
    pythonic.turn_text = lambda ids: '[{"name": "lookup", "parameters": {"digit": 7}}]'  # a byte-level model's reply
    parsed = pythonic.chat_response(j)["choices"][0]
    assert parsed["message"]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"digit": 7}'}
    assert parsed["finish_reason"] == "tool_calls" and parsed["message"]["content"] is None


def _vllm_minor() -> int:
    import vllm

    return int(vllm.__version__.split(".")[1])


def _required_by_json_schema_as_vllm_0_23(service, required, one, named) -> None:
    """vllm 0.23.0 (the NPU twin) builds a structural tag only under VLLM_ENFORCE_STRICT_TOOL_CALLING
    (tool_parsers/abstract_tool_parser.py:117-137; off by default, envs.py:1804-1805) and hermes has
    none there (:172-173): hermes gets the tools' JSON schema (:139-150) and its server reads the reply
    as that JSON (parser/abstract_parser.py:495, :588-592). The endpoint serves what the installed
    vLLM's server serves."""
    schema = required.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and required.rescore and one.rescore
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["lookup"]}
    assert one.constraint.json == {"type": "object", "properties": {}, "required": []}
    required.sample = ([1], [-1.0], "stop", 0)
    own = service.turn_text
    service.turn_text = lambda ids: '[{"name": "lookup", "parameters": {"digit": 7}}]'  # the module's service
    try:
        parsed = service.chat_response(required)["choices"][0]
    finally:
        service.turn_text = own
    assert parsed["message"]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"digit": 7}'}
    assert parsed["finish_reason"] == "tool_calls"


def test_forced_tool_choices_the_run_cannot_serve_are_refused(service):
    from rlcore.agent.episode import Episode
    from rlcore.agent.openai_api import ApiError

    body = {"messages": [{"role": "user", "content": "secret ?"}], "tools": [LOOKUP], "tool_choice": "required"}
    with pytest.raises(ApiError, match="needs a tool parser to read the calls: set rollout.tool_parser") as e:
        svc = _service(service.tokenizer, None)
        svc.chat_job(Episode(0, [1]), svc.parse("chat", body))
    assert e.value.status == 400 and e.value.ends == "malformed"
    for sampling in ({"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 20}):
        svc = _service(service.tokenizer, "hermes", **sampling)
        with pytest.raises(ApiError, match="Set rollout.temperature: 1, top_p: 1, top_k: -1"):
            svc.chat_job(Episode(0, [1]), svc.parse("chat", body))
    greedy = _service(service.tokenizer, "hermes", temperature=0.0)  # validation: nothing trained, nothing scored
    j = greedy.chat_job(Episode(0, [1]), greedy.parse("chat", body))
    assert j.constraint is not None and not j.rescore


def test_a_groups_first_requests_render_once_per_call(service):
    """The n episodes of a group send the same first messages: rendered once per call, each job its
    own copy of the ids; an unconstrained tool_choice (auto) asks vLLM's adjust_request once per
    tools; new_call (the next generate call) starts both afresh."""
    from rlcore.agent.episode import Episode

    svc = _service(service.tokenizer, "hermes")
    renders, adjusts = [], []
    make_renderer, make_parser = svc._renderer, svc._parser

    def renderer(*args):
        r = make_renderer(*args)
        r.render = (lambda render: lambda *a, **k: renders.append(1) or render(*a, **k))(type(r).render.__get__(r))
        return r

    def parser(*args):
        adjusts.append(1)
        return make_parser(*args)

    svc._renderer, svc._parser = renderer, parser
    body = {"messages": [{"role": "user", "content": "secret ?"}], "tools": [LOOKUP]}
    jobs = [svc.chat_job(Episode(k, [1]), svc.parse("chat", body)) for k in range(3)]
    assert len(renders) == 1 and len(adjusts) == 1
    assert jobs[0].prompt_ids == jobs[2].prompt_ids and jobs[0].prompt_ids is not jobs[2].prompt_ids
    jobs[0].prompt_ids.append(99)  # a job's ids are its own
    other = svc.chat_job(Episode(3, [1]), svc.parse("chat", {**body, "messages": [{"role": "user", "content": "?"}]}))
    assert len(renders) == 2 and len(adjusts) == 1 and other.prompt_ids != jobs[1].prompt_ids
    assert svc.chat_job(Episode(4, [1]), svc.parse("chat", body)).prompt_ids == jobs[1].prompt_ids
    svc.new_call(svc.sampling, svc.max_tokens)
    svc.chat_job(Episode(0, [1]), svc.parse("chat", body))
    assert len(renders) == 3 and len(adjusts) == 2


# --------------------------------------------------------------------------------------------- HTTP


@pytest.fixture()
def endpoint(service):
    """An endpoint whose 'engine' answers every request with the EOS token, on a thread."""
    from rlcore.agent.endpoint import Endpoint
    from rlcore.agent.episode import Episode

    failed = []

    def submit(job):
        job.sample = ([1], [-0.5], "stop", 0)
        job.event.set()

    ep = Endpoint(service, submit, failed.append, max_requests=2)
    ep.keys = {"key-a": Episode(0, [1]), "key-b": Episode(1, [1])}
    yield ep, failed
    ep.close()


def test_the_http_side_answers_the_openai_client(endpoint):
    import openai

    ep, failed = endpoint
    client = openai.OpenAI(base_url=ep.base_url, api_key="key-a", max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]
    out = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "secret ?"}], logprobs=True)
    assert out.choices[0].message.content is None and out.usage.completion_tokens == 1
    assert out.choices[0].logprobs.content[0].logprob == -0.5
    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "?"}], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ep.base_url, api_key="nobody", max_retries=0).models.list()
    req = urllib.request.Request(ep.base_url + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": "Bearer key-a"})
    with pytest.raises(urllib.error.HTTPError) as bad:  # not JSON: the episode fails, its worker is stopped
        urllib.request.urlopen(req, timeout=10)
    assert bad.value.code == 400 and "not JSON" in json.loads(bad.value.read())["error"]["message"]
    assert failed == [ep.keys["key-a"]] and ep.keys["key-a"].failure == "malformed"
    with pytest.raises(openai.APIStatusError) as e:  # over: refused, not retried
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "?"}])
    assert e.value.status_code == 410
    other = openai.OpenAI(base_url=ep.base_url, api_key="key-b", max_retries=0)
    for _ in range(2):
        assert other.completions.create(model="any", prompt="secret").choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="its 2 requests"):  # rollout.agent.max_requests
        other.completions.create(model="any", prompt="secret")
    assert ep.keys["key-b"].closed and ep.keys["key-b"].finish is None  # scored as it stands once run() returns
    assert ep.server.open  # the clients' pools keep their connections
    ep.close()  # closing ends them: their threads return (to serve the next call's connections)
    deadline = time.monotonic() + 10
    while ep.server.open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ep.server.open


def test_the_agents_own_code_runs_in_the_sandbox(service):
    """rollout.agent.sandbox: POST {sandbox_url}/run_code in SandboxFusion's shape, run by the python
    tool's sandbox with its limits (rlcore.agent.sandbox)."""
    import functools

    from rlcore.agent import sandbox
    from rlcore.agent.endpoint import Endpoint
    from rlcore.agent.episode import Episode

    ep = Endpoint(service, lambda job: None, lambda e: None, sandbox=functools.partial(
        sandbox.run_python, limits=sandbox.Limits(timeout_s=10.0, cpu_s=5)))
    ep.keys = {"k": Episode(0, [1])}
    try:
        def run_code(code):
            req = urllib.request.Request(ep.base_url[: -len("/v1")] + "/run_code", method="POST",
                                         data=json.dumps({"code": code, "language": "python"}).encode(),
                                         headers={"Authorization": "Bearer k"})
            return json.loads(urllib.request.urlopen(req, timeout=60).read())

        ok = run_code("print(6 * 7)")
        assert ok["status"] == "Success" and ok["run_result"]["stdout"].strip() == "42"
        bad = run_code("raise ValueError('no')")
        assert bad["status"] == "Failed" and "ValueError: no" in bad["run_result"]["stderr"]
    finally:
        ep.close()


def test_the_request_head_is_read_within_limits(endpoint):
    """The endpoint reads a request's head itself (rlcore.agent.endpoint: the standard library's email
    parser cost more than the endpoint's work): names in any case, keep-alive, and a clear error, the
    connection closed, for what it does not take."""
    ep, _ = endpoint
    port = ep.server.server_address[1]

    def exchange(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out

    get = b"GET /v1/models HTTP/1.1\r\nConnection: close\r\nAUTHORIZATION: Bearer key-a\r\n\r\n"
    both = exchange(get.replace(b"Connection: close", b"Host: x") + get)  # two on one connection (keep-alive)
    assert both.count(b"HTTP/1.1 200 OK") == 2 and both.count(b'"policy"') == 2
    assert exchange(get.replace(b"AUTHORIZATION: Bearer key-a", b"api-key: key-a")).startswith(b"HTTP/1.1 200")
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(101))
    for raw, status in ((get.replace(b"Connection: close\r\n", many), b"431"),
                        (b"PUT /v1/models HTTP/1.1\r\n\r\n", b"405"),
                        (b"nonsense\r\n\r\n", b"400"), (b"GET / HTTP/2.0\r\n\r\n", b"400"),
                        (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"411"),
                        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n", b"400")):
        out = exchange(raw)  # answered, then closed (exchange reads to the end)
        assert out.startswith(b"HTTP/1.1 " + status) and b"Connection: close" in out, (raw, out[:200])
        assert "message" in json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]


def test_the_endpoint_listens_on_loopback_only(endpoint):
    from rlcore.agent.endpoint import is_loopback

    ep, _ = endpoint
    assert ep.server.server_address[0] == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("10.1.2.3")
    port = ep.server.server_address[1]
    outside = [a for a in {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
               if not a.startswith("127.")]
    for address in outside:
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=2).close()


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("extra,expected", [
    (["--rollout.agent.entry", "no_such_file.py:run"], "rollout.agent.entry='no_such_file.py:run' is invalid: no such file"),
    (["--rollout.agent.entry", "rlcore/demo/agent.py:walk"], "defines no function 'walk'"),
    (["--rollout.multi_turn.enable", "true", "--tools", '["calculator"]'], "use one of the two"),
    (["--rollout.agent.reasoning_parser", "nope"], "rollout.agent.reasoning_parser='nope' is invalid"),
    (["--rollout.agent.max_failure_frac", "1.5"], "rollout.agent.max_failure_frac=1.5 is invalid"),
    (["--rollout.agent.workers", "fibers"], "rollout.agent.workers"),
    (["--algorithm.adv_estimator", "reinforce_pp", "--algorithm.gamma", "0.9"], "algorithm.gamma=0.9 discounts"),
])
def test_bad_agent_configs_exit_2_before_any_model(tiny_model, toy_data, tmp_path, capsys, extra, expected):
    from test_bad_inputs import checks_exit_code

    argv = ["--config", os.path.join(REPO, "configs", "demo_agent_cpu.yaml"), "--model.path", tiny_model,
            "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", json.dumps([toy_data[1]]),
            "--trainer.output_dir", str(tmp_path / "run"), "--rollout.agent.chat_template",
            os.path.join(REPO, "configs", "chat_templates", "qwen3.jinja"), *extra]
    assert checks_exit_code(argv, 2) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
