"""The house's rules, read from the source (``ast``): which wing may import which library and which
wing, and no import circle among rlcore's modules. Imports inside functions count; imports under
``if TYPE_CHECKING:`` (annotations only) do not. Each wing's ``__init__.py`` says the same in words.
"""

from __future__ import annotations

import ast
import itertools
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "rlcore")

# rlcore/ itself: only the ground floor, which every wing may use and which imports no wing.
GROUND = {"rlcore", "rlcore.dist", "rlcore.errors", "rlcore.heap", "rlcore.hf_folder", "rlcore.metrics",
          "rlcore.protocols", "rlcore.quiet", "rlcore.torchvision_shim"}
WINGS = ("agent", "algo", "config", "demo", "distill", "engine", "judge", "plan", "rollout", "run", "step", "task")
MAX_LINES = 600


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                out[name] = path
    return out


MODULES = _modules()


def _imports(path: str) -> set[str]:
    """Every module ``path`` imports at run time (``from a import b``: ``a.b`` when that is a module)."""
    tree = ast.parse(open(path).read())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in MODULES else node.module)
    return out


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _wing(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else None


def _offenders(rule) -> list[str]:
    return sorted(f"{m} imports {', '.join(sorted(bad))}" for m, imps in IMPORTS.items() if (bad := rule(m, imps)))


def _libs(imps: set[str], *libs: str) -> set[str]:
    return {i for i in imps if i.split(".")[0] in libs}


@pytest.mark.unit
def test_rlcore_root_holds_only_the_ground_floor():
    """A new capability goes into a wing (or a new one): rlcore/ holds only what every wing uses."""
    loose = sorted(m for m in MODULES if m.count(".") == 1 and m not in GROUND and _wing(m) is None)
    assert not loose, f"modules outside any wing: {loose}; move each into the wing it belongs to"
    missing = [w for w in WINGS if f"rlcore.{w}" not in MODULES]
    assert not missing, f"wings without an __init__.py: {missing}"


@pytest.mark.unit
def test_ground_floor_imports_no_wing():
    bad = _offenders(lambda m, imps: {i for i in imps if i.startswith("rlcore.") and _wing(i)} if m in GROUND else ())
    assert not bad, bad


@pytest.mark.unit
def test_vllm_only_in_the_rollout_wing_and_the_agent():
    """The rollout wing owns vLLM; the agent is a rollout capability (vLLM's tool parsers)."""
    bad = _offenders(lambda m, imps: _libs(imps, "vllm") if _wing(m) not in ("rollout", "agent") else ())
    assert not bad, bad


@pytest.mark.unit
def test_veomni_only_in_the_engine_wing():
    bad = _offenders(lambda m, imps: _libs(imps, "veomni") if _wing(m) != "engine" else ())
    assert not bad, bad


@pytest.mark.unit
def test_engine_and_rollout_never_import_each_other():
    """The two engines meet only in the phase switch, through (name, tensor) pairs."""
    other = {"engine": "rlcore.rollout", "rollout": "rlcore.engine"}
    bad = _offenders(lambda m, imps: {i for i in imps if i.startswith(other[_wing(m)])}
                     if _wing(m) in other else ())
    assert not bad, bad


@pytest.mark.unit
def test_algo_is_pure_math():
    """algo/ imports torch, numpy and the ground floor: no engine library, no config at run time,
    no other wing."""
    def rule(m, imps):
        if _wing(m) != "algo":
            return ()
        return _libs(imps, "vllm", "veomni", "transformers") | {
            i for i in imps if i.startswith("rlcore.") and _wing(i) not in (None, "algo")}
    bad = _offenders(rule)
    assert not bad, bad


@pytest.mark.unit
def test_nothing_imports_the_run_wing():
    """run/ is the top floor: only the entry points (train_grpo.py, scripts/) import it."""
    bad = _offenders(lambda m, imps: {i for i in imps if _wing(i) == "run"} if _wing(m) != "run" else ())
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan): the import circles."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], itertools.count()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return cycles


@pytest.mark.unit
def test_no_import_circle_among_rlcores_modules():
    graph = {m: {i for i in imps if i in MODULES and i != m} for m, imps in IMPORTS.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import circles (imports inside functions included): {cycles}"


@pytest.mark.unit
def test_the_wings_stack_without_an_arrow_up():
    """Between wings too: no two wings import each other, directly or around a circle (engine
    and rollout take configs as arguments; config asks them for device choices)."""
    wing = lambda m: _wing(m) or "ground"  # noqa: E731
    graph: dict[str, set[str]] = {}
    for m, imps in IMPORTS.items():
        graph.setdefault(wing(m), set()).update(wing(i) for i in imps if i in MODULES and wing(i) != wing(m))
    cycles = _cycles(graph)
    assert not cycles, f"wings that import each other: {cycles}; move the shared piece down a floor"


@pytest.mark.unit
def test_each_wing_says_what_it_owns_and_may_import():
    for w in WINGS:
        doc = ast.get_docstring(ast.parse(open(MODULES[f"rlcore.{w}"]).read())) or ""
        assert "May import" in doc, \
            f"rlcore/{w}/__init__.py: its docstring must say what the wing owns and what it may import"


@pytest.mark.unit
def test_no_module_over_the_line_budget():
    long = sorted(f"{os.path.relpath(p, REPO)} ({n} lines)" for p in MODULES.values()
                  if (n := sum(1 for _ in open(p))) > MAX_LINES)
    assert not long, f"split these along what they do: {long}"


@pytest.mark.unit
def test_the_rules_see_what_they_forbid(tmp_path):
    """The reader itself: a function-level import counts, a TYPE_CHECKING one does not."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n"
                   "def f():\n    from veomni import x\n    from rlcore.algo import grpo\n")
    imps = _imports(str(src))
    assert "veomni" in imps and "rlcore.algo.grpo" in imps and "vllm" not in imps
