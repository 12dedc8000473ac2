#!/usr/bin/env python
"""λ-GRPO's binary-tree task (Table 1): ``python scripts/binary_tree.py --help``.

The implementation is ``jaxgrpo.tasks.binary_tree`` (task, policies, jitted loop) and
``jaxgrpo.tasks.binary_tree_cli`` (flags, results.json, table.md, curves.png).
"""

import sys
from pathlib import Path

try:
  import jaxgrpo  # noqa: F401
except ImportError:  # a source checkout that was not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxgrpo.tasks.binary_tree_cli import main

if __name__ == "__main__":
  main()
