"""Read a verl launch script as bash would, far enough to find its ``python3 -m verl.trainer.main_ppo``
line and the overrides on it, without running anything (scripts/from_verl.py).

It understands what verl's own examples use: comments, line continuations, ``VAR=value`` and
``export VAR=value``, arrays (``A=( ... )``, ``A+=( ... )``, ``"${A[@]}"``), ``$VAR`` / ``${VAR}`` /
``${VAR:-default}`` / ``${VAR:=default}`` / ``${VAR:+alt}`` / ``$1`` / ``$@`` (script variables first,
then the environment), ``$(( arithmetic ))``, single and double quotes, ``case ... esac`` and
``if [ ... ]; then ... elif ... else ... fi`` with ``[ a = b ]``-style tests. A command substitution
``$(...)`` is not run: it expands to an empty string and is reported (set the variable in the
environment instead, e.g. ``DEVICE=npu``). Loops and functions are skipped.
"""

from __future__ import annotations

import ast
import operator
import os
import re

SEPS = (";;", "&&", "||", ";", "|", "&", "\n")
KEYWORDS = {"then", "do", "else", "elif", "fi", "esac", "done", "{", "}"}
NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")


class ShellError(ValueError):
    """The script cannot be read (unbalanced quotes, an unsupported construct)."""


def _matching(text: str, i: int, open_ch: str, close_ch: str) -> int:
    """Index just past the close_ch that balances text[i] == open_ch (quote-aware)."""
    depth, quote = 0, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
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
    raise ShellError(f"unbalanced {open_ch!r}{close_ch!r} or quote")


def tokenize(text: str) -> list[tuple[str, str]]:
    """The script as ("word", raw text) and ("sep", separator) tokens; quotes stay in the raw text."""
    tokens, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("\\\n", i):
            i += 2
        elif c in " \t\r":
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "&" and i > 0 and text[i - 1] in "<>":
            tokens[-1] = ("word", tokens[-1][1] + "&") if tokens and tokens[-1][0] == "word" else ("word", "&")
            i += 1
        elif any(text.startswith(s, i) for s in SEPS):
            sep = next(s for s in SEPS if text.startswith(s, i))
            tokens.append(("sep", sep))
            i += len(sep)
        else:
            start = i
            while i < n and (text[i] not in " \t\r\n;&|" or (text[i] == "&" and text[i - 1] in "<>")):
                c = text[i]
                if text.startswith("\\\n", i):
                    break
                if c in "'\"":
                    end = text.find("'", i + 1) + 1 if c == "'" else _dquote_end(text, i)
                    if end <= i:
                        raise ShellError("unbalanced single quote")
                    i = end
                elif c == "\\":
                    i += 2
                elif c == "$" and text.startswith("$(", i):
                    i = _matching(text, i + 1, "(", ")")
                elif c == "$" and text.startswith("${", i):
                    i = _matching(text, i + 1, "{", "}")
                elif c == "(" and NAME.match(text[start:i]):  # NAME=( ... ) array literal
                    i = _matching(text, i, "(", ")")
                else:
                    i += 1
            tokens.append(("word", text[start:i]))
    return tokens


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
    raise ShellError("unbalanced double quote")


class Shell:
    """Variables, the positional arguments and what expansion could not do."""

    def __init__(self, args: list[str], environ: dict[str, str] | None = None):
        self.vars: dict[str, str | list[str]] = {}
        self.args = list(args)
        self.environ = dict(os.environ if environ is None else environ)
        self.exports: dict[str, str] = {}
        self.notes: list[str] = []

    def get(self, name: str) -> str | list[str] | None:
        if name.isdigit():
            k = int(name)
            return self.args[k - 1] if 0 < k <= len(self.args) else None
        if name in ("@", "*"):
            return list(self.args)
        return self.vars[name] if name in self.vars else self.environ.get(name)

    def scalar(self, name: str) -> str:
        value = self.get(name)
        return (value[0] if value else "") if isinstance(value, list) else (value or "")

    # ------------------------------------------------------------------ expansion
    def expand(self, raw: str) -> list[str]:
        """The fields one raw word becomes (several only for ${A[@]} / $@ as the whole word)."""
        whole = re.fullmatch(r'"?\$\{?([A-Za-z_][A-Za-z0-9_]*)\[@\]\}?"?|"?\$\{?@\}?"?', raw)
        if whole:
            value = self.get(whole.group(1) or "@")
            return list(value) if isinstance(value, list) else ([value] if value else [])
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

        class _Out:
            def append(self, text):
                parts.append((text, quote is not None))
        out = _Out()
        while i < len(raw):
            c = raw[i]
            if quote == "'":
                if c == "'":
                    quote = None
                else:
                    out.append(c)
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
                    out.append(nxt if quote is None or nxt in '$`"\\' else c + nxt)
                i += 2
            elif c == "$":
                text, i = self._dollar(raw, i)
                out.append(text)
            elif c == "`":
                end = raw.index("`", i + 1)
                self.notes.append(f"command substitution {raw[i:end + 1]} not run (empty)")
                i = end + 1
            else:
                out.append(c)
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
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|@)(\[[^\]]*\])?(?:(:?[-=+?])(.*))?", body, re.S)
        if not m:
            if body.startswith("#"):
                return str(len(self.scalar(body[1:])))
            raise ShellError(f"unsupported expansion ${{{body}}}")
        name, index, op, word = m.groups()
        value = self.get(name)
        if index and index not in ("[@]", "[*]"):
            items = value if isinstance(value, list) else [value or ""]
            k = int(self.arith(index[1:-1]))
            value = items[k] if k < len(items) else ""
        elif isinstance(value, list):
            value = " ".join(value)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in ("-", ":-"):
            return self._expand_str(word) if unset else value
        if op in ("=", ":="):
            if unset:
                self.vars[name] = self._expand_str(word)
            return self.scalar(name)
        if op in ("+", ":+"):
            return "" if unset else self._expand_str(word)
        if op in ("?", ":?") and unset:
            raise ShellError(f"${{{body}}}: {name} is not set ({self._expand_str(word)})")
        return value or ""

    _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
            ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}

    def arith(self, expr: str) -> int:
        """bash's $(( )): integers, + - * / % **, parentheses, variables (unset = 0)."""
        expr = self._expand_str(expr)
        expr = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.scalar(m.group(0)) or "0", expr)

        def ev(node):
            if isinstance(node, ast.Expression):
                return ev(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in self._OPS:
                return self._OPS[type(node.op)](ev(node.left), ev(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
                return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
            raise ShellError(f"unsupported arithmetic $(({expr}))")

        try:
            return ev(ast.parse(expr.strip(), mode="eval"))
        except SyntaxError as e:
            raise ShellError(f"unsupported arithmetic $(({expr}))") from e

    # ------------------------------------------------------------------ statements
    def assign(self, raw: str) -> None:
        m = NAME.match(raw)
        name, append, rest = m.group(1), m.group(2) == "+", raw[m.end():]
        if rest.startswith("(") and rest.endswith(")"):
            items = [f for kind, w in tokenize(rest[1:-1]) if kind == "word" for f in self.expand(w)]
            old = self.vars.get(name, []) if append else []
            self.vars[name] = (old if isinstance(old, list) else [old]) + items
        else:
            self.vars[name] = (self.scalar(name) if append else "") + self._expand_str(rest)


def parse(tokens: list[tuple[str, str]]) -> list:
    """Nodes: ("cmd", [raw words], joiner) | ("case", raw, [(patterns, body)]) | ("if", [(cond, body)], else)."""
    pos = [0]

    def command() -> tuple[list[str], str]:
        words = []
        while pos[0] < len(tokens):
            kind, text = tokens[pos[0]]
            if kind == "sep":
                if words or text == ";;":
                    return words, text
                pos[0] += 1
                continue
            pos[0] += 1
            if not words and text in KEYWORDS:
                return [text], ";"
            words.append(text)
        return words, "\n"

    def block(stops: set[str]) -> tuple[list, str]:
        nodes = []
        while pos[0] < len(tokens):
            if tokens[pos[0]] == ("sep", ";;"):
                if ";;" in stops:
                    pos[0] += 1
                    return nodes, ";;"
                raise ShellError("';;' outside a case")
            words, joiner = command()
            if not words:
                continue
            head = words[0]
            if head in stops:
                return nodes, head
            if head == "if":
                nodes.append(if_node(words[1:], joiner))
            elif head == "case":
                nodes.append(case_node(words))
            elif head in ("for", "while", "until"):
                block({"do"})
                block({"done"})
            elif re.fullmatch(r"[A-Za-z_][\w-]*\(\)", head) or (len(words) > 1 and words[1] == "()") or head == "function":
                block({"}"})
            elif head not in KEYWORDS:
                nodes.append(("cmd", words, joiner))
        return nodes, ""

    def cond_until_then(first: list[str], joiner: str) -> list:
        cond = [(first, joiner)] if first else []
        while True:
            words, joiner = command()
            if not words:
                raise ShellError("'if' without 'then'")
            if words[0] == "then":
                return cond
            cond.append((words, joiner))

    def if_node(first: list[str], joiner: str):
        branches, other = [], None
        cond = cond_until_then(first, joiner)
        while True:
            body, stop = block({"elif", "else", "fi"})
            branches.append((cond, body))
            if stop == "elif":
                words, joiner = command()
                cond = cond_until_then(words, joiner)
            elif stop == "else":
                other, _ = block({"fi"})
                return ("if", branches, other)
            elif stop == "fi":
                return ("if", branches, other)
            else:
                raise ShellError("'if' without 'fi'")

    def case_node(words: list[str]):
        if len(words) < 3 or words[2] != "in":
            raise ShellError("'case' without 'in'")
        word, arms = words[1], []
        while True:
            patterns = []
            while True:
                kind, text = tokens[pos[0]] if pos[0] < len(tokens) else ("sep", "")
                pos[0] += 1
                if kind == "word" and text == "esac" and not patterns:
                    return ("case", word, arms)
                if kind == "word":
                    patterns.append(text.lstrip("(").rstrip(")"))
                    if text.endswith(")"):
                        break
                elif text == "":
                    raise ShellError("'case' without 'esac'")
            body, stop = block({";;", "esac"})
            arms.append((patterns, body))
            if stop == "esac":
                return ("case", word, arms)

    nodes, stop = block(set())
    return nodes


def _test(shell: Shell, words: list[str]) -> bool:
    """[ ... ] / [[ ... ]] / test with = == != -n -z -eq -ne -lt -le -gt -ge -f -d -e and !."""
    args = [f for w in words for f in shell.expand(w)]
    if args and args[0] in ("[", "[["):
        args = args[1:-1]
    elif args and args[0] == "test":
        args = args[1:]
    elif args and args[0] in ("true", ":"):
        return True
    elif args and args[0] == "false":
        return False
    else:
        shell.notes.append(f"condition {' '.join(words)!r} not evaluated (taken as false)")
        return False
    if args and args[0] == "!":
        return not _test(shell, ["test", *args[1:]])
    if len(args) == 2 and args[0] in ("-n", "-z"):
        return bool(args[1]) == (args[0] == "-n")
    if len(args) == 2 and args[0] in ("-f", "-d", "-e"):
        return {"-f": os.path.isfile, "-d": os.path.isdir, "-e": os.path.exists}[args[0]](args[1])
    if len(args) == 1:
        return bool(args[0])
    if len(args) == 3:
        a, op, b = args
        if op in ("=", "=="):
            return a == b
        if op == "!=":
            return a != b
        ints = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le,
                "-gt": operator.gt, "-ge": operator.ge}
        if op in ints:
            return ints[op](int(a or 0), int(b or 0))
    shell.notes.append(f"condition {' '.join(words)!r} not evaluated (taken as false)")
    return False


def _drop_redirections(words: list[str]) -> list[str]:
    """Words less redirections (2>&1, >&2, 2>/dev/null, > file)."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif re.match(r"^[0-9]*(>>|>&|<&|>|<)", w):
            skip = re.fullmatch(r"[0-9]*(>>|>|<)", w) is not None  # the target is the next word
        else:
            out.append(w)
    return out


class _Exit(Exception):
    pass


def run(text: str, args: list[str], environ: dict[str, str] | None = None):
    """Execute the script's assignments and branches; returns (the argv of each verl launch, Shell)."""
    import fnmatch

    shell, launches = Shell(args, environ), []

    def cond(parts) -> bool:
        result, joiner = True, "&&"
        for words, next_joiner in parts:
            if words in (["{"], ["}"]):
                continue
            if (joiner == "&&" and result) or (joiner == "||" and not result) or joiner in (";", "\n"):
                result = _test(shell, words)
            joiner = next_joiner
        return result

    def execute(nodes):
        for node in nodes:
            if node[0] == "case":
                word = shell._expand_str(node[1])
                for patterns, body in node[2]:
                    if any(fnmatch.fnmatchcase(word, shell._expand_str(p)) for p in patterns):
                        execute(body)
                        break
            elif node[0] == "if":
                for c, body in node[1]:
                    if cond(c):
                        execute(body)
                        break
                else:
                    execute(node[2] or [])
            else:
                command(node[1])

    def command(words):
        if words[0] in ("export", "local", "readonly", "declare", "typeset"):
            for w in words[1:]:
                if NAME.match(w):
                    shell.assign(w)
                    if words[0] == "export":
                        shell.exports[NAME.match(w).group(1)] = shell.scalar(NAME.match(w).group(1))
            return
        if all(NAME.match(w) for w in words):
            for w in words:
                shell.assign(w)
            return
        lead = 0
        while lead < len(words) and NAME.match(words[lead]):  # VAR=x cmd: the command's own environment
            lead += 1
        argv = [f for w in _drop_redirections(words[lead:]) for f in shell.expand(w)]
        if argv and argv[0] == "exit":
            raise _Exit()
        for i, a in enumerate(argv[:-1]):
            if a == "-m" and argv[i + 1].startswith("verl."):
                launches.append((argv[:i + 2], argv[i + 2:]))
                return

    try:
        execute(parse(tokenize(text)))
    except _Exit:
        pass
    return launches, shell
