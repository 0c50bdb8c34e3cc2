"""What a judge reads and how its answer becomes a number: templates and score parsers.

A template is Jinja when it holds ``{{`` or ``{%`` (sandboxed, undefined names are errors), else a
Python format string. Its fields: ``prompt`` (the row's prompt text; of chat messages, the last
user turn), ``response`` (the policy's answer, special tokens removed), ``answer`` (the reference)
and every top-level field of the data row.
"""

from __future__ import annotations

import math
import re
import string
from typing import Callable

BUILTIN_FIELDS = ("prompt", "response", "answer")


class Template:
    def __init__(self, source: str):
        self.source = source
        self.jinja = "{{" in source or "{%" in source
        if self.jinja:
            from jinja2 import StrictUndefined, TemplateSyntaxError, meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
            try:
                self.fields = set(meta.find_undeclared_variables(env.parse(source)))
                self._compiled = env.from_string(source)
            except TemplateSyntaxError as e:
                raise ValueError(f"it is not a valid Jinja template ({e}); fix the syntax") from None
        else:
            try:
                self.fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(source)
                               if f is not None}
            except ValueError as e:
                raise ValueError(f"it is not a valid format string ({e}); use {{response}} or Jinja's "
                                 "{{ response }}") from None
            if "" in self.fields:
                raise ValueError("positional {} fields are not allowed; name them, e.g. {response}")

    def render(self, fields: dict) -> str:
        return self._compiled.render(**fields) if self.jinja else self.source.format(**fields)

    def missing(self, row: dict) -> list[str]:
        """Fields this template names that neither the built-ins nor ``row`` provide."""
        return sorted(f for f in self.fields if f not in BUILTIN_FIELDS and f not in row)


def compile_template(source: str) -> Template:
    return Template(source)


def prompt_text(row: dict, prompt_key: str) -> str:
    """The prompt a judge sees: the row's prompt field; of chat messages, the last user turn."""
    from rlcore.task.prompts import get_key

    prompt = get_key(row, prompt_key)
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else ""
    return prompt if isinstance(prompt, str) else str(prompt)


def compile_parser(spec: str) -> Callable[[str], float | None]:
    """``spec`` as ``text -> score or None``: a "file.py:function" / "module:function" reward-style
    spec, else a regex (the first group of its last match, or the whole match without groups)."""
    if spec.endswith(".py") or (":" in spec and re.fullmatch(r"[\w./-]+:\w+", spec)):
        from rlcore.task.rewards import load_custom_fn

        return load_custom_fn(spec)
    try:
        pattern = re.compile(spec)
    except re.error as e:
        raise ValueError(f"it is not a valid regex ({e}); e.g. 'Score: (\\d+)'") from None

    def parse(text: str) -> float | None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        m = matches[-1]
        return float(m.group(1) if pattern.groups else m.group(0))

    return parse


def to_score(value, score_range: list[float] | None) -> float | None:
    """A parser's value as a finite float, mapped to [0, 1] by ``score_range``; None when unreadable."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    if score_range is None:
        return value
    lo, hi = score_range
    return min(max((value - lo) / (hi - lo), 0.0), 1.0)
