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


def test_readme_setup_is_two_commands_with_one_line_each_and_the_details_are_in_contributing():
  """Issue 33: the set-up section is the two commands, one comment line each, and a short note; the suite's
  details (workers, XLA flags, durations, the side venvs, hypothesis) live in docs/contributing.md, linked."""
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Set up\n", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert [line.startswith("#") for line in lines] == [True, False, True, False], lines
  prose = [line for line in re.sub(r"```bash\n.*?```", "", section, flags=re.S).splitlines() if line.strip()]
  assert len(prose) <= 6, f"the set-up section's text should stay short, has {len(prose)} lines"
  assert "(docs/contributing.md)" in section
  contributing = (ROOT / "docs" / "contributing.md").read_text()
  for topic in ("-n 2", "TEST_XLA_FLAGS", "durations.json", "setup_vllm_venv.sh", "setup_base_venv.sh"):
    assert topic in contributing, topic
  assert "JAXGRPO_HYPOTHESIS_RANDOM=1" in contributing and "tests/conftest.py" in contributing
