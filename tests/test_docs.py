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
