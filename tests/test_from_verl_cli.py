"""scripts/from_verl.py as a user runs it (a child interpreter each): --help, and every unreadable or
wrong script of tests/test_from_verl.py's UNREADABLE exits 2 with its message and no traceback. The
same cases run in process in the unit set (tests/test_from_verl.py); here the entry point itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from test_verl_shell import UNREADABLE

FROM_VERL = os.path.join(REPO, "scripts", "from_verl.py")


def test_help_explains_it():
    p = subprocess.run([sys.executable, FROM_VERL, "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--allow-unmapped" in p.stdout and "examples:" in p.stdout and "docs/from_verl.md" in p.stdout


@pytest.mark.parametrize("body, expected", UNREADABLE)
def test_bad_scripts_exit_2_without_a_traceback(body, expected, tmp_path):
    path = tmp_path / "run.sh"
    path.write_text("#!/bin/bash\n" + body)
    p = subprocess.run([sys.executable, FROM_VERL, str(path)], capture_output=True, text=True,
                       env={**os.environ, "M": ""})
    assert p.returncode == 2 and expected in p.stderr and "Traceback" not in p.stderr, p.stderr
