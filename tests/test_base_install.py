"""The documented demo commands in an environment with the README's base install only (issue 33).

The test environment (``pip install -e '.[test]'``) has torch, which pulls in jinja2 and more, so a package that
a documented command needs but setup.cfg does not declare works in every other test and fails for a user who ran
set-up command 1 (``pip install -e '.[plot]'``): ``scripts/train.py`` stopped with "apply_chat_template requires
jinja2 to be installed". Here ``scripts/setup_base_venv.sh`` builds ``.venv-base/`` (git-ignored) with that
command's install alone (versions held to the test environment's, no torch), and every documented offline command
runs there in a short form: the arithmetic demo (``scripts/train.py`` with ``demo.yaml``), the evaluation and the export of its checkpoint, the multi-turn calculator demo, and the binary-tree job with its
plot. The static half — every third-party import of the source is declared — is
``tests/test_layers.py::test_every_third_party_import_is_declared_in_setup_cfg``.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from helpers import ROOT, cli_env, ensure_side_venv

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

# the demo config's smallest run: 2 warm-up steps, one RL step, a checkpoint at the end, no periodic evaluation
TINY_DEMO = {
  "run.steps": "1",
  "data.arithmetic.sft_steps": "2",
  "data.arithmetic.train_size": "64",
  "data.arithmetic.eval_size": "4",
  "model.synthetic.hidden_size": "32",
  "rollout.prompts_per_step": "2",
  "rollout.group_size": "2",
  "rollout.max_new_tokens": "4",
  "eval.every": "0",
  "eval.samples": "2",
  "eval.pass_k": "[1, 2]",
  "reward.timeout_s": "null",
}


@pytest.fixture(scope="module")
def base_python():
  """``.venv-base/bin/python``, the venv checked to hold neither torch nor a package of the test extra only."""
  python = ensure_side_venv("base")
  probe = "import importlib.util as u; print([m for m in ('torch', 'pytest', 'hypothesis') if u.find_spec(m)])"
  found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
  assert found == "[]", f".venv-base must hold the base install only, found {found}"
  return python


def run(python, script: str, *args: str, cache) -> str:
  """``python scripts/SCRIPT ARGS`` from the repository root, as a user runs it (the tests' compile flags and XLA
  cache); its stdout, or a failure naming the command and showing its output's end."""
  cmd = [python, os.path.join("scripts", script), *args]
  # the venv's modules are not compiled to bytecode at install (uv's default): the first run writes what it imports
  # for the next ones, even where PYTHONDONTWRITEBYTECODE is set (tests/conftest.py drops it for the session; 2.5 s
  # less per start here: 2.8 s to `train.py --help` instead of 5.5 s)
  env = cli_env(cache)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, (
    f"`{' '.join(cmd[1:])}` failed in .venv-base (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
  )
  return r.stdout


def tiny(config: str, out, **extra: str) -> list[str]:
  over = {**TINY_DEMO, **extra}
  return [
    "--config",
    f"scripts/configs/{config}",
    *(a for k, v in over.items() for a in (f"--{k}", v)),
    "--run.out",
    str(out),
    "--no-plot",
    "--no-progress",
  ]


def test_the_arithmetic_demo_its_evaluation_and_export(base_python, tmp_path):
  """README, "The offline CPU demo": train (warm-up through the chat template, RL, a checkpoint), then
  ``scripts/eval.py --checkpoint`` on the arithmetic task and ``scripts/export_hf.py`` of the same run."""
  out = tmp_path / "demo"
  run(base_python, "train.py", *tiny("demo.yaml", out), cache=tmp_path / "xla")
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert any(r.get("step") == 1 and "loss" in r for r in records), records
  assert any((out / "checkpoints").iterdir()), "the run wrote no checkpoint"
  res = run(
    base_python,
    "eval.py",
    *("--checkpoint", str(out), "--arithmetic", "--limit", "2", "-k", "2", "--max-new-tokens", "4", "--json"),
    cache=tmp_path / "xla",
  )
  metrics = json.loads(res)
  assert metrics["problems"] == 2 and 0.0 <= metrics["eval_accuracy"] <= 1.0, metrics
  run(base_python, "export_hf.py", str(out), str(tmp_path / "hf"), cache=tmp_path / "xla")
  assert (tmp_path / "hf" / "config.json").exists() and list((tmp_path / "hf").glob("*.safetensors"))


def test_the_multiturn_demo(base_python, tmp_path):
  """README, "Multi-turn with a tool": the calculator demo's config made tiny (2 warm-up steps, one RL step)."""
  with open(os.path.join(ROOT, "scripts", "configs", "multiturn", "calculator.yaml")) as f:
    cfg = yaml.safe_load(f)
  cfg["model"] = {"hidden_size": 32, "num_layers": 1}
  cfg["task"].update(train_size=16, eval_size=2, sft_steps=2, sft_batch_size=4)
  cfg["rollout"] = {"group_size": 2, "prompts_per_step": 2}
  cfg["run"].update(eval_samples=1, out=str(tmp_path / "calculator"))
  config = tmp_path / "calculator.yaml"
  config.write_text(yaml.safe_dump(cfg))
  res = run(base_python, "multiturn_demo.py", "--config", str(config), "--steps", "1", cache=tmp_path / "xla")
  assert "RESULT " in res, res[-2000:]


def test_the_binary_tree_job(base_python, tmp_path):
  """README set-up command 1's job, tiny (2 algorithms, one cell, 2 seeds, 3 steps), with its table and plot
  (matplotlib from the ``plot`` extra)."""
  out = tmp_path / "bt"
  args = ("--algorithms", "grpo,lambda_grpo", "--cells", "1:-1.0", "--seeds", "2", "--steps", "3", "--window", "2")
  run(base_python, "binary_tree.py", *args, "--quiet", "--out", str(out), cache=tmp_path / "xla")
  assert (out / "results.json").exists() and (out / "table.md").exists() and (out / "curves.png").stat().st_size > 0
