"""notebooks/binary_tree.ipynb executes end to end at a small configuration (so it cannot rot)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = """SEEDS = 2
STEPS = 60
GROUP_SIZE = 8
POLICY = "tabular"
ALGORITHMS = "grpo,lambda_grpo"
CELLS = "1:-1.0,2:-0.5"
OUT = "nb_out"
"""


@pytest.mark.slow
def test_notebook_runs(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(ROOT / "notebooks" / "binary_tree.ipynb", as_version=4)
  params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(params) == 1, "the notebook needs exactly one cell tagged 'parameters'"
  params[0].source = SMALL
  # the kernel must import this checkout even when it is not pip-installed
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  ).execute()
  results = json.loads((tmp_path / "nb_out" / "results.json").read_text())
  assert {c["algorithm"] for c in results["cells"]} == {"grpo", "lambda_grpo"}
  assert (tmp_path / "nb_out" / "curves.png").stat().st_size > 1000
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"
  ]
  assert not errors
