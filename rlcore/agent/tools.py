"""Tools the policy may call: built-ins (``calculator``, ``python``) and the user's own functions.

A tool is a Python callable with a JSON schema (the OpenAI function format the chat templates'
``tools=`` renders). ``tools: [calculator, my_tools.py:lookup]`` in the config; a user function's
schema comes from its type hints and Google-style docstring (transformers' ``get_json_schema``),
or is given explicitly as ``{fn: my_tools.py:lookup, schema: {...}}`` and then checked against the
function's signature before anything loads.

Every call ends in a :class:`CallResult`; nothing a tool does (raise, hang, print gigabytes) reaches
the trainer as an exception. ``python`` runs in :mod:`rlcore.agent.sandbox`, and so does a user
tool listed as ``{fn: my_tools.py:lookup, sandboxed: true}`` (its file runs in the sandboxed child;
JSON arguments in, its JSON-encoded result out); the others run in a bounded thread pool with a
wall-clock timeout (a hung user function leaks its thread, not the step).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from rlcore.agent import sandbox


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., object]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    sandboxed: bool = False  # runs in its own process (the python tool): no thread timeout needed
    source: str | None = None  # a sandboxed user tool's file: the child runs it and calls the function


@dataclass
class CallResult:
    content: str  # what the model reads in the tool message
    error: str | None = None  # None | "unknown_tool" | "bad_arguments" | "raised" | "timeout" | "output_limit" | ...

    @property
    def timed_out(self) -> bool:
        return self.error == "timeout"


# ------------------------------------------------------------------------------------ built-ins

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log, "exp": math.exp}


def _eval_node(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:  # 10**10**10 would hang the thread
            raise ValueError("exponent too large (at most 64)")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        return _FUNCS[node.func.id](*[_eval_node(a) for a in node.args])
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly as written.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3"; also sqrt, abs, round, min, max, log, exp.
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval_node(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout).

    Args:
        code: the program; print the values you need.
    """
    raise RuntimeError("the python tool runs in rlcore.agent.sandbox, not in the trainer")  # see run_call


BUILTINS = {"calculator": calculator, "python": python}


# ------------------------------------------------------------------------------------ loading


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-format schema of ``fn`` from its type hints and Google-style docstring."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def check_schema(name: str, schema: dict, fn: Callable) -> str | None:
    """Why ``schema`` does not fit ``fn``'s signature, or None: every required parameter of the
    function is in the schema, every schema property is a parameter, the schema's required ones
    are parameters without defaults... and the names agree."""
    try:
        fschema = schema["function"] if "function" in schema else schema
        props = set(fschema.get("parameters", {}).get("properties", {}))
        required = set(fschema.get("parameters", {}).get("required", []))
    except (AttributeError, TypeError):
        return "the schema must be {type: function, function: {name, description, parameters: {properties, required}}}"
    if fschema.get("name") != name:
        return f"the schema's name is {fschema.get('name')!r}, the function's {name!r}"
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    plain = {k: p for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    no_default = {k for k, p in plain.items() if p.default is p.empty}
    if missing := sorted(no_default - props):
        return f"the function requires {missing}, which the schema's properties lack"
    if extra := sorted(props - set(plain)) if not takes_kwargs else []:
        return f"the schema has properties {extra} that are not parameters of the function"
    if unknown := sorted(required - props):
        return f"the schema requires {unknown}, which are not among its properties"
    return None


def load_tools(specs: list, load_fn: Callable[[str], Callable]) -> dict[str, Tool]:
    """name -> Tool for each entry of the ``tools`` config: a built-in name, ``path.py:function`` /
    ``package.module:function``, or ``{fn: ..., schema: {...}}``. Raises ValueError naming the
    entry and the fix (the config check turns it into exit 2 before any model loads)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        ref, schema = (spec.get("fn"), spec.get("schema")) if isinstance(spec, dict) else (spec, None)
        opt_in = bool(spec.get("sandboxed", False)) if isinstance(spec, dict) else False
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"tools entry {spec!r}: give a built-in name ({', '.join(BUILTINS)}), "
                             "path.py:function, or {fn: path.py:function, schema: {...}}")
        fn = BUILTINS.get(ref) or load_fn(ref)
        name = fn.__name__
        if schema is None:
            try:
                schema = tool_schema(fn)
            except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
                raise ValueError(f"tools entry {ref!r}: no schema could be derived from the function ({e}); add "
                                 "type hints and a Google-style docstring with an Args: section, or give "
                                 "{fn: ..., schema: {...}}") from e
        elif (why := check_schema(name, schema, fn)) is not None:
            raise ValueError(f"tools entry {ref!r}: the schema does not match the function: {why}; fix the schema")
        if name in tools:
            raise ValueError(f"tools entry {ref!r}: a tool named {name!r} is listed twice; list each once")
        schema = schema if "function" in schema else {"type": "function", "function": schema}
        source = _sandboxed_source(ref, fn) if opt_in and fn is not python else None
        tools[name] = Tool(name, fn, schema, sandboxed=fn is python or opt_in, source=source)
    return tools


def _sandboxed_source(ref: str, fn: Callable) -> str:
    """The file a sandboxed user tool's child runs: the function must be a module-level function
    of a plain .py file (the child executes that file's source, then calls it by name)."""
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        path = None
    if not path or not path.endswith(".py") or getattr(fn, "__qualname__", "") != fn.__name__:
        raise ValueError(f"tools entry {ref!r}: sandboxed: true needs a module-level function of a .py file; "
                         "move it into one, or drop sandboxed")
    return path


# ------------------------------------------------------------------------------------ calling


def _short_error(output: str, limit: int = 400) -> str:
    """The last lines of a traceback, without the sandbox runner's own frames."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip() and '"<string>"' not in ln]
    return "\n".join(lines[-3:])[-limit:]


def run_call(tool: Tool | None, name: str, arguments: str | dict, limits: sandbox.Limits) -> CallResult:
    """One call, in the calling thread (the pool in :class:`ToolRunner` bounds them)."""
    if tool is None:
        return CallResult(f"Error: unknown tool {name!r}", "unknown_tool")
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        if not isinstance(args, dict):
            raise ValueError("the arguments must be a JSON object")
        inspect.signature(tool.fn).bind(**args)
    except (ValueError, TypeError) as e:
        return CallResult(f"Error: bad arguments for {name}: {e}", "bad_arguments")
    if tool.sandboxed and tool.source is None:
        return _sandbox_result(sandbox.run_python(str(args.get("code", "")), limits))
    if tool.sandboxed:  # only JSON crosses: the arguments in, the function's result (json.dumps) out
        value, result = sandbox.run_function(tool.source, tool.fn.__name__, args, limits)
        if not result.ok:
            return _sandbox_result(result)
    else:
        try:
            value = tool.fn(**args)
        except Exception as e:  # the tool's own failure: the model reads it, the step goes on
            return CallResult(f"Error: {type(e).__name__}: {e}", "raised")
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text.encode()) > limits.output_bytes:
        return CallResult(text.encode()[: limits.output_bytes].decode(errors="ignore"), "output_limit")
    return CallResult(text)


def _sandbox_result(result: sandbox.Result) -> CallResult:
    if result.ok:
        return CallResult(result.output)
    detail = _short_error(result.output) if result.error.startswith("exit") else result.error
    return CallResult(f"Error ({result.error}): {detail}", "timeout" if result.error == "timeout"
                      else "output_limit" if result.error == "output_limit" else "raised")


class ToolRunner:
    """Runs a turn's calls concurrently in a bounded pool; each call gets its wall-clock limit."""

    def __init__(self, tools: dict[str, Tool], limits: sandbox.Limits, workers: int):
        self.tools, self.limits = tools, limits
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rl-tool")

    def run(self, calls: list[tuple[str, str | dict]]) -> list[CallResult]:
        futures = [self.pool.submit(run_call, self.tools.get(name), name, args, self.limits) for name, args in calls]
        results = []
        deadline = time.monotonic() + self.limits.timeout_s + 5.0  # the sandbox's own limit, plus its start-up
        for fut, (name, _) in zip(futures, calls):
            try:
                limit = self.limits.timeout_s if not getattr(self.tools.get(name), "sandboxed", False) else None
                results.append(fut.result(timeout=max(deadline - time.monotonic(), 0.0) if limit is None else
                                          max(min(limit, deadline - time.monotonic()), 0.0)))
            except FutureTimeout:
                results.append(CallResult(f"Error (timeout): {name} ran longer than {self.limits.timeout_s:g} s",
                                          "timeout"))
        return results

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
