"""``scripts/plan.py``'s ``main`` for several argument lists in one process: tests/test_plan.py's CPU plans, one
Python start-up and one import of the library for all of them instead of a child each (~2.5 CPU-s a child before it
compiles anything).

    python tests/plan_here.py RUNS.json OUT.json [REPORT ...]

``RUNS.json``: ``{name: argv}``; ``OUT.json``: ``{name: {"returncode", "stdout", "stderr"}}``, what a process of
its own would have exited with and printed (an exception out of ``main`` is a traceback on stderr and status 1).
Each ``REPORT`` named (``fix``: tests/tpu_aot_checks.py's, in ``.venv-tpu``) is computed in the same process after
the runs, under ``OUT[REPORT]`` (``{"failed": traceback}`` if it raised). Run it with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` for the largest ``cpu-N`` of the runs (a ``cpu-N`` plan takes
the first N host devices; ``scripts/plan.py`` run alone sets the flag itself).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import plan as plan_script  # noqa: E402 - scripts/plan.py


def run(argv: list[str]) -> dict:
  """``plan_script.main(argv)`` with its stdout and stderr captured: its exit status and both texts."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = plan_script.main(argv)
    except SystemExit as e:  # argparse and sys.exit: the status a process would have had
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      if not isinstance(e.code, int | None):
        print(e.code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - a crash of one run is that run's failure, the others still run
      traceback.print_exc()
      code = 1
  return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
  runs = json.loads(open(sys.argv[1]).read())
  results = {name: run(argv) for name, argv in runs.items()}
  if sys.argv[3:]:
    import tpu_aot_checks  # this script's folder

    results.update(tpu_aot_checks.reports(sys.argv[3:]))
  with open(sys.argv[2], "w") as f:
    json.dump(results, f)
