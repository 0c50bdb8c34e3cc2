"""The house's rules, read from the source (``ast``): which wing may import which library and which
wing, and no import circle among rlcore's modules, nor among the wings and the design card's modules.
Every import counts: inside functions, and under ``if TYPE_CHECKING:`` (annotations only) too, since
a reader follows an annotation's import as surely as a call's. Each wing's ``__init__.py`` says the
same in words.

The design card (the project's specification) names three modules at rlcore's top:
``rlcore/engine_veomni.py`` (the VeOmni FSDP2 policy engine; its parts in ``rlcore/engine/``),
``rlcore/colocate_rollout.py`` (the colocated in-process vLLM engine; its parts in ``rlcore/rollout/``)
and ``rlcore/advantage.py`` (the advantage estimators and losses, pure tensor math, which
``rlcore/algo/`` builds on). They are the homes of what they name: their classes and functions are
defined there, not re-exported.
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
          "rlcore.protocols", "rlcore.quiet", "rlcore.torchvision_shim", "rlcore.trackers"}
WINGS = ("agent", "algo", "config", "demo", "distill", "engine", "judge", "plan", "rollout", "run", "step", "task",
         "verl")
# The design card's modules -> the wing of their parts, and what each must define itself.
CARD = {"rlcore.engine_veomni": ("engine", {"VeOmniPolicy", "LoraPolicy"}),
        "rlcore.colocate_rollout": ("rollout", {"ColocateRollout", "Sample"}),
        "rlcore.advantage": ("algo", {"compute_advantages", "kl_penalty", "aggregate_loss", "policy_loss"})}
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
    """Every module ``path`` imports, anywhere: at the top, inside functions, under ``TYPE_CHECKING``
    (``from a import b``: ``a.b`` when that is a module)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
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


def _side(name: str) -> str | None:
    """The wing a module works for: its own, or for a design-card module the wing of its parts."""
    return CARD[name][0] if name in CARD else _wing(name)


def _node(name: str) -> str:
    """A module's node in the graph of floors: its wing, a design-card module by itself, or ground."""
    return _wing(name) or (name.removeprefix("rlcore.") if name in CARD else "ground")


def _offenders(rule) -> list[str]:
    return sorted(f"{m} imports {', '.join(sorted(bad))}" for m, imps in IMPORTS.items() if (bad := rule(m, imps)))


def _libs(imps: set[str], *libs: str) -> set[str]:
    return {i for i in imps if i.split(".")[0] in libs}


@pytest.mark.unit
def test_rlcore_root_holds_only_the_ground_floor_and_the_design_cards_modules():
    """A new capability goes into a wing (or a new one): rlcore/ holds what every wing uses and the
    three modules the design card names."""
    loose = sorted(m for m in MODULES if m.count(".") == 1 and m not in GROUND and m not in CARD
                   and _wing(m) is None)
    assert not loose, f"modules outside any wing: {loose}; move each into the wing it belongs to"
    missing = [w for w in WINGS if f"rlcore.{w}" not in MODULES] + [m for m in CARD if m not in MODULES]
    assert not missing, f"wings without an __init__.py, or design-card modules missing: {missing}"


@pytest.mark.unit
def test_the_design_cards_modules_define_what_they_name():
    """Not re-export shims: each module defines its classes and functions itself (``def``/``class``
    at its top level), and the wing of its parts neither defines them again nor re-exports them."""
    for name, (wing, names) in CARD.items():
        tree = ast.parse(open(MODULES[name]).read())
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert names <= defined, f"{MODULES[name]} must define {sorted(names - defined)}"
        for m, path in MODULES.items():
            if _wing(m) != wing:
                continue
            body = ast.parse(open(path).read()).body
            again = {n.name for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef))} & names
            again |= {a.asname or a.name for n in body if isinstance(n, ast.ImportFrom) and n.module == name
                      for a in n.names} & names
            assert not again, f"{path} defines or re-exports {sorted(again)}, which live in {MODULES[name]}"


@pytest.mark.unit
def test_ground_floor_imports_no_wing():
    bad = _offenders(lambda m, imps: {i for i in imps if i.startswith("rlcore.") and _wing(i)} if m in GROUND else ())
    assert not bad, bad


@pytest.mark.unit
def test_vllm_only_in_colocate_rollout_its_wing_and_the_agent():
    """rlcore/colocate_rollout.py and the rollout wing own vLLM; the agent is a rollout capability
    (vLLM's tool parsers)."""
    bad = _offenders(lambda m, imps: _libs(imps, "vllm") if _side(m) not in ("rollout", "agent") else ())
    assert not bad, bad


@pytest.mark.unit
def test_veomni_only_in_engine_veomni_and_its_wing():
    bad = _offenders(lambda m, imps: _libs(imps, "veomni") if _side(m) != "engine" else ())
    assert not bad, bad


@pytest.mark.unit
def test_engine_and_rollout_never_import_each_other():
    """The two engines meet only in the phase switch, through (name, tensor) pairs."""
    other = {"engine": "rollout", "rollout": "engine"}
    bad = _offenders(lambda m, imps: {i for i in imps if i in MODULES and _side(i) == other[_side(m)]}
                     if _side(m) in other else ())
    assert not bad, bad


@pytest.mark.unit
def test_a_wings_parts_never_import_the_design_card_module_they_make_up():
    """engine/ is what rlcore/engine_veomni.py is built from, rollout/ what rlcore/colocate_rollout.py
    is built from: the arrow points from the module to its parts (a judge's engine is handed in built)."""
    heads = {"engine": "rlcore.engine_veomni", "rollout": "rlcore.colocate_rollout"}
    bad = _offenders(lambda m, imps: {heads[_wing(m)]} & imps if _wing(m) in heads else ())
    assert not bad, bad


@pytest.mark.unit
def test_algo_and_advantage_are_pure_math():
    """rlcore/advantage.py imports torch and the ground floor only; algo/ also numpy, advantage and its
    own sections: no engine library, not the config package, no other wing."""
    def rule(m, imps):
        if m == "rlcore.advantage":
            return {i for i in imps if i.split(".")[0] not in ("__future__", "typing", "math", "torch")
                    and i not in GROUND}
        if _wing(m) != "algo":
            return ()
        return _libs(imps, "vllm", "veomni", "transformers") | {
            i for i in imps if i.startswith("rlcore.") and _wing(i) not in (None, "algo") and i != "rlcore.advantage"}
    bad = _offenders(rule)
    assert not bad, bad


@pytest.mark.unit
def test_nothing_imports_the_run_wing():
    """run/ is the top floor: only the entry points (train_grpo.py, scripts/) import it."""
    bad = _offenders(lambda m, imps: {i for i in imps if _wing(i) == "run"} if _wing(m) != "run" else ())
    assert not bad, bad


@pytest.mark.unit
def test_the_verl_wing_is_the_converters_alone():
    """rlcore/verl/ (scripts/from_verl.py) reads this project's keys, defaults and checks (rlcore.config
    and the two registries it names) and nothing else of rlcore; nothing in the trainer imports it."""
    allowed = {"rlcore.rollout.engine_keys", "rlcore.algo.rollout_correction"}
    bad = _offenders(lambda m, imps: {i for i in imps if i.startswith("rlcore.") and _wing(i) not in (None, "config",
                                      "verl") and i not in allowed and i not in GROUND} if _wing(m) == "verl" else ())
    assert not bad, bad
    bad = _offenders(lambda m, imps: {i for i in imps if _wing(i) == "verl"} if _wing(m) != "verl" else ())
    assert not bad, f"the converter is scripts/from_verl.py's: {bad}"


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


def _module_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {i for i in imps if i in MODULES and i != m} for m, imps in imports.items()}


def _floor_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, imps in imports.items():
        graph.setdefault(_node(m), set()).update(_node(i) for i in imps if i in MODULES and _node(i) != _node(m))
    return graph


@pytest.mark.unit
def test_no_import_circle_among_rlcores_modules():
    cycles = _cycles(_module_graph(IMPORTS))
    assert not cycles, f"import circles (imports inside functions and under TYPE_CHECKING included): {cycles}"


@pytest.mark.unit
def test_the_wings_stack_without_an_arrow_up():
    """Between wings and the design card's modules too: no two import each other, directly or around
    a circle, annotations included (engine and rollout take configs as arguments; config asks them for
    device choices; a wing's config section lives in the wing and the config package imports it)."""
    cycles = _cycles(_floor_graph(IMPORTS))
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
    """The reader itself: a function-level import counts, and so does a TYPE_CHECKING one; the circle
    finders see a two-module circle made by an annotation and a wing circle through a card module."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n"
                   "def f():\n    from veomni import x\n    from rlcore.algo import grpo\n")
    imps = _imports(str(src))
    assert "veomni" in imps and "rlcore.algo.grpo" in imps and "vllm" in imps
    planted = {**IMPORTS, "rlcore.algo.batch": IMPORTS["rlcore.algo.batch"] | {"rlcore.algo.packing"}}
    assert ["rlcore.algo.batch", "rlcore.algo.packing"] in _cycles(_module_graph(planted))
    planted = {**IMPORTS, "rlcore.engine.lora": IMPORTS["rlcore.engine.lora"] | {"rlcore.engine_veomni"}}
    assert ["engine", "engine_veomni"] in _cycles(_floor_graph(planted))


@pytest.mark.unit
def test_train_grpo_reads_in_a_few_screens():
    """The entry point stays parse, build, loop, tear down: the whole loop visible at once."""
    n = sum(1 for _ in open(os.path.join(REPO, "train_grpo.py")))
    assert n <= 170, f"train_grpo.py has {n} lines (at most 170): move a helper into the wing it belongs to"
