"""A verl override list in, this project's config out: every key in one of three classes.

``Converter.run`` sorts each key the script sets: a rule's (rlcore/verl/rules_*.py, more than a
copy), a plain copy (keys.MAPPED), no effect here (keys.NO_EFFECT: a comment naming why) or no
equivalent (keys.UNMAPPED: exit 2 unless --allow-unmapped). Unset keys take verl's default
(rlcore/verl/defaults.py), and where verl's default differs from this project's the converter writes
verl's. The result is checked by this project's own parse: a value it refuses makes its verl key
"no equivalent", never a config that fails later.
"""

from __future__ import annotations

import json
import typing
from dataclasses import fields, is_dataclass

from rlcore.verl import keys as K
from rlcore.verl.defaults import Defaults
from rlcore.verl.rules import RULES
from rlcore.verl.values import BadInput, fmt


def project_keys() -> dict[str, type]:
    """Every dotted key of this project's Config and its field type (rlcore/config)."""
    from rlcore.config import Config

    out = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            t = hints[f.name]
            if is_dataclass(t):
                walk(t, prefix + f.name + ".")
            else:
                out[prefix + f.name] = t
    walk(Config, "")
    return out


def project_defaults() -> dict[str, object]:
    """Every dotted key of this project's Config and its default value."""
    from rlcore.config import Config

    out = {}

    def walk(obj, prefix):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                walk(value, prefix + f.name + ".")
            else:
                out[prefix + f.name] = list(value) if isinstance(value, tuple) else value
    walk(Config(), "")
    return out


def _base_type(t):
    """(the Python type of a field's values, its Literal choices or None)."""
    args = typing.get_args(t)
    base = next((a for a in args if a is not type(None)), t) if args and typing.get_origin(t) is typing.Union else t
    origin = typing.get_origin(base) or base
    if origin is typing.Literal:
        return type(typing.get_args(base)[0]), typing.get_args(base)
    return origin, None


def cast(target: str, value, types: dict[str, type], verl_key: str):
    """value in the type of this project's key; a wrong type is a BadInput naming both keys."""
    t = types.get(target)
    if value is None and type(None) in typing.get_args(t):
        return None
    origin, choices = _base_type(t)
    if choices is not None and value not in choices:
        raise Refused(f"{target} takes one of {', '.join(map(str, choices))}")
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool), str: isinstance(value, (str, int, float)),
          list: isinstance(value, (list, str)), tuple: isinstance(value, list), dict: isinstance(value, dict)}.get(origin, True)
    if not ok:
        raise BadInput(f"{verl_key}={value!r}: {target} takes values of type {getattr(origin, '__name__', origin)}; "
                       f"fix the value in the script")
    if origin is float:
        return float(value)
    if origin is str:
        return str(value)
    if origin is list and isinstance(value, str):
        return [value]
    return value


class Refused(Exception):
    """A value this project's key does not take (its verl key has no equivalent then)."""


class Converter:
    """The conversion of one override list (``values``: verl key -> (value, as written)) against
    verl's defaults (``defaults``) and this project's keys; ``origins`` maps an argument to the
    script text it came from (to name the variable behind an empty value)."""

    def __init__(self, values: dict, defaults: Defaults, *, origins: dict | None = None, entry: str = "main_ppo"):
        self.v, self.defaults, self.origins, self.entry = values, defaults, origins or {}, entry
        self.types, self.project = project_keys(), project_defaults()
        self.out: dict[str, tuple[object, str, str]] = {}  # this key -> (value, comment, verl key)
        self.unmapped: list[tuple[str, str, str]] = []  # (verl key, value as written, why)
        self.no_effect: list[tuple[str, str, str]] = []
        self.notes: list[str] = []
        self.done: set[str] = set()  # verl keys a rule or the tables have decided
        # this project's keys whose check reads a file the conversion's machine may lack (reward.fn):
        # left out of check_with_project_parse; the trainer checks them at start-up
        self.unchecked: set[str] = set()

    # ------------------------------------------------------------------ reading
    def given(self, key: str) -> bool:
        return key in self.v

    def get(self, key: str, default=None):
        """The script's value, else verl's default (resolved), else ``default``."""
        if key in self.v:
            return self.v[key][0]
        value = self.defaults.value(key, default)
        return default if value is None else value

    def said(self, key: str) -> str:
        """'key=value' as the script wrote it, or 'key=value (verl default)'."""
        if key in self.v:
            return f"{key}={self.v[key][1]}"
        value = self.defaults.value(key)
        return f"{key}={json.dumps(value)} (verl default)"

    def integer(self, key: str, default=None) -> int | None:
        """An integer key; empty (an unset variable) or not a number is a BadInput naming the key and
        the script's text and variables it came from."""
        value = self.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if value is None:
            return None
        text = self.v[key][1] if key in self.v else str(value)
        raw, variables = self.origins.get(f"{key}={text}", self.origins.get(f"+{key}={text}", (None, [])))
        where = f" (the script writes {raw!r}" + (f"; {', '.join(variables)} expand(s) to {text!r}" if variables else "") \
            + ")" if raw else ""
        what = "is empty" if text == "" else f"is {text!r}, not an integer"
        fix = f"set {' / '.join(variables)} in the environment or the script" if variables else "give it an integer value"
        raise BadInput(f"{key} {what}{where}: {fix}")

    # ------------------------------------------------------------------ writing
    def put(self, target: str, value, comment: str, verl_key: str) -> None:
        if target not in self.types:
            self.refuse(verl_key, f"{target} is not a key of this checkout yet")
            return
        try:
            self.out[target] = (cast(target, value, self.types, verl_key), comment, verl_key)
        except Refused as e:
            self.refuse(verl_key, str(e))

    def refuse(self, key: str, why: str, value: str | None = None) -> None:
        """Class 3: changes training and has no equivalent here."""
        text = value if value is not None else (self.v[key][1] if key in self.v else f"{self.get(key)} (verl default)")
        self.unmapped.append((key, text, why))
        self.done.add(key)

    def ignore(self, key: str, why: str) -> None:
        """Class 2: no effect on what is trained here (listed only when the script sets it)."""
        if key in self.v:
            self.no_effect.append((key, self.v[key][1], why))
        self.done.add(key)

    def note(self, text: str) -> None:
        self.notes.append(text)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        for key in list(self.v):
            self.classify(key)
        for rule in RULES:
            rule(self)
        for key in list(self.v):
            if key not in self.done:
                target, _ = K.MAPPED[key]
                self.put(target, self.get(key), self.said(key), key)
        self.verl_defaults()

    def classify(self, key: str) -> None:
        kind, info = K.lookup(key)
        value = self.v[key][0]
        if kind in ("rule", "mapped"):
            return
        if kind == "no_effect" and key in K.NO_EFFECT_ONLY and value not in K.NO_EFFECT_ONLY[key][0]:
            self.refuse(key, K.NO_EFFECT_ONLY[key][1])
        elif kind == "no_effect":
            self.ignore(key, info)
        else:
            self.refuse(key, info)

    def verl_defaults(self) -> None:
        """Each plain-copy key the script leaves unset whose verl default differs from this
        project's: written with verl's value."""
        for key, (target, _) in K.MAPPED.items():
            if key in self.v or target in self.out or target not in self.types:
                continue
            value = self.defaults.value(key)
            if value is None or key in self.done:
                continue
            try:
                value = cast(target, value, self.types, key)
            except (BadInput, Refused):
                continue
            if value != self.project.get(target) and not _same_auto(target, value):
                self.out[target] = (value, self.said(key), key)


# Project keys whose null resolves on cuda/npu to verl's default: not written (null stays device-aware).
AUTO_EQUAL = {"rollout.enforce_eager": False, "rollout.enable_chunked_prefill": True,
              "rollout.enable_prefix_caching": True}


def _same_auto(target: str, value) -> bool:
    return target in AUTO_EQUAL and AUTO_EQUAL[target] == value


def to_yaml(conv: Converter, source: str, allow_unmapped: bool) -> str:
    lines = [f"# Converted from {source} by scripts/from_verl.py: each key's comment names the verl key it came from."]
    if conv.unmapped and allow_unmapped:
        lines += ["#", "# What this run does NOT do of the verl script (keys with no equivalent here, --allow-unmapped):"]
        lines += [f"#   {k}{'=' + v if v else ''}: {why}" for k, v, why in conv.unmapped]
    lines.append("")
    tree: dict = {}
    for key in sorted(conv.out, key=lambda k: (k.split(".")[0], k)):
        node, parts = tree, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = conv.out[key]

    def emit(node, depth):
        for name, item in node.items():
            if isinstance(item, dict):
                lines.append("  " * depth + f"{name}:")
                emit(item, depth + 1)
            else:
                value, comment, _ = item
                lines.append("  " * depth + f"{name}: {fmt(value)}  # {comment}")
    emit(tree, 0)
    if conv.no_effect:
        lines += ["", "# verl keys with no effect on what is trained here:"]
        lines += [f"#   {k}={v}: {why}" for k, v, why in conv.no_effect]
    return "\n".join(lines) + "\n"


def instantiate(cls, values: dict):
    """``cls`` built from a nested dict as the parser builds it: sections in sections, lists to tuples."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in values:
            continue
        value, t = values[f.name], hints[f.name]
        if is_dataclass(t):
            value = instantiate(t, value)
        elif tuple in (typing.get_origin(t), *map(typing.get_origin, typing.get_args(t))) and isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def check_with_project_parse(conv: Converter, source: str) -> None:
    """This project's config checks on the converted values (every section's ``__post_init__``, as
    the trainer's parse runs them; no model files needed; ``conv.unchecked`` left out): a value they
    refuse makes the verl key behind it "no equivalent", with the check's message."""
    from rlcore.config import Config

    for _ in range(len(conv.out) + 1):
        tree: dict = {}
        for key, (value, _, _) in conv.out.items():
            if key in conv.unchecked:
                continue
            node, parts = tree, key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        try:
            instantiate(Config, tree)
            return
        except (ValueError, TypeError) as e:
            message = str(e)
            bad = [t for t in conv.out if message.startswith(t)] or [t for t in conv.out if t in message]
            if not bad:
                raise BadInput(f"this project's checks refuse the converted config: {message}") from None
            target = max(bad, key=len)
            _, _, verl_key = conv.out.pop(target)
            conv.refuse(verl_key, f"this project refuses {target}: {message}")
