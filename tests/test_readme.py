"""Every Python block of README.md and docs/*.md runs as pasted, and the README's set-up commands are the ones CI
uses.

Each document's Python blocks run in one child process (8 virtual CPU devices, a fresh temporary working
directory), one after another, each in a namespace of its own: a block runs as a user pastes it, defining what it
needs itself, and the import of JAX and the compiled programs are shared by the blocks of one document.
"""

import configparser
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from helpers import RUN_XLA_FLAGS, child_env, cli_env, finish_child

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]

#: a fenced block, at any indentation: (indent, language, body)
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", flags=re.S | re.M)

#: the child: runs every ```python block of the document argv[1] (under the repository argv[2]), each in a fresh
#: namespace, and names the document and the block's first line when one fails
RUN_BLOCKS = r"""
import re, sys, textwrap, time
doc, root = sys.argv[1], sys.argv[2]
text = open(f"{root}/{doc}").read()
for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M):
  line = text[: m.start()].count("\n") + 2
  code = textwrap.dedent(m.group(2))
  t0 = time.perf_counter()
  print(f"--- {doc}:{line}", flush=True)
  exec(compile(code, f"{doc}:{line}", "exec"), {"__name__": "__main__"})
  print(f"--- {doc}:{line} ran in {time.perf_counter() - t0:.1f} s", flush=True)
"""


def _demo_export(cwd: pathlib.Path) -> None:
  """What docs/checkpoints.md's transformers check reads: the demo run's export, ``runs/demo/hf``, made the
  documented way (scripts/train.py with demo.yaml, then scripts/export_hf.py) but short: 400 warm-up steps (the
  completion format is learned; 800 in the demo) and one RL step, under XLA's default flags as a user runs it
  (``helpers.RUN_XLA_FLAGS``: the warm-up's 400 steps execute ~3x faster than under the suite's fast-compile flags;
  the train run alone, cold cache, AMD EPYC without AMX at load 18: 41.9 instead of 49.1 CPU-s)."""
  short = ["--data.arithmetic.sft_steps", "400", "--run.steps", "1", "--eval.every", "0"]
  for cmd in (
    ["train.py", "--config", str(ROOT / "scripts/configs/demo.yaml"), "--run.out", "runs/demo", *short, "--no-plot"],
    ["export_hf.py", "runs/demo", "runs/demo/hf"],
  ):
    cmd = [sys.executable, str(ROOT / "scripts" / cmd[0]), *cmd[1:]]
    out = subprocess.run(
      cmd, cwd=cwd, env=cli_env(xla_flags=RUN_XLA_FLAGS), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def _jaxgrpo_greedy(run: str, problem: str) -> str:
  """The greedy (temperature 0) completion jaxgrpo's own sampler gives ``problem`` from the checkpoint of ``run``,
  the prompt rendered by the trainer's path (``encode_prompts``: the instruction, the chat template)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxgrpo.data import MathExample, encode_prompts
  from jaxgrpo.rollout.sampling import SamplingConfig, generate
  from jaxgrpo.run.builders import load_policy

  model, tok, cfg = load_policy(run)
  ids = jnp.asarray(encode_prompts(tok, [MathExample(problem, "")], max_prompt_tokens=64).tokens, jnp.int32)
  sampling = SamplingConfig(num_samples=1, max_new_tokens=20, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
  r = generate(model, ids, jnp.ones_like(ids, bool), sampling, key=jax.random.key(0), temperature=0.0)
  return tok.decode(np.asarray(r.completions[0])[np.asarray(r.mask[0])], skip_special_tokens=True)


#: a document's set-up: what its bash blocks make before its Python blocks read it
SETUP = {"docs/checkpoints.md": _demo_export}


def block_output(out: str, doc: str, needle: str) -> str:
  """What the block of ``doc`` that contains ``needle`` printed (the runner's markers delimit it)."""
  text = (ROOT / doc).read_text()
  line = next(text[: m.start()].count("\n") + 2 for m in FENCE.finditer(text) if needle in m.group(3))
  return out.split(f"--- {doc}:{line}\n", 1)[1].split(f"--- {doc}:{line} ran in", 1)[0]


def python_blocks(doc: str) -> list[str]:
  return [body for _, lang, body in FENCE.findall((ROOT / doc).read_text()) if lang == "python"]


def test_every_doc_with_code_is_checked():
  """The list of documents covers README.md and every docs/*.md (a new document is picked up by the glob)."""
  assert "README.md" in DOCS and "docs/checkpoints.md" in DOCS
  assert sum(len(python_blocks(d)) for d in DOCS) >= 20


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)])
def test_doc_python_blocks_run_as_pasted(doc, tmp_path):
  if doc in SETUP:
    SETUP[doc](tmp_path)
  proc = subprocess.Popen(
    [sys.executable, "-c", RUN_BLOCKS, doc, str(ROOT)],
    env=child_env(8),
    cwd=tmp_path,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  out = finish_child(proc, timeout=600)
  assert out.count(" ran in ") == len(python_blocks(doc)), out
  if doc == "README.md":
    assert "nontrivial_group_fraction" in out
  if doc == "docs/checkpoints.md":
    # issue 46, item 1: transformers on the export, with the prompt as the doc renders it, completes the problem as
    # jaxgrpo's sampler does on the checkpoint with the trainer's rendering (before: a bare "3+4=" and noise)
    printed = block_output(out, doc, "apply_chat_template").strip()
    assert printed == _jaxgrpo_greedy(str(tmp_path / "runs" / "demo"), "What is 12 + 5?"), printed
    assert re.fullmatch(r"12\+5=\d+\. \\boxed\{\d+\}", printed), printed


def command_lines(doc: str) -> list[str]:
  """The commands of the ```bash blocks (and of the untagged blocks that run a script) of ``doc``, one per
  command: continuation lines joined."""
  lines = []
  for _, lang, body in FENCE.findall((ROOT / doc).read_text()):
    if lang == "bash" or (lang == "" and "scripts/" in body):
      lines += [ln for ln in body.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
  return lines


def script_calls(line: str) -> list[tuple[str, list[str]]]:
  """``[(script path, its arguments)]`` of one shell line: every ``scripts/*.py`` or ``scripts/*.sh`` it runs,
  including inside a quoted ``--command "..."``; ``$i`` reads as 0."""
  calls, words = [], shlex.split(line.replace("$i", "0"), comments=True)
  for i, word in enumerate(words):
    if " " in word and "scripts/" in word:
      calls += script_calls(word)
    elif re.fullmatch(r"scripts/\S+\.(py|sh)", word):
      args = []
      for w in words[i + 1 :]:
        if w in ("&&", "||", ";", "|"):
          break
        args.append(w)
      calls.append((word, args))
  return calls


def _help_options(scripts: list[str]) -> dict[str, set[str]]:
  """``{script: the options its --help lists}``, the scripts run side by side."""
  procs = {
    s: subprocess.Popen([sys.executable, s, "--help"], cwd=ROOT, env=child_env(1), stdout=subprocess.PIPE, text=True)
    for s in scripts
  }
  return {s: set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", finish_child(p, timeout=300))) for s, p in procs.items()}


#: scripts/train.py's flags that its launcher reads before jax is imported (its parse_args refuses them in a
#: process that imported jax): checked against its --help instead
LAUNCHER_FLAGS = ("--processes", "--cpu-devices")


@pytest.mark.subprocess
def test_documented_commands_name_existing_scripts_flags_and_extras():
  """Every ``python scripts/X.py ...`` of a bash block of README.md and docs/*.md names a script (and a
  ``--config scripts/...`` file) that exists, every flag it passes is one the script's ``--help`` lists (``scripts/train.py``: its own ``parse_args``, which
  checks the dotted config keys against the config), and every ``pip install -e '.[extra]'`` names extras that
  setup.cfg declares."""
  cfg = configparser.ConfigParser(interpolation=None)
  cfg.read(ROOT / "setup.cfg")
  extras = set(cfg["options.extras_require"])
  calls, problems = [], []
  for doc in DOCS:
    for line in command_lines(doc):
      for names in re.findall(r"pip install[^\n]*?-e '?\.\[([\w,]+)\]", line):
        problems += [f"{doc}: `{line}`: no extra [{n}] in setup.cfg" for n in names.split(",") if n not in extras]
      calls += [(doc, line, script, args) for script, args in script_calls(line)]
  assert {c[2] for c in calls} >= {"scripts/train.py", "scripts/eval.py", "scripts/export_hf.py"}
  for doc, line, script, args in calls:
    files = [script] + [b for a, b in zip(args, args[1:]) if a == "--config" and b.startswith("scripts/")]
    problems += [f"{doc}: `{line}`: {f} does not exist" for f in files if not (ROOT / f).is_file()]
  options = _help_options(sorted({c[2] for c in calls if c[2].endswith(".py")}))
  spec = importlib.util.spec_from_file_location("train_cli_for_docs", ROOT / "scripts" / "train.py")
  train_cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train_cli)
  for doc, line, script, args in calls:
    if script not in options:
      continue
    if script == "scripts/train.py":
      launcher = [i for i, a in enumerate(args) if a in LAUNCHER_FLAGS]
      problems += [
        f"{doc}: `{line}`: {script} has no option {args[i]}" for i in launcher if args[i] not in options[script]
      ]
      args = [a for i, a in enumerate(args) if i not in launcher and i - 1 not in launcher]
      try:
        train_cli.parse_args(args)
      except SystemExit:
        problems.append(f"{doc}: `{line}`: scripts/train.py refuses these arguments (its error is printed above)")
      continue
    if script == "scripts/plan.py":  # its dotted keys override the config as scripts/train.py's do
      dotted = [i for i, a in enumerate(args) if re.match(r"--\w+\.\w", a)]
      config = [x for a, b in zip(args, args[1:]) if a == "--config" for x in (a, b)]
      try:
        train_cli.parse_args(config + [x for i in dotted for x in args[i : i + 2]])
      except SystemExit:
        problems.append(f"{doc}: `{line}`: scripts/train.py's config refuses its dotted keys (error printed above)")
      args = [a for i, a in enumerate(args) if i not in dotted and i - 1 not in dotted]
    flags = [a.split("=")[0] for a in args if re.match(r"--?[A-Za-z]", a)]
    problems += [f"{doc}: `{line}`: {script} has no option {f}" for f in flags if f not in options[script]]
  assert not problems, "\n".join(problems)


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


def test_the_peft_export_has_a_documented_install():
  """Issue 46, item 7: loading a LoRA export's PEFT directory needs ``peft``, which no documented install gave: the
  ``peft`` extra declares it and docs/checkpoints.md installs it (test_documented_commands_... checks the extra
  names of every ``pip install -e`` line)."""
  cfg = configparser.ConfigParser(interpolation=None)
  cfg.read(ROOT / "setup.cfg")
  assert re.search(r"^peft\b", cfg["options.extras_require"]["peft"].strip(), flags=re.M)
  assert any("pip install -e '.[peft]'" in line for line in command_lines("docs/checkpoints.md"))


#: a measured figure: a duration (s, ms, min) or a speed (tok/s, GFLOP/s) in a paragraph that says it was measured
#: (measured, took, wall, of CPU, CPU time)
FIGURE = re.compile(r"\d(\.\d+)? ?(s|ms|min|tok/s|GFLOP/s)\b|\b0\.\d{3}\b")
MEASURED = re.compile(r"\b([Mm]easured|took|wall|of CPU|CPU time|CPU user)\b")
#: a machine named: the CPU kind with its AMX status (the demo rows' way), or the accelerator
MACHINE = re.compile(r"AMX|H100|H200|H20\b|TPU v\d|GPU")


def unnamed_measurements(doc: str) -> list[str]:
  """The paragraphs of ``doc`` (code blocks left out; a table counts with the two paragraphs before it, its
  introduction) that quote a measured figure without naming the machine it was measured on."""
  text = re.sub(r"^( *)```.*?^\1```", "", (ROOT / doc).read_text(), flags=re.S | re.M)
  paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
  bad = []
  for i, p in enumerate(paras):
    context = "\n".join(paras[max(0, i - 2) : i + 1]) if p.lstrip().startswith("|") else p
    if FIGURE.search(p) and MEASURED.search(context) and not MACHINE.search(context):
      bad.append(f"{doc}: {p.strip()[:160]!r}")
  return bad


def test_documented_figures_name_their_machine():
  """Issue 46, item 8: a figure quoted from one CPU kind reads as a promise on another (the reward model's pair
  accuracy 0.812 was an Intel Xeon's with AMX; an AMD EPYC without AMX gets 0.773): every paragraph (or table) of
  README.md and docs/*.md that quotes a measurement names the machine."""
  bad = [b for doc in DOCS for b in unnamed_measurements(doc)]
  assert not bad, "\n".join(bad)
