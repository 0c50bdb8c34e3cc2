"""The collector at start-up (rlcore/heap.py): what freeze and settle do, and that the trainer's
entry point turns the collector off before its first heavy import and back on after the build."""

from __future__ import annotations

import ast
import gc
import os

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit


def test_freeze_moves_the_live_heap_out_of_the_walk_and_settle_turns_the_collector_on():
    from rlcore import heap

    was_enabled = gc.isenabled()
    try:
        gc.disable()
        kept = [[i] for i in range(10_000)]  # 10,001 tracked containers
        before = gc.get_freeze_count()
        heap.freeze()
        assert gc.get_freeze_count() >= before + len(kept)
        assert not gc.isenabled()  # freeze alone leaves the collector as it was
        heap.settle()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()


def test_the_trainer_disables_the_collector_before_importing_rlcore_and_settles_after_the_build():
    with open(os.path.join(REPO, "train_grpo.py")) as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    first_rlcore = next(i for i, n in enumerate(body)
                        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlcore"))
    disable = [i for i, n in enumerate(body) if isinstance(n, ast.Expr) and ast.unparse(n) == "gc.disable()"]
    assert disable and disable[0] < first_rlcore, "gc.disable() must come before the first rlcore import"
    main = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [ast.unparse(n) for n in ast.walk(main) if isinstance(n, ast.Call)]
    assert "heap.settle()" in calls, "main() must turn the collector back on after the build"
    lines = ast.unparse(main).splitlines()
    build = next(i for i, ln in enumerate(lines) if "build(cfg" in ln)
    settle = next(i for i, ln in enumerate(lines) if "heap.settle()" in ln)
    loop = next(i for i, ln in enumerate(lines) if ln.strip().startswith("loop(run)"))
    assert build < settle < loop
