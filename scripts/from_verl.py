#!/usr/bin/env python
"""Turn a verl launch script (or its override list) into this project's YAML config: the entry
point of rlcore/verl/ (docs/from_verl.md). ``python scripts/from_verl.py --help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore.verl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
