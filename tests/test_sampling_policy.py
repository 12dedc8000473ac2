"""The samplers' one static argument (``SamplingPolicy``), the one length rule (``_checks.check_positions``), the
public abstract lowering of the sampler (``lower_generate``), and the samplers sitting below the train step."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROLLOUT = ROOT / "jaxgrpo" / "rollout"


def _jaxgrpo_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line, module)`` of every ``jaxgrpo...`` import in ``path`` (read with ``ast``, nothing imported)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxgrpo"):
      out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    elif isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names if a.name.startswith("jaxgrpo")]
  return out


def test_the_samplers_engines_and_environments_import_nothing_of_the_step():
  """The samplers sit below the train step (issue 49 item 3): the temperature they record and check lives in
  ``jaxgrpo.models.log_probs``; only the environments' training loop (``environments/training.py``) reads a
  ``Batch``."""
  files = [ROLLOUT / n for n in ("sampling.py", "refill.py", "conversation.py")]
  files += sorted((ROLLOUT / "engines").glob("*.py")) + sorted((ROLLOUT / "environments").glob("*.py"))
  files = [f for f in files if f.name != "training.py"]
  assert len(files) > 10
  up = [
    f"{f.relative_to(ROOT)}:{line}: {name}"
    for f in files
    for line, name in _jaxgrpo_imports(f)
    if name == "jaxgrpo.step" or name.startswith("jaxgrpo.step.")
  ]
  assert not up, up
