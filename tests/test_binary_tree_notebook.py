"""notebooks/binary_tree.ipynb executes end to end at a small configuration (so it cannot rot)."""

from __future__ import annotations

import json
import os
import re
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


# A stand-in for pip (found first on PYTHONPATH by the cell's `python -m pip`): it records its arguments and, for
# a non-editable install, writes a `jaxgrpo` package into its own folder as an install would; nothing is installed.
FAKE_PIP = """import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\\n")
if "-e" not in sys.argv:
  pkg = os.path.join(os.environ["FAKE_PIP_SITE"], "jaxgrpo")
  os.makedirs(pkg)
  with open(os.path.join(pkg, "__init__.py"), "w") as f:
    f.write("__version__ = 'from-the-repository'\\n")
"""


def _install_cell() -> str:
  nb = json.loads((ROOT / "notebooks" / "binary_tree.ipynb").read_text())
  cells = [c for c in nb["cells"] if c["cell_type"] == "code" and '"pip"' in "".join(c["source"])]
  assert len(cells) == 1, "the notebook needs exactly one install cell (the one running pip)"
  return "".join(cells[0]["source"])


def _run_install_cell(tmp_path, folder: Path) -> tuple[list[list[str]], str]:
  """The install cell run as is in a fresh python (``-S``: this environment's jaxgrpo is not importable) whose
  working directory is ``folder``, with the stand-in pip; pip's argument lists and the cell's output."""
  import subprocess
  import sys

  site = tmp_path / "fake_site"
  (site / "pip").mkdir(parents=True)
  (site / "pip" / "__init__.py").write_text("")
  (site / "pip" / "__main__.py").write_text(FAKE_PIP)
  log = tmp_path / "pip.log"
  env = {**os.environ, "PYTHONPATH": str(site), "FAKE_PIP_LOG": str(log), "FAKE_PIP_SITE": str(site)}
  r = subprocess.run(
    [sys.executable, "-S", "-c", _install_cell()], cwd=folder, env=env, capture_output=True, text=True, timeout=60
  )
  assert r.returncode == 0, r.stderr[-3000:]
  calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  return calls, r.stdout


def test_install_cell_installs_the_checkout_it_runs_in(tmp_path):
  """Inside a checkout (``notebooks/`` next to a jaxgrpo ``setup.cfg``) the cell installs that checkout, editable,
  and imports it — not the public repository (issue 33: the cell used to install a URL named nowhere else)."""
  root = tmp_path / "checkout"
  (root / "notebooks").mkdir(parents=True)
  (root / "jaxgrpo").mkdir()
  (root / "jaxgrpo" / "__init__.py").write_text("__version__ = 'from-the-checkout'\n")
  (root / "setup.cfg").write_text("[metadata]\nname = jaxgrpo\n")
  calls, out = _run_install_cell(tmp_path, root / "notebooks")
  assert calls == [["install", "-q", "-e", f"{root}[plot]"]], calls
  assert f"jaxgrpo from-the-checkout from {root / 'jaxgrpo'}" in out, out


def test_install_cell_installs_the_public_repository_elsewhere(tmp_path):
  """Outside a checkout (Colab; also a folder whose parent has another project's setup.cfg) the cell installs the
  public repository, the one the README's set-up names."""
  other = tmp_path / "other"
  (other / "nb").mkdir(parents=True)
  (other / "jaxgrpo").mkdir()
  (other / "setup.cfg").write_text("[metadata]\nname = something-else\n")
  calls, out = _run_install_cell(tmp_path, other / "nb")
  assert len(calls) == 1 and calls[0][:2] == ["install", "-q"], calls
  url = re.fullmatch(r"jaxgrpo\[plot\] @ git\+(https://\S+)\.git", calls[0][-1]).group(1)
  assert len(calls[0]) == 3, calls
  assert "jaxgrpo from-the-repository" in out, out
  setup = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
  assert url in setup, f"README's set-up must name the repository the notebook installs ({url})"
