"""scripts/plan_table.py's runner: a row's JSON goes through a file, so a stopped runner loses no compile.

The runner starts ``--python scripts/plan.py ... --json`` per row; here ``--python`` is a real executable that
stands in for the libtpu Python (it prints a plan, or records that it ran), so no TPU compile runs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plan_table.py")
ROW = "pod_grpo__qwen3-0.6b__v5e-16__step"  # one row of the table: --only selects it alone


def _python(tmp_path, body: str) -> str:
  exe = tmp_path / "fake_python"
  exe.write_text("#!/bin/sh\n" + body + "\n")
  exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
  return str(exe)


def _run(out, python: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PLAN_TABLE_OUT=str(out))
  cmd = [sys.executable, SCRIPT, "run", "--only", ROW, "--python", python, "--timeout", "60"]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_a_finished_row_is_saved_with_its_wall_time_and_exit(tmp_path):
  out = tmp_path / "out"
  res = _run(out, _python(tmp_path, 'echo "ran $*" >&2; echo \'{"programs": [], "target": {"chips": 16}}\''))
  assert res.returncode == 0, res.stderr
  plan = json.loads((out / f"{ROW}.json").read_text())
  assert plan["target"] == {"chips": 16} and plan["exit"] == 0 and plan["wall_s"] >= 0
  assert not (out / f"{ROW}.json.part").exists()
  assert "scripts/plan.py" in (out / f"{ROW}.log").read_text()  # the child's stderr is the row's log


def test_a_stopped_runner_leaves_a_result_the_next_run_adopts_without_compiling(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  # what a runner stopped mid-compile leaves: the child finished writing into the row's .part file
  (out / f"{ROW}.json.part").write_text('{"programs": [1], "target": {"chips": 16}}')
  marker = tmp_path / "compiled"
  res = _run(out, _python(tmp_path, f"touch {marker}; echo '{{}}'"))
  assert res.returncode == 0, res.stderr
  assert json.loads((out / f"{ROW}.json").read_text())["programs"] == [1]
  assert not marker.exists(), "the row was compiled again although its result was on disk"


def test_a_cut_off_result_is_compiled_again(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / f"{ROW}.json.part").write_text('{"programs": [')  # the child was killed mid-write
  res = _run(out, _python(tmp_path, "echo '{\"programs\": [2]}'"))
  assert res.returncode == 0, res.stderr
  assert json.loads((out / f"{ROW}.json").read_text())["programs"] == [2]
