"""``scripts/bench_attention.py`` runs as documented (BENCHMARKS.md): one child process per (implementation,
length), a table row each with the child's peak RSS and time, the memory slope; a child whose RSS passes the cap
is stopped and reported so (the parent's watchdog, for real: the cap is below a JAX process's own size)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers import ROOT, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
SCRIPT = os.path.join(ROOT, "scripts", "bench_attention.py")


@pytest.fixture
def _run(monkeypatch, capsys):
  """The script's ``main(argv)`` in this process (the parent: it starts, watches and reads the children as the command
  does; its own start-up, ~3 CPU-s of imports, is what running it in a child added), the children with
  ``helpers.cli_env``'s environment; returns what it printed."""
  spec = importlib.util.spec_from_file_location("bench_attention_script", SCRIPT)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  for k, v in cli_env().items():
    monkeypatch.setenv(k, v)

  def run(*args: str) -> str:
    capsys.readouterr()
    script.main(list(args))
    return capsys.readouterr().out

  return run


def test_rows_and_slope(_run):
  text = _run("--lengths", "256", "512", "--impls", "blockwise", "--repeats", "1")
  rows = [line for line in text.splitlines() if line.startswith("| 256 ") or line.startswith("| 512 ")]
  assert len(rows) == 2 and all(" MiB | " in r and r.rstrip().endswith("s |") for r in rows), text
  assert "# memory slope, blockwise: 512/256 ×" in text, text


def test_a_child_over_the_cap_is_stopped(_run):
  text = _run("--lengths", "256", "--impls", "dense", "--cap-gib", "0.05")
  assert "| 256 | dense | over the 0.05 GiB cap (stopped at" in text, text
  assert "# memory slope, dense: —" in text, text


def test_model_and_train_step_modes(_run):
  """``--mode model`` (a tiny 2-layer model's log-prob gradient) and ``--mode step`` (``make_train_step``), each
  implementation through the model's own ``attention`` choice."""
  text = _run("--mode", "model", "--lengths", "256", "--impls", "dense", "blockwise", "--repeats", "1")
  assert "model: D=64, 4 heads of 16" in text, text
  assert all(f"| 256 | {impl} | " in text for impl in ("dense", "blockwise")), text
  text = _run("--mode", "step", "--lengths", "256", "--impls", "blockwise", "--repeats", "1")
  assert "| tokens | attention | peak RSS over baseline | time of one train step |" in text, text
  assert "| 256 | blockwise | " in text and " MiB | " in text, text
