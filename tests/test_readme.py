"""The README's code runs as written, and its set-up commands are the ones CI uses."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_tour_runs(capsys):
  blocks = _python_blocks()
  assert blocks, "README has no python example"
  for code in blocks:
    exec(compile(code, "README.md", "exec"), {})
  assert "nontrivial_group_fraction" in capsys.readouterr().out


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
  readme = (ROOT / "README.md").read_text()
  setup = re.search(r"## Set up.*?```bash\n(.*?)```", readme, flags=re.S).group(1)
  commands = [line for line in setup.splitlines() if line.strip() and not line.startswith("#")]
  assert len(commands) == 2
  assert commands[1] in (ROOT / ".ci" / "run").read_text()
