"""A verl launch script's statements, executed as far as they set variables and choose branches
(rlcore.verl.shell expands the words): the training command each launch line reaches, with the
script text each override came from.

``run(text, args, environ)`` returns the launches and the Shell. A launch is the command's argv up
to its module (``python3 -m verl.trainer.main_ppo``, also behind ``uv run``, ``ray job submit ...
--`` or ``torchrun``) and the arguments after it. Nothing is executed: ``case`` and ``if`` choose
their branch with ``[ ... ]`` tests on the variables; loops and functions are skipped.
"""

from __future__ import annotations

import fnmatch
import operator
import os
import re

from rlcore.verl.shell import KEYWORDS, NAME, Shell, ShellError, tokenize

# Python modules that start training: verl's own and its recipes' entry points
LAUNCH_PREFIXES = ("verl.", "recipe.")


def parse(tokens: list[tuple[str, str, int]]) -> list:
    """Nodes: ("cmd", [raw words], joiner, line) | ("case", raw, [(patterns, body)], line) |
    ("if", [(cond, body)], else, line)."""
    return _Parser(tokens).block(set())[0]


class _Parser:
    """A recursive-descent reader of the token list; ``pos`` is the next token."""

    def __init__(self, tokens: list[tuple[str, str, int]]):
        self.tokens, self.pos = tokens, 0

    def command(self) -> tuple[list[str], str, int]:
        words, line = [], self.tokens[self.pos][2] if self.pos < len(self.tokens) else 0
        while self.pos < len(self.tokens):
            kind, text, at = self.tokens[self.pos]
            if kind == "sep":
                if words or text == ";;":
                    return words, text, line
                self.pos += 1
                continue
            self.pos += 1
            if not words:
                line = at
                if text in KEYWORDS:
                    return [text], ";", line
            words.append(text)
        return words, "\n", line

    def block(self, stops: set[str]) -> tuple[list, str]:
        nodes = []
        while self.pos < len(self.tokens):
            if self.tokens[self.pos][:2] == ("sep", ";;"):
                if ";;" in stops:
                    self.pos += 1
                    return nodes, ";;"
                raise ShellError("';;' outside a case", self.tokens[self.pos][2])
            words, joiner, line = self.command()
            if not words:
                continue
            head = words[0]
            if head in stops:
                return nodes, head
            if head == "if":
                nodes.append(self.if_node(words[1:], joiner, line))
            elif head == "case":
                nodes.append(self.case_node(words, line))
            elif head in ("for", "while", "until", "select"):
                self.skip({"do"}, line, head)
                self.skip({"done"}, line, head)
            elif re.fullmatch(r"[A-Za-z_][\w-]*\(\)", head) or (len(words) > 1 and words[1] == "()") or head == "function":
                self.skip({"}"}, line, "function")
            elif head not in KEYWORDS:
                nodes.append(("cmd", words, joiner, line))
        return nodes, ""

    def skip(self, stops: set[str], line: int, what: str) -> None:
        _, stop = self.block(stops)
        if not stop:
            raise ShellError(f"'{what}' without '{'/'.join(sorted(stops))}'", line)

    def cond_until_then(self, first: list[str], joiner: str, line: int) -> list:
        cond = [(first, joiner)] if first else []
        while True:
            words, joiner, _ = self.command()
            if not words:
                raise ShellError("'if' without 'then'", line)
            if words[0] == "then":
                return cond
            cond.append((words, joiner))

    def if_node(self, first: list[str], joiner: str, line: int):
        branches, other = [], None
        cond = self.cond_until_then(first, joiner, line)
        while True:
            body, stop = self.block({"elif", "else", "fi"})
            branches.append((cond, body))
            if stop == "elif":
                words, joiner, _ = self.command()
                cond = self.cond_until_then(words, joiner, line)
            elif stop == "else":
                other, stop = self.block({"fi"})
                if stop != "fi":
                    raise ShellError("'if' without 'fi'", line)
                return ("if", branches, other, line)
            elif stop == "fi":
                return ("if", branches, other, line)
            else:
                raise ShellError("'if' without 'fi'", line)

    def case_node(self, words: list[str], line: int):
        if len(words) < 3 or words[2] != "in":
            raise ShellError("'case' without 'in'", line)
        word, arms = words[1], []
        while True:
            patterns = []
            while True:
                kind, text, _ = self.tokens[self.pos] if self.pos < len(self.tokens) else ("sep", "", line)
                self.pos += 1
                if kind == "word" and text == "esac" and not patterns:
                    return ("case", word, arms, line)
                if kind == "word":
                    patterns.append(text.lstrip("(").rstrip(")"))
                    if text.endswith(")"):
                        break
                elif text == "":
                    raise ShellError("'case' without 'esac'", line)
            body, stop = self.block({";;", "esac"})
            arms.append((patterns, body))
            if stop == "esac":
                return ("case", word, arms, line)
            if stop != ";;":
                raise ShellError("'case' without 'esac'", line)


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
            return fnmatch.fnmatchcase(a, b) if words[0] == "[[" else a == b
        if op == "!=":
            return a != b
        ints = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le,
                "-gt": operator.gt, "-ge": operator.ge}
        if op in ints and re.fullmatch(r"-?\d*", a) and re.fullmatch(r"-?\d*", b):
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


class Runner:
    """Executes the parsed nodes on a Shell; ``launches`` collects each training command reached,
    ``sources`` maps each expanded argument to (the script text it came from, the variables read)."""

    def __init__(self, shell: Shell):
        self.shell, self.launches, self.sources = shell, [], {}

    def execute(self, nodes) -> None:
        for node in nodes:
            try:
                self.node(node)
            except ShellError as e:
                if e.line is None:
                    e.line = node[-1]
                raise

    def node(self, node) -> None:
        shell = self.shell
        if node[0] == "case":
            word = shell._expand_str(node[1])
            for patterns, body in node[2]:
                if any(fnmatch.fnmatchcase(word, shell._expand_str(p)) for p in patterns):
                    self.execute(body)
                    break
        elif node[0] == "if":
            for c, body in node[1]:
                if self.cond(c):
                    self.execute(body)
                    break
            else:
                self.execute(node[2] or [])
        else:
            self.command(node[1])

    def cond(self, parts) -> bool:
        result, joiner = True, "&&"
        for words, next_joiner in parts:
            if words in (["{"], ["}"]):
                continue
            if (joiner == "&&" and result) or (joiner == "||" and not result) or joiner in (";", "\n"):
                result = _test(self.shell, words)
            joiner = next_joiner
        return result

    def assign(self, raw: str) -> None:
        shell = self.shell
        shell.used = []
        shell.assign(raw)
        value = shell.vars[NAME.match(raw).group(1)]
        for item in value if isinstance(value, list) else []:
            self.sources.setdefault(item, (raw, list(shell.used)))

    def command(self, words: list[str]) -> None:
        shell = self.shell
        if words[0] in ("export", "local", "readonly", "declare", "typeset"):
            for w in words[1:]:
                if NAME.match(w):
                    self.assign(w)
                    if words[0] == "export":
                        shell.exports[NAME.match(w).group(1)] = shell.scalar(NAME.match(w).group(1))
            return
        if all(NAME.match(w) for w in words):
            for w in words:
                self.assign(w)
            return
        lead = 0
        while lead < len(words) and NAME.match(words[lead]):  # VAR=x cmd: the command's own environment
            lead += 1
        argv = []
        for w in _drop_redirections(words[lead:]):
            shell.used = []
            fields = shell.expand(w)
            for f in fields:
                self.sources.setdefault(f, (w, list(shell.used)))
            argv += fields
        if argv and argv[0] == "exit":
            raise _Exit()
        for i, a in enumerate(argv[:-1]):
            if a == "-m" and argv[i + 1].startswith(LAUNCH_PREFIXES):
                self.launches.append((argv[:i + 2], argv[i + 2:]))
                return


def run(text: str, args: list[str], environ: dict[str, str] | None = None):
    """Execute the script's assignments and branches; returns (Runner, Shell): the Runner's
    ``launches`` hold (argv up to the module, the arguments after it) of each training command."""
    shell = Shell(args, environ)
    runner = Runner(shell)
    try:
        runner.execute(parse(tokenize(text)))
    except _Exit:
        pass
    return runner, shell
