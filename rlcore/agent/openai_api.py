"""The OpenAI-compatible surface of the agent endpoint: requests in (validated by vLLM's own request
models), the engine's prompt ids out, and the responses the OpenAI SDK reads.

Chat requests are rendered by the chat template (the model's, or rollout.agent.chat_template) with the
request's ``tools=`` and ``chat_template_kwargs``, after the messages are brought to the form vLLM's
server gives templates (content parts joined, tool-call arguments as objects: vllm 0.32.0
renderers/chat_utils.py:2074-2227). Completions are parsed with vLLM's tool parser
(``rollout.tool_parser``) and reasoning parser (``rollout.agent.reasoning_parser``).

Token exactness (rlcore.agent.episode): a chat request whose messages are the previous request's
messages, then the assistant message this endpoint returned (content, tool calls, reasoning:
compared as data, ids of calls ignored), then new messages, is an extension. Its prompt is the
previous prompt ids + the sampled ids + the template's delta of the new messages
(rlcore.agent.chat.ChatRenderer.delta_ids): the model's own tokens are never decoded and encoded
again. That needs the previous completion to have ended its turn (EOS): a completion cut by its
token budget, or any other history, starts a new segment rendered from the request's messages.
A text completion request extends the previous one when its prompt starts with the previous prompt
and the returned text (or, for token-id prompts, the previous ids and the sampled ids).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger("rlcore.agent")


# Request fields that would change the sampled distribution (or the seed): ignored, logged once.
_IGNORED = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("logit_bias", None), ("seed", None),
            ("min_p", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0), ("ignore_eos", False),
            ("response_format", None), ("structured_outputs", None), ("bad_words", None))


class ApiError(Exception):
    """An error response. ``ends``: "malformed" (the episode fails: the agent sent what the endpoint
    cannot serve), "length" (a budget: the episode stops taking requests), None (only this request)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", ends: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.ends = status, message, code, ends

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.code, "code": self.code, "param": None}}


@dataclass
class History:
    """What the next request of an episode must start with to extend this one."""

    kind: str  # "chat" | "text"
    key: str  # tools and template variables: a change renders differently, so it starts a segment
    messages: list  # chat: the comparable form of the request's messages and of the returned one
    ids: list[int]  # the prompt ids and the sampled ids
    text: str | None = None  # text: the prompt text and the returned text (None: the prompt was ids)
    eos: bool = False  # the completion ended its turn with the EOS token


@dataclass
class Job:
    """One request on its way through the engine (rlcore.agent.serve admits it, the handler answers)."""

    episode: object  # rlcore.agent.episode.Episode
    kind: str  # "chat" | "text"
    request: object  # vLLM's ChatCompletionRequest / CompletionRequest
    prompt_ids: list[int]
    delta: list[int] | None  # None: a new segment; else the context appended to the current one
    max_tokens: int
    history: History  # filled in with the sampled ids once served
    renderer: object = None
    prompt_text: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    event: threading.Event = field(default_factory=threading.Event)
    stops: dict = field(default_factory=dict)  # the request's stop strings / stop_token_ids (rollout.serving)
    key: str = ""  # chat: its tools and template variables (History.key)
    constraint: object = None  # vLLM's StructuredOutputsParams: the grammar of tool_choice required / named
    rescore: bool = False  # its sampled ids are scored again for the policy's log-probs (rollout.serving)
    sample: tuple | None = None  # (ids, logprobs, finish_reason, cached tokens) once served
    error: ApiError | None = None  # or why it was not


def _text(content) -> str:
    """A message's content as the template gets it: a string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("text", "input_text", "output_text"):
                raise ApiError(400, f"message content part {str(p)[:80]!r} is not text: the agent endpoint serves "
                               "text only", ends="malformed")
            parts.append(p.get("text", ""))
        return "\n".join(parts)
    raise ApiError(400, f"message content {str(content)[:80]!r} is neither a string nor a list of parts",
                   ends="malformed")


def _arguments(args) -> dict:
    """A call's arguments as an object (vLLM: a JSON string is parsed, anything else becomes {})."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str) and args.strip():
        try:
            parsed = json.loads(args)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def template_message(m: dict) -> dict:
    """One request message in the form vLLM's server renders (string content, argument objects)."""
    out = {"role": m["role"], "content": _text(m.get("content"))}
    if m.get("name") is not None:
        out["name"] = m["name"]
    if m["role"] == "assistant":
        calls = [c for c in (m.get("tool_calls") or [])]
        if calls:
            out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": {"name": (c.get("function") or {}).get("name"),
                                               "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
                                 for c in calls]
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    if m["role"] == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def comparable(m: dict) -> tuple:
    """A template message as the append check compares it: ids of calls left out (the history's
    rendering is fixed in its ids already), argument objects as canonical JSON."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls", []))
    return (m["role"], m["content"], calls, m.get("reasoning") or "", m.get("name"))


class OpenAIService:
    """Requests -> Jobs, served Jobs -> responses; one per rank, used from the HTTP threads."""

    def __init__(self, tokenizer, *, tool_parser: str | None, reasoning_parser: str | None,
                 chat_template: str | None, model_name: str, max_model_len: int, max_tokens: int,
                 sampling: dict):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.template = chat_template
        self.max_model_len, self.max_tokens, self.sampling = max_model_len, max_tokens, dict(sampling)
        self.eos = tokenizer.eos_token_id
        self._renderers: dict[str, object] = {}
        self._lock = threading.Lock()  # making a renderer
        self._logged: set[str] = set()
        # Per call (new_call): rendered prompts, for the first requests of a group's n episodes (the same
        # messages), and the (tools, tool_choice, parallel_tool_calls) that vLLM's adjust_request leaves
        # unconstrained (tool_choice auto, mostly), which need no probe copy of the request.
        self._prompts: dict[tuple, list[int]] = {}
        self._unconstrained: set[tuple] = set()
        # vLLM's server's parser: its reasoning and tool parsers composed (vllm 0.32.0 parser/parser_manager.py
        # ParserManager.get_parser), which adds a request's grammar (adjust_request) and parses its output
        # (parse). Pooled per tools (a parser holds the request's tools; it keeps state only while streaming).
        self._parser_cls, self._takes_ids = None, None
        self._parsers: dict[str, _Pool] = {}
        if tool_parser or reasoning_parser:
            from vllm.parser import ParserManager

            self._parser_cls = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                                                        enable_auto_tools=bool(tool_parser))
            if self._parser_cls.tool_parser_cls is not None:  # a model's bad call is not an error here
                logging.getLogger(self._parser_cls.tool_parser_cls.__module__).setLevel(logging.CRITICAL)

    def _token_ids_kwarg(self, ids: list[int]) -> dict:
        """vllm 0.32's parse takes the sampled ids too (parser/abstract_parser.py:235-240); vllm 0.23's,
        the Ascend pin's, does not (parser/abstract_parser.py:323-327): its parsers read the text alone."""
        if self._takes_ids is None:
            import inspect

            self._takes_ids = "model_output_token_ids" in inspect.signature(self._parser_cls.parse).parameters
        return {"model_output_token_ids": ids} if self._takes_ids else {}

    def new_call(self, sampling: dict, max_tokens: int) -> None:
        """A generate call's settings; what was cached for the last call is dropped (a template may
        render the date)."""
        self.sampling, self.max_tokens = sampling, max_tokens
        self._prompts, self._unconstrained = {}, set()

    # ------------------------------------------------------------------ requests

    def parse(self, kind: str, body: dict):
        """vLLM's request model of ``body`` (its validation: the OpenAI fields and vLLM's extensions)."""
        from pydantic import ValidationError

        if kind == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
        else:
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
        try:
            req = Model.model_validate(body)
        except ValidationError as e:
            raise ApiError(400, f"invalid request: {str(e)[:600]}", ends="malformed") from e
        if (req.n or 1) != 1:
            raise ApiError(400, f"n={req.n}: the endpoint serves one choice per request (each is one step of "
                           "the episode); send n=1", ends="malformed")
        if kind == "text" and (req.echo or req.suffix):
            raise ApiError(400, "echo and suffix are not supported by the agent endpoint", ends="malformed")
        self._note_sampling(req)
        return req

    def _note_sampling(self, req) -> None:
        """The run's sampling settings hold for every request (GRPO's samples and the trainer's log-probs
        use them); a request asking for others is served with the run's, said once per setting. What
        would change the sampled distribution otherwise (penalties, logit bias, a grammar, a minimum
        length, ...) or is the endpoint's own to choose (the seed) is ignored, said once too."""
        for name in ("temperature", "top_p", "top_k"):
            asked = getattr(req, name, None)
            if asked is not None and asked != self.sampling[name]:
                self._note_once(name, f"rollout.agent: a request asked {name}={asked}; every request is served "
                                      f"with the run's {name}={self.sampling[name]}")
        for name, default in _IGNORED:
            asked = getattr(req, name, default)
            if asked in (default, None, [], {}) or (name == "response_format" and getattr(asked, "type", "") == "text"):
                continue
            self._note_once(name, f"rollout.agent: a request set {name}={str(asked)[:80]}; the endpoint ignores it "
                                  "(it would sample from another distribution than the policy's, or the seed is "
                                  "the run's)")

    @staticmethod
    def stops(req) -> dict:
        """The request's stop strings and stop token ids, for the engine."""
        stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
        return {"stop": [x for x in stop if x], "stop_token_ids": list(getattr(req, "stop_token_ids", None) or [])}

    def chat_job(self, episode, req) -> Job:
        messages = [template_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        variables = dict(req.chat_template_kwargs or {})
        key = json.dumps([tools, variables], sort_keys=True, default=str)
        renderer = self._renderer(key, tools, variables)
        last: History | None = episode.history
        cmp = [comparable(m) for m in messages]
        n = len(last.messages) if last is not None else 0
        extends = (last is not None and last.kind == "chat" and last.key == key and last.eos
                   and req.add_generation_prompt and not req.continue_final_message
                   and len(cmp) >= n and cmp[:n] == last.messages)
        delta = None
        if extends:
            try:
                delta = renderer.delta_ids(messages[n:], ended_with_eos=True)
            except Exception as e:  # the template's rendering depends on later turns: render whole
                self._note_once("delta", f"rollout.agent: a history extension is rendered whole ({e})")
        if delta is not None:
            ids = last.ids + delta
        else:
            ids = self._render(renderer, key, messages, req.add_generation_prompt and not req.continue_final_message,
                               bool(req.continue_final_message))
        history = History("chat", key, cmp, [])
        constrained = self.constrain(req, key)
        # A constrained sample is scored again with its prompt (rlcore.rollout.serving.EngineSteps.score):
        # one position stays free for that request's one new token.
        max_tokens = self._max_tokens(req, ids, reserve=int(constrained is not None))
        return Job(episode, "chat", constrained or req, ids, delta, max_tokens, history, renderer,
                   stops=self.stops(req), key=key, constraint=constrained and constrained.structured_outputs,
                   rescore=constrained is not None and self.sampling["temperature"] > 0)

    def _render(self, renderer, key: str, messages: list[dict], generation_prompt: bool, continue_final: bool):
        """The prompt ids of ``messages`` (a copy: the caller's to extend), rendered once per call for the
        same messages (the first request of each of a group's n episodes; the template and a tokenizer
        call cost 0.3-0.5 ms)."""
        cache_key = (key, generation_prompt, continue_final, json.dumps(messages, default=str))
        ids = self._prompts.get(cache_key)
        if ids is None:
            ids = renderer.encode(renderer.render(messages, generation_prompt, continue_final=continue_final))
            if len(self._prompts) < 4096:
                self._prompts[cache_key] = ids
        return list(ids)

    def constrain(self, req, key: str):
        """The request as vLLM's server adjusts it when its tools constrain the reply, else None.

        vLLM 0.32.0's server calls its parser's ``adjust_request`` on a chat request whose tool_choice is
        not "none" (renderers/online_renderer.py:833-854). ``tool_choice: required`` and a named function
        then get a grammar: a tool parser with one of xgrammar's structural tags (hermes and others:
        ``structural_tag_model``) gets the tag of its own call format, at least one call (required) or
        exactly the named one (parser/abstract_parser.py:486-603, tool_parsers/structural_tag_registry.py:
        175-197), and parses the reply with the tool parser; any other tool parser gets the JSON schema of
        a list of {name, parameters} built from the tools (tool_parsers/abstract_tool_parser.py:122-178,
        tool_parsers/utils.py:425-489), the reply parsed as that JSON (abstract_parser.py:384-484). Tools
        marked ``strict`` and ``parallel_tool_calls: false`` constrain ``auto`` too (structural tags).
        Without a tool parser vLLM refuses required and named (online_renderer.py:259-281): so does this.
        The request's own response_format / structured_outputs stay ignored (_IGNORED)."""
        choice = req.tool_choice
        if not req.tools or choice in (None, "none"):
            return None
        if self._parser_cls is None or self._parser_cls.tool_parser_cls is None:
            if choice == "auto":
                return None
            name = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
            raise ApiError(400, f"tool_choice={name} needs a tool parser to read the calls: set rollout.tool_parser "
                           "(vLLM's server refuses it without --tool-call-parser)", ends="malformed")
        # adjust_request decides from the tools, the choice and parallel_tool_calls (the probe drops the
        # request's own response_format / structured_outputs)
        plain = (key, choice, req.parallel_tool_calls) if isinstance(choice, str) else None
        if plain in self._unconstrained:
            return None
        probe = req.model_copy(update={"structured_outputs": None, "response_format": None,
                                       "tools": [t.model_copy(deep=True) for t in req.tools]})
        try:
            with self._parser(key, probe.tools).take() as parser:
                probe = parser.adjust_request(probe)
        except ValueError as e:  # vLLM's own refusal of the tools or the choice (e.g. two schemas for one $defs name)
            raise ApiError(400, f"tool_choice={str(choice)[:80]}: {e}", ends="malformed") from e
        if probe.structured_outputs is None:
            if plain is not None:
                self._unconstrained.add(plain)
            return None
        self._check_rescorable(choice)
        return probe

    def _check_rescorable(self, choice) -> None:
        """A constrained sample's log-probs must be scored again with the policy's (serving.EngineSteps.score),
        which vLLM gives at temperature 1 and without top-k / top-p: other settings are refused (greedy
        validation trains nothing and needs no score)."""
        t, top_p, top_k = self.sampling["temperature"], self.sampling["top_p"], self.sampling["top_k"]
        if t == 0 or (t == 1.0 and top_p >= 1.0 and top_k in (None, -1, 0)):
            return
        raise ApiError(400, f"tool_choice={str(choice)[:80]} samples under a grammar, and the trainer needs the "
                       "policy's log-probs of those tokens: the endpoint gets them from vLLM's prompt log-probs, "
                       f"which are at temperature 1 with no top-k / top-p; this run samples at temperature={t}, "
                       f"top_p={top_p}, top_k={top_k}. Set rollout.temperature: 1, top_p: 1, top_k: -1, or send "
                       "tool_choice auto", ends="malformed")

    def text_job(self, episode, req) -> Job:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
            raise ApiError(400, "prompt must be one string or one list of token ids", ends="malformed")
        last: History | None = episode.history
        delta = None
        if isinstance(prompt, str):
            if last is not None and last.kind == "text" and last.text is not None and prompt.startswith(last.text):
                delta = self._encode(prompt[len(last.text):], False)
                ids = last.ids + delta
            else:
                ids = self._encode(prompt, req.add_special_tokens)
        else:
            ids = [int(t) for t in prompt]
            if last is not None and last.kind == "text" and ids[: len(last.ids)] == last.ids:
                delta = ids[len(last.ids):]
        history = History("text", "", [], [], text=prompt if isinstance(prompt, str) else None)
        return Job(episode, "text", req, ids, delta, self._max_tokens(req, ids), history, prompt_text=history.text,
                   stops=self.stops(req))

    def _encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

    def _max_tokens(self, req, ids: list[int], reserve: int = 0) -> int:
        """The request's max tokens, at most rollout.max_response_length and what the context holds
        (less ``reserve`` positions)."""
        room = self.max_model_len - len(ids) - reserve
        if room < 1:
            raise ApiError(400, f"this request's prompt is {len(ids)} tokens; the context holds "
                           f"{self.max_model_len} (rollout.max_model_len) with room for at least one new token",
                           code="context_length_exceeded", ends="length")
        asked = getattr(req, "max_completion_tokens", None) or vars(req).get("max_tokens") or self.max_tokens
        return max(1, min(asked, self.max_tokens, room))

    def _parser(self, key: str, tools) -> "_Pool":
        """vLLM's parser for requests with these tools (the key: rlcore.agent.openai_api.History.key)."""
        pool = self._parsers.get(key)
        if pool is None:
            cls, tok = self._parser_cls, self.tokenizer
            pool = self._parsers.setdefault(key, _Pool(lambda: cls(tok, tools)))
        return pool

    def _renderer(self, key: str, tools, variables):
        if key in self._renderers:
            return self._renderers[key]
        with self._lock:
            if key not in self._renderers:
                from rlcore.agent.chat import ChatRenderer, TemplateError

                try:
                    self._renderers[key] = ChatRenderer(self.tokenizer, tools, self.template, "", variables)
                except TemplateError as e:
                    raise ApiError(400, str(e), ends="malformed") from e
            return self._renderers[key]

    def _note_once(self, what: str, message: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("%s (logged once)", message)

    # ------------------------------------------------------------------ responses

    def served(self, job: Job) -> None:
        """Complete the job's History with what was sampled (the next request's reference)."""
        ids, _, _, _ = job.sample
        job.history.ids = job.prompt_ids + list(ids)
        job.history.eos = bool(ids) and ids[-1] == self.eos

    def turn_text(self, ids: list[int]) -> str:
        """The completion's text for the parsers: special tokens kept, the closing EOS dropped."""
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] == self.eos else ids, skip_special_tokens=False)

    @staticmethod
    def cut(job: Job, text: str) -> str:
        """The text up to the first of the request's stop strings (with it, with include_stop_str_in_output).
        A cut text is not what the sampled ids decode to: the next request cannot extend it."""
        hits = [(text.find(s), s) for s in job.stops.get("stop", []) if s in text]
        if not hits:
            return text
        at, stop = min(hits)
        job.history.text = None
        job.history.eos = False
        return text[: at + (len(stop) if getattr(job.request, "include_stop_str_in_output", False) else 0)]

    def chat_response(self, job: Job) -> dict:
        ids, logprobs, finish, cached = job.sample
        text = self.cut(job, self.turn_text(ids))
        req, reasoning, content, calls = job.request, None, text, []
        if self._parser_cls is not None:  # vLLM's server's parse (entrypoints/openai/chat_completion/serving.py:997-1003)
            with self._parser(job.key, req.tools).take() as parser:
                reasoning, content, found = parser.parse(text, req, enable_auto_tools=bool(req.tools),
                                                         **self._token_ids_kwarg(ids))
            calls = [(c.name, c.arguments) for c in found or []]
            content = content or ""
        ep = job.episode
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [{"id": f"call_{ep.index}_{ep.requests}_{j}", "type": "function",
                                      "function": {"name": name, "arguments": args}}
                                     for j, (name, args) in enumerate(calls)]
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        job.history.messages = job.history.messages + [comparable(template_message(message))]
        # vLLM's finish_reason (serving.py:1099-1112): tool_calls when auto parsed calls or required stopped;
        # a named function's reply finishes as the engine's did
        called = (req.tool_choice in ("auto", None) and calls) or (req.tool_choice == "required" and finish == "stop")
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(ids, logprobs, req),
                  "finish_reason": "tool_calls" if called else finish}
        return {"id": f"chatcmpl-{ep.index}-{ep.requests}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self._usage(job, ids, cached)}

    def text_response(self, job: Job) -> dict:
        ids, logprobs, finish, cached = job.sample
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if job.history.text is not None:
            job.history.text += text
        text = self.cut(job, text)
        lp = None
        if job.request.logprobs is not None:
            tokens = self.tokenizer.convert_ids_to_tokens(ids)
            lp = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}
        ep = job.episode
        return {"id": f"cmpl-{ep.index}-{ep.requests}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                                       "finish_reason": finish}],
                "usage": self._usage(job, ids, cached)}

    def _logprobs(self, ids: list[int], logprobs: list[float], req) -> dict | None:
        if not req.logprobs:
            return None
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens, logprobs)]}

    @staticmethod
    def _usage(job: Job, ids: list[int], cached: int) -> dict:
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(ids),
                "total_tokens": len(job.prompt_ids) + len(ids), "prompt_tokens_details": {"cached_tokens": cached}}


class _Pool:
    """Instances made on demand, one per concurrent user, reused after."""

    def __init__(self, make):
        self.make, self.free = make, queue.SimpleQueue()

    @contextmanager
    def take(self):
        try:
            obj = self.free.get_nowait()
        except queue.Empty:
            obj = self.make()
        try:
            yield obj
        finally:
            self.free.put(obj)


def stream_chunks(response: dict) -> list[dict]:
    """A whole chat completion as the chunks of a stream (a client that asked for ``stream`` gets the
    completion at once: the endpoint answers after the engine finishes the request)."""
    choice = response["choices"][0]
    msg = choice["message"]
    delta = {"role": "assistant", "content": msg.get("content")}
    if msg.get("tool_calls"):
        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]
    if msg.get("reasoning") is not None:
        delta["reasoning"] = delta["reasoning_content"] = msg["reasoning"]
    base = {k: response[k] for k in ("id", "created", "model")}
    first = {**base, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]}
    last = {**base, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}
    return [first, last]
