"""Everything a user or contributor needs is inside the repository: the README and docs/ link only
to files that exist here, and nothing points outside it (e.g. to ../shared/)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


@pytest.mark.parametrize("path", DOCS, ids=[os.path.relpath(p, REPO) for p in DOCS])
def test_docs_stay_inside_the_repository(path):
    text = open(path).read()
    assert "../shared" not in text and "PLATFORM_NOTES" not in text
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):  # markdown links
        if "://" in target:
            continue
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        assert resolved.startswith(REPO + os.sep) and os.path.exists(resolved), target
    for name in re.findall(r"`((?:docs|scripts|configs|rlcore)/[\w./-]+\.\w+)`", text):  # file names in code spans
        assert os.path.exists(os.path.join(REPO, name)), name


def test_readme_names_the_platform_doc():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "docs/platform.md" in readme and os.path.exists(os.path.join(REPO, "docs", "platform.md"))


def _reachable_text() -> str:
    """The README and every markdown file it links to, and theirs, transitively."""
    seen, todo, texts = set(), [os.path.join(REPO, "README.md")], []
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen or not path.endswith(".md") or not os.path.exists(path):
            continue
        seen.add(path)
        texts.append(open(path).read())
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", texts[-1]):
            if "://" not in target:
                todo.append(os.path.join(os.path.dirname(path), target))
    return "\n".join(texts)


def test_what_the_readme_held_is_still_reachable_from_it():
    """The README became a front door; every path and figure it held moved into a doc it links to
    (tests/fixtures/readme_moved.txt lists them), so nothing a user read there is lost."""
    text = _reachable_text()
    lines = [ln.split(" ", 1) for ln in open(os.path.join(REPO, "tests", "fixtures", "readme_moved.txt"))
             if ln.strip() and not ln.startswith("#")]
    assert len(lines) > 150
    lost = [f"{kind} {token.strip()}" for kind, token in lines if token.strip() not in text]
    assert not lost, f"no longer reachable from README.md: {lost}"


def test_readme_is_a_front_door():
    """At most about 250 lines: what the project is, one step's flow, the two commands, running a job,
    the capabilities (each with its doc), the layout with the design card's modules, the exit codes."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert len(readme.splitlines()) <= 250
    for heading in ("## One step on one rank", "## The two commands", "## Running your own job",
                    "## What it does", "## Layout", "## Exit codes"):
        assert heading in readme, heading
    for module in ("rlcore/engine_veomni.py", "rlcore/colocate_rollout.py", "rlcore/advantage.py"):
        assert f"`{module}`" in readme, module
    table = readme.split("## What it does")[1].split("## Layout")[0]
    docs_linked = set(re.findall(r"\]\((docs/[\w.]+\.md)\)", table))
    every_capability_doc = {f"docs/{n}" for n in ("algorithms.md", "weight_sync.md", "tools.md", "judges.md",
                            "distillation.md", "partial_rollouts.md", "sequence_parallel.md", "moe.md",
                            "vision_language.md", "lora.md", "checkpoints.md", "memory_plan.md", "learning.md",
                            "real_data.md")}
    assert every_capability_doc <= docs_linked, every_capability_doc - docs_linked
