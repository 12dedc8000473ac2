"""Makes the shared test helpers importable one way, ``from helpers import ...`` (tests/helpers.py),
whatever pytest's import mode; child processes get the same path from ``helpers.child_env``."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)
