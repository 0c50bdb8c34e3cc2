"""Token-in, token-out conversations: the chat template renders only what the environment adds.

The sequence trained on is ``prompt ids + turn 1's sampled ids + delta 1 + turn 2's sampled ids +
...``: the model's tokens are never decoded and re-encoded (the re-tokenization drift other
frameworks' users report: a decode/encode round trip does not give back the sampled ids). Each
delta (the tool or environment messages, and the next generation prompt) comes from one rule for
every template (:meth:`ChatRenderer.delta_ids`): render a fixed one-message conversation with
and without the new messages, take the suffix, and put before it the text the template writes
after an assistant turn's end-of-turn token (``"\\n"`` after ``<|im_end|>`` in ChatML), because
the sampled turn ends at that token.

Tool calls are parsed with vLLM's own parsers (``vllm.tool_parsers``: hermes for Qwen3's
``<tool_call>{json}</tool_call>``, llama3_json, pythonic, ...), chosen by ``rollout.tool_parser``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

_PLACEHOLDER = [{"role": "user", "content": "x"}]


class TemplateError(ValueError):
    pass


class ChatRenderer:
    """The policy's chat template with the run's tool schemas."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, chat_template: str | None = None,
                 first_turn_prefix: str = "", template_kwargs: dict | None = None):
        """``template_kwargs``: more variables for the template (a request's chat_template_kwargs,
        e.g. enable_thinking), as transformers' apply_chat_template takes them."""
        self.tokenizer, self.tools, self.first_turn_prefix = tokenizer, tools or None, first_turn_prefix
        self.template_kwargs = dict(template_kwargs or {})
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise TemplateError("the tokenizer has no chat template; multi-turn rollouts render tool messages "
                                "with one: set rollout.multi_turn.chat_template to a Jinja file "
                                "(e.g. configs/chat_templates/qwen3.jinja)")
        self.turn_end = self._turn_end()
        self._before = self.render(_PLACEHOLDER, False)  # the fixed start every delta is cut from

    def render(self, messages: list[dict], generation_prompt: bool, continue_final: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=generation_prompt,
                                                  continue_final_message=continue_final, **self.template_kwargs)

    def prompt_text(self, messages: list[dict]) -> str:
        """The first prompt: the row's messages, the tools' system block, the generation prompt (and
        rollout.multi_turn.first_turn_prefix, which the first turn then continues)."""
        return self.render(messages, True) + self.first_turn_prefix

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.prompt_text(messages))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _turn_end(self) -> str:
        """What the template writes after an assistant turn's end-of-turn (EOS) token."""
        eos = self.tokenizer.eos_token or ""
        done = self.render(_PLACEHOLDER + [{"role": "assistant", "content": "y"}], False)
        cut = done.rfind(eos) if eos else -1
        return done[cut + len(eos):] if cut >= 0 else ""

    def delta_ids(self, new_messages: list[dict], ended_with_eos: bool) -> list[int]:
        """Ids of ``new_messages`` (tool / environment turns) and the next generation prompt, as the
        template renders them after an assistant turn. ``ended_with_eos``: the sampled turn's last
        token is the EOS (the template's separator after it then comes first)."""
        before, after = self._before, self.render(_PLACEHOLDER + new_messages, True)
        if not after.startswith(before):
            raise TemplateError("the chat template renders a conversation's start differently once tool messages "
                                "follow it, so no suffix rule applies; use a template whose earlier turns do not "
                                "depend on later ones (e.g. configs/chat_templates/qwen3.jinja)")
        return self.encode((self.turn_end if ended_with_eos else "") + after[len(before):])


@dataclass
class ParsedTurn:
    content: str  # the text outside the calls
    calls: list[tuple[str, str]]  # (name, JSON arguments)
    malformed: bool  # the turn opened a call the parser could not read


class ToolCallParser:
    """A vLLM tool parser (``vllm.tool_parsers.ToolParserManager``) used on whole turns."""

    def __init__(self, name: str, tokenizer, tools: list[dict]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        cls = ToolParserManager.get_tool_parser(name)
        # Its parse failures are logged with a traceback at ERROR; here they are counted instead.
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)
        self.parser = cls(tokenizer)
        self.request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="policy",
                                             tools=tools or None)
        self.start = getattr(self.parser, "tool_call_start_token", None)

    def parse(self, text: str) -> ParsedTurn:
        try:
            info = self.parser.extract_tool_calls(text, self.request)
        except Exception:  # a parser bug or odd text: the model's malformed call, not the trainer's crash
            return ParsedTurn(text, [], malformed=bool(self.start and self.start in text))
        if info.tools_called:
            return ParsedTurn(info.content or "", [(c.function.name, c.function.arguments) for c in info.tool_calls],
                              malformed=False)
        return ParsedTurn(info.content or text, [], malformed=bool(self.start and self.start in text))


def known_parsers() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())
