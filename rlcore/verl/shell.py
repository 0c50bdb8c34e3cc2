"""Read a verl launch script as bash would, far enough to find its training command and the
overrides on it, without running anything.

It understands what verl's examples and recipes use: comments (also inside arrays), line
continuations (a backslash at the end of the file too), ``VAR=value`` and ``export VAR=value``,
arrays (``A=( ... )``, ``A+=( ... )``, ``"${A[@]}"``), ``$VAR`` / ``${VAR}`` / ``$1`` / ``$@`` /
``${@:2}`` (script variables first, then the environment), bash's parameter operators
(``:-`` ``:=`` ``:+`` ``:?``, ``${v//a/b}`` ``${v/a/b}`` ``${v#p}`` ``${v%p}`` ``${v:1:2}`` ``${#v}``
``${v^^}`` ``${v,,}``), ``$(( arithmetic ))``, single and double quotes, ``case ... esac`` and
``if [ ... ]; then ... elif ... else ... fi`` with ``[ a = b ]``-style tests. A command substitution
``$(...)`` is not run: it expands to an empty string and is reported (set the variable in the
environment instead, e.g. ``DEVICE=npu``); verl's ``$(probe && echo npu || echo gpu)`` takes its
fallback. Loops and functions are skipped. What it cannot read is a ShellError naming the line and
the construct.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import os
import re

SEPS = (";;", "&&", "||", ";", "|", "&", "\n")
KEYWORDS = {"then", "do", "else", "elif", "fi", "esac", "done", "{", "}"}
NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")


class ShellError(ValueError):
    """The script cannot be read: ``line`` (1-based, None when unknown) and what stopped the reader."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message, self.line = message, line

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


def _skip_comment(text: str, i: int) -> int:
    while i < len(text) and text[i] != "\n":
        i += 1
    return i


def _matching(text: str, i: int, open_ch: str, close_ch: str, comments: bool = False) -> int:
    """Index just past the close_ch that balances text[i] == open_ch (quote-aware; with ``comments``
    a ``#`` that starts a word runs to the end of its line, as in an array literal)."""
    depth, quote, start = 0, None, i
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif comments and c == "#" and (i == 0 or text[i - 1] in " \t\n("):
            i = _skip_comment(text, i)
            continue
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    what = f"a quote ({quote}) opened inside" if quote else f"no {close_ch!r} closes"
    raise ShellError(f"{what} the {open_ch!r} at {text[start:start + 30]!r}...")


def _dquote_end(text: str, i: int) -> int:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        if text.startswith("$(", j):
            j = _matching(text, j + 1, "(", ")")
            continue
        j += 1
    raise ShellError("a double quote that is never closed")


def _word_end(text: str, i: int) -> int:
    """End of the word starting at text[i] (quotes, $(...), ${...} and NAME=( ... ) arrays inside)."""
    start, n = i, len(text)
    while i < n and (text[i] not in " \t\r\n;&|" or (text[i] == "&" and text[i - 1] in "<>")):
        c = text[i]
        if text.startswith("\\\n", i):
            break
        if c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise ShellError("a single quote that is never closed")
            i = end + 1
        elif c == '"':
            i = _dquote_end(text, i)
        elif c == "\\":
            i += 2
        elif text.startswith("$(", i):
            i = _matching(text, i + 1, "(", ")")
        elif text.startswith("${", i):
            i = _matching(text, i + 1, "{", "}")
        elif c == "(" and NAME.match(text[start:i]):  # NAME=( ... ) array literal, comments inside
            i = _matching(text, i, "(", ")", comments=True)
        else:
            i += 1
    return min(i, n)


def tokenize(text: str) -> list[tuple[str, str, int]]:
    """The script as ("word", raw text, line) and ("sep", separator, line) tokens; quotes stay in
    the raw text. A backslash at the very end of the file is dropped, as bash drops it."""
    text = re.sub(r"\\\s*\Z", "\n", text)
    tokens, i, n = [], 0, len(text)
    while i < n:
        c, line = text[i], text.count("\n", 0, i) + 1
        if text.startswith("\\\n", i):
            i += 2
        elif c in " \t\r":
            i += 1
        elif c == "#":
            i = _skip_comment(text, i)
        elif c == "&" and i > 0 and text[i - 1] in "<>":
            tokens[-1] = ("word", tokens[-1][1] + "&", line) if tokens and tokens[-1][0] == "word" else ("word", "&", line)
            i += 1
        elif any(text.startswith(s, i) for s in SEPS):
            sep = next(s for s in SEPS if text.startswith(s, i))
            tokens.append(("sep", sep, line))
            i += len(sep)
        else:
            try:
                end = _word_end(text, i)
            except ShellError as e:
                raise ShellError(e.message, line) from None
            tokens.append(("word", text[i:end], line))
            i = end
    return tokens


class Shell:
    """Variables, the positional arguments and what expansion could not do."""

    def __init__(self, args: list[str], environ: dict[str, str] | None = None):
        self.vars: dict[str, str | list[str]] = {}
        self.args = list(args)
        self.environ = dict(os.environ if environ is None else environ)
        self.exports: dict[str, str] = {}
        self.notes: list[str] = []
        self.used: list[str] = []  # variables the last expansion read (to name an empty one)

    def get(self, name: str) -> str | list[str] | None:
        if name.isdigit():
            k = int(name)
            return self.args[k - 1] if 0 < k <= len(self.args) else None
        if name in ("@", "*"):
            return list(self.args)
        self.used.append(name)
        return self.vars[name] if name in self.vars else self.environ.get(name)

    def scalar(self, name: str) -> str:
        value = self.get(name)
        return (value[0] if value else "") if isinstance(value, list) else (value or "")

    # ------------------------------------------------------------------ expansion
    def expand(self, raw: str) -> list[str]:
        """The fields one raw word becomes (several only for ${A[@]} / $@ / ${@:k} as the whole word)."""
        whole = re.fullmatch(r'"?\$\{?([A-Za-z_][A-Za-z0-9_]*)\[@\]\}?"?|"?\$\{?@(?::(\d+)(?::(\d+))?)?\}?"?', raw)
        if whole:
            value = self.get(whole.group(1) or "@")
            items = list(value) if isinstance(value, list) else ([value] if value else [])
            if whole.group(2) is not None:  # ${@:offset[:length]}: $0 is offset 0
                start = max(int(whole.group(2)) - 1, 0)
                items = items[start:] if whole.group(3) is None else items[start:start + int(whole.group(3))]
            return items
        fields, current, started = [], [], False
        for text, quoted in self._expand_parts(raw):
            if quoted:
                current.append(text)
                started = True
                continue
            pieces = re.split(r"[ \t\n]+", text)
            for k, piece in enumerate(pieces):
                if k > 0 and (started or current):
                    fields.append("".join(current))
                    current, started = [], False
                if piece:
                    current.append(piece)
                    started = True
        if started or current:
            fields.append("".join(current))
        return fields

    def _expand_str(self, raw: str) -> str:
        return "".join(text for text, _ in self._expand_parts(raw))

    def _expand_parts(self, raw: str) -> list[tuple[str, bool]]:
        """raw's expansion as (text, quoted) pieces: unquoted pieces are split into fields (bash's IFS)."""
        parts, i, quote = [], 0, None
        while i < len(raw):
            c = raw[i]
            if quote == "'":
                if c == "'":
                    quote = None
                else:
                    parts.append((c, True))
                i += 1
            elif c == "'" and quote is None:
                quote = "'"
                i += 1
            elif c == '"':
                quote = None if quote == '"' else '"'
                i += 1
            elif c == "\\" and i + 1 < len(raw):
                nxt = raw[i + 1]
                if nxt != "\n":  # a backslash-newline is a line continuation, in quotes too
                    parts.append((nxt if quote is None or nxt in '$`"\\' else c + nxt, quote is not None))
                i += 2
            elif c == "$":
                text, i = self._dollar(raw, i)
                parts.append((text, quote is not None))
            elif c == "`":
                end = raw.find("`", i + 1)
                if end < 0:
                    raise ShellError("a backquote that is never closed")
                self.notes.append(f"command substitution {raw[i:end + 1]} not run (empty)")
                i = end + 1
            else:
                parts.append((c, quote is not None))
                i += 1
        return parts

    def _dollar(self, raw: str, i: int) -> tuple[str, int]:
        if raw.startswith("$((", i):
            end = _matching(raw, i + 1, "(", ")")
            return str(self.arith(raw[i + 3:end - 2])), end
        if raw.startswith("$(", i):
            end = _matching(raw, i + 1, "(", ")")
            fallback = re.search(r"\|\|\s*echo\s+([\w.-]+)\s*$", raw[i + 2:end - 1])
            if fallback:  # verl's `$(probe && echo npu || echo gpu)`: what a machine without the probe gets
                self.notes.append(f"command substitution {raw[i:end]} not run: took its fallback "
                                  f"{fallback.group(1)!r} (set the variable in the environment to choose)")
                return fallback.group(1), end
            self.notes.append(f"command substitution {raw[i:end]} not run (empty); set the variable in the environment")
            return "", end
        if raw.startswith("${", i):
            end = _matching(raw, i + 1, "{", "}")
            return self._brace(raw[i + 2:end - 1]), end
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?]", raw[i + 1:])
        if not m:
            return "$", i + 1
        name = m.group(0)
        value = str(len(self.args)) if name == "#" else " ".join(self.get(name)) if name in "@*" else self.scalar(name)
        return value, i + 1 + len(name)

    def _brace(self, body: str) -> str:
        if re.fullmatch(r"#[A-Za-z_][A-Za-z0-9_]*", body):
            return str(len(self.scalar(body[1:])))
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|@|\*)(\[[^\]]*\])?(.*)", body, re.S)
        if not m:
            raise ShellError(f"the expansion ${{{body}}} (not a parameter bash knows)")
        name, index, rest = m.groups()
        value = self.get(name)
        if index and index not in ("[@]", "[*]"):
            items = value if isinstance(value, list) else [value or ""]
            k = int(self.arith(index[1:-1]))
            value = items[k] if k < len(items) else None
        elif isinstance(value, list):
            value = " ".join(value)
        return self._operator(name, value, rest, body)

    def _operator(self, name: str, value: str | None, rest: str, body: str) -> str:
        """${name OP word}: the default/assign/alternative/error forms, substitution, trimming,
        substrings and case changes."""
        m = re.fullmatch(r"(:?[-=+?])(.*)", rest, re.S)
        if m:
            op, word = m.groups()
            unset = value is None or (op.startswith(":") and value == "")
            if op in ("-", ":-"):
                return self._expand_str(word) if unset else value
            if op in ("=", ":="):
                if unset:
                    self.vars[name] = self._expand_str(word)
                return self.scalar(name)
            if op in ("+", ":+"):
                return "" if unset else self._expand_str(word)
            if unset:
                raise ShellError(f"${{{body}}}: {name} is not set ({self._expand_str(word) or 'parameter null or not set'})")
            return value
        value = value or ""
        if not rest:
            return value
        if m := re.fullmatch(r"(//|/#|/%|/)([^/]*)(?:/(.*))?", rest, re.S):
            return _substitute(value, m.group(1), self._expand_str(m.group(2)), self._expand_str(m.group(3) or ""))
        if m := re.fullmatch(r"(##|#|%%|%)(.*)", rest, re.S):
            return _trim(value, m.group(1), self._expand_str(m.group(2)))
        if m := re.fullmatch(r":\s*(-?[^:]+)(?::(.+))?", rest, re.S):
            start = self.arith(m.group(1))
            start = max(len(value) + start, 0) if start < 0 else start
            if m.group(2) is None:
                return value[start:]
            length = self.arith(m.group(2))
            return value[start:start + length] if length >= 0 else value[start:len(value) + length]
        cases = {"^^": str.upper, ",,": str.lower, "^": lambda s: s[:1].upper() + s[1:], ",": lambda s: s[:1].lower() + s[1:]}
        if rest in cases:
            return cases[rest](value)
        raise ShellError(f"the expansion ${{{body}}} (operator {rest[:3]!r} is not read here)")

    _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
            ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}

    def arith(self, expr: str) -> int:
        """bash's $(( )): integers, + - * / % **, parentheses, variables (unset or empty = 0). A
        division by zero is bash's own error."""
        text = self._expand_str(expr)
        numbers = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.scalar(m.group(0)) or "0", text)

        def ev(node):
            if isinstance(node, ast.Expression):
                return ev(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in self._OPS:
                left, right = ev(node.left), ev(node.right)
                if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                    token = text[text.rfind("/") + 1:] if "/" in text else text[text.rfind("%") + 1:]
                    raise ShellError(f"{text.strip()}: division by 0 (error token is \"{token.lstrip()}\"); "
                                     "a variable defined later in the script, or unset, counts as 0")
                return int(self._OPS[type(node.op)](left, right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
            raise ShellError(f"the arithmetic $(({expr})) (only integers, + - * / % ** and parentheses are read)")

        try:
            return ev(ast.parse(numbers.strip() or "0", mode="eval"))
        except SyntaxError:
            raise ShellError(f"the arithmetic $(({expr})) (only integers, + - * / % ** and parentheses are read)") from None

    # ------------------------------------------------------------------ statements
    def assign(self, raw: str) -> None:
        m = NAME.match(raw)
        name, append, rest = m.group(1), m.group(2) == "+", raw[m.end():]
        if rest.startswith("(") and rest.endswith(")"):
            items = [f for kind, w, _ in tokenize(rest[1:-1]) if kind == "word" for f in self.expand(w)]
            old = self.vars.get(name, []) if append else []
            self.vars[name] = (old if isinstance(old, list) else [old]) + items
        else:
            self.vars[name] = (self.scalar(name) if append else "") + self._expand_str(rest)


def _substitute(value: str, op: str, pattern: str, replacement: str) -> str:
    """${v/p/r} (first match), ${v//p/r} (all), ${v/#p/r} (prefix), ${v/%p/r} (suffix); glob patterns."""
    if not pattern:
        return value
    rx = fnmatch.translate(pattern).removesuffix(r"\Z").removeprefix("(?s:").removesuffix(")")
    rx = {"/#": "^(?:" + rx + ")", "/%": "(?:" + rx + ")$"}.get(op, rx)
    return re.sub(rx, lambda _: replacement, value, count=0 if op == "//" else 1, flags=re.S)


def _trim(value: str, op: str, pattern: str) -> str:
    """${v#p} ${v##p} (shortest / longest prefix), ${v%p} ${v%%p} (suffix); glob patterns."""
    cuts = range(len(value) + 1)
    if op in ("#", "##"):
        hits = [k for k in cuts if fnmatch.fnmatchcase(value[:k], pattern)]
        return value[(min(hits) if op == "#" else max(hits)):] if hits else value
    hits = [k for k in cuts if fnmatch.fnmatchcase(value[k:], pattern)]
    return value[:(max(hits) if op == "%" else min(hits))] if hits else value
