"""Issue 33, item 5: what the scripts print — step bars whose ETA excludes compilation, every flag with
one help text (no default said twice), transformers' torch banner silenced, a config error before the
resolved-config dump."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import train_main_here

from jaxgrpo.tasks import binary_tree_cli, script_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eta_seconds(bar) -> float:
  """The bar's printed ETA (``<MM:SS``) in seconds."""
  text = bar.format_meter(**bar.format_dict)
  m = re.search(r"<(\d+):(\d+)", text)
  assert m, text
  return 60 * int(m.group(1)) + int(m.group(2))


def test_eta_excludes_the_compile():
  compile_s, step_s, total = 1.0, 0.02, 100
  for restart in (False, True):
    bar = script_io.step_bar(total, "t", disable=False)
    bar.fp = io.StringIO()  # not on the test's stderr
    assert "compiling" in bar.format_meter(**bar.format_dict)
    time.sleep(compile_s)  # what the first call of a jitted step costs
    if restart:
      script_io.start_clock(bar)
    time.sleep(step_s)
    bar.update(1)
    eta = _eta_seconds(bar)
    bar.close()
    if restart:  # (total - 1) steps at the measured step time, not at compile + step
      assert eta <= 0.5 + (total - 1) * step_s * 3, eta
    else:  # the bar alone: the compile counted as a step (the binary-tree bar's first `57:42`)
      assert eta >= (total - 1) * compile_s * 0.9, eta


def test_start_clock_keeps_the_count_of_a_first_compiling_step():
  bar = script_io.step_bar(10, "t")
  bar.fp = io.StringIO()
  bar.update(1)  # the compiling step, counted
  script_io.start_clock(bar)
  assert bar.n == 1 and bar.format_dict["elapsed"] < 0.5
  bar.close()


def _load_script(name):
  spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _help_of(name) -> str:
  if name == "binary_tree":
    return binary_tree_cli.build_parser().format_help()
  mod = _load_script(name)
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
    (mod.parse_args if name == "train" else mod.main)(["--help"])
  return out.getvalue()


def _options(help_text: str) -> dict[str, str]:
  """``{first flag: its help text}`` from argparse's ``--help`` output (the options section)."""
  entries: dict[str, str] = {}
  flag = None
  for line in help_text.split("options:", 1)[1].splitlines():
    m = re.match(r"^  (-[^\s,]+)(?:, -[^\s,]+)*(?: (?:[A-Z_\[\],.]+|\{[^}]*\}))*(?:\s{2,}(.*))?$", line)
    if m:
      flag = m.group(1)
      entries[flag] = m.group(2) or ""
    elif flag and line.startswith(" " * 6):
      entries[flag] += " " + line.strip()
    elif not line.strip():
      flag = None
  return entries


@pytest.mark.parametrize("name", ["multiturn_demo", "binary_tree", "export_hf", "eval", "train", "train_reward_model"])
def test_every_flag_has_one_help_text(name):
  options = _options(_help_of(name))
  assert "-h" in options and len(options) > 2, options
  missing = [f for f, h in options.items() if not h.strip()]
  assert not missing, f"{name}: flags without a help text: {missing}"
  doubled = {f: h for f, h in options.items() if len(re.findall(r"\bdefault\b", h, re.I)) > 1}
  assert not doubled, f"{name}: a default said twice: {doubled}"


def test_the_torch_banner_is_silenced():
  code = (
    "import sys; sys.modules['torch'] = None\n"  # torch absent
    "{pre}import transformers\n"
    "assert not transformers.utils.is_torch_available()\n"
  )
  env = dict(os.environ, PYTHONPATH=ROOT)
  silenced = "from jaxgrpo.tasks import script_io; script_io.hide_torch_banner()\n"
  for pre, shown in (("", True), (silenced, False)):
    r = subprocess.run(
      [sys.executable, "-c", code.format(pre=pre)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("PyTorch was not found" in r.stderr) == shown, r.stderr[-2000:]
  # every script installs it before its first import of jaxgrpo beyond script_io (which imports transformers)
  for name in ("train", "eval", "export_hf", "multiturn_demo", "train_reward_model"):
    src = open(os.path.join(ROOT, "scripts", f"{name}.py")).read()
    first = min(m.start() for m in re.finditer(r"^from jaxgrpo(?!\.tasks import script_io)", src, re.M))
    assert 0 <= src.find("script_io.hide_torch_banner()") < first, name


def _refused_before_the_config_dump(argv, capfd) -> str:
  """``scripts/train.py``'s main on ``argv`` exits 2 before it prints the resolved config; returns its stderr."""
  with pytest.raises(BaseException) as e:
    train_main_here(argv)
  assert getattr(e.value, "code", None) == 2, e.value
  r = capfd.readouterr()
  assert "resolved config" not in r.out, r.out[:500]
  return r.err


def test_a_missing_dataset_is_reported_before_the_config_dump(tmp_path, capfd):
  missing = str(tmp_path / "nope" / "train.jsonl")
  argv = [
    "--config",
    os.path.join(ROOT, "scripts", "configs", "lambda_grpo_openrs.yaml"),
    "--data.dataset",
    missing,
    "--run.out",
    str(tmp_path / "run"),
  ]
  err = _refused_before_the_config_dump(argv, capfd)
  assert f"`data.dataset`: no such file or directory: {missing}" in err, err[-2000:]


def test_a_relative_reward_model_path_that_does_not_exist_is_a_missing_local_path(tmp_path, monkeypatch, capfd):
  """``runs/arith_rm`` where ``runs`` is a local directory names a local path (``jaxgrpo._checks.names_local_path``):
  missing, it is one line before anything is built (before: taken for a hub id, a network error after the
  warm-up); ``load_reward_model`` says the same without asking the hub. ``owner/name`` without a local ``owner``
  stays a hub id."""
  from jaxgrpo import _checks
  from jaxgrpo.rewards.reward_model import load_reward_model

  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()
  assert _checks.names_local_path("runs/arith_rm") and _checks.names_local_path("./arith_rm")
  assert _checks.names_local_path("../x/y") and _checks.names_local_path("~/m") and _checks.names_local_path("/m")
  assert not _checks.names_local_path("Qwen/Qwen3-0.6B") and not _checks.names_local_path("gpt2")
  with pytest.raises(ValueError, match=r"'runs/arith_rm' is not a local directory"):
    load_reward_model("runs/arith_rm")
  argv = [
    "--config",
    os.path.join(ROOT, "scripts", "configs", "demo_rm.yaml"),
    "--reward.sources",
    "[{name: rm, kind: reward_model, path: runs/arith_rm, weight: 1.0}]",
    "--run.out",
    str(tmp_path / "run"),
  ]
  err = _refused_before_the_config_dump(argv, capfd)
  assert "`reward.sources['rm'].path`: no such file or directory: runs/arith_rm" in err, err[-2000:]


def test_run_out_naming_a_file_is_one_line(tmp_path, capfd):
  """``--run.out`` naming an existing file: exit 2 with one line (before: a FileExistsError traceback)."""
  path = tmp_path / "a_file"
  path.write_text("x")
  with pytest.raises(BaseException) as e:
    train_main_here(["--run.out", str(path)])
  assert getattr(e.value, "code", None) == 2, e.value
  err = capfd.readouterr().err.strip().splitlines()
  assert err == [
    f"error: config field `run.out`: {path} is a file, not a directory: name a directory (created when missing)"
  ]


def test_resuming_past_run_steps_is_refused_and_a_complete_run_says_so(tmp_path, capfd):
  """A checkpoint at step 2 resumed with ``--run.steps 1``: exit 2, one line saying nothing would be trained and
  the two fixes (before: exit 0 with only ``run.steps: 2 -> 1`` logged); with ``--run.steps 2`` (the run is
  complete) a line says so and the run ends without training."""
  out = str(tmp_path / "run")
  argv = [
    "--model.synthetic",
    "{hidden_size: 16, num_layers: 1}",
    "--data.arithmetic",
    "{train_size: 16, eval_size: 2, sft_steps: 0}",
    "--rollout.group-size",
    "2",
    "--rollout.prompts-per-step",
    "2",
    "--rollout.max-new-tokens",
    "4",
    "--eval.every",
    "0",
    "--checkpoint.every",
    "1",
    "--run.out",
    out,
    "--no-plot",
    "--no-progress",
    "--no-tensorboard",
  ]
  train_main_here([*argv, "--run.steps", "2"])
  capfd.readouterr()
  with pytest.raises(BaseException) as e:
    train_main_here([*argv, "--run.steps", "1"])
  assert getattr(e.value, "code", None) == 2, e.value
  err = capfd.readouterr().err.strip().splitlines()
  assert err[-1] == (
    f"error: `run.steps`=1 but the checkpoint in {out}/checkpoints is at step 2: nothing would be trained. To "
    "train further, give --run.steps above 2; to start over with 1 steps, use another --run.out"
  ), err
  lines_before = open(os.path.join(out, "metrics.jsonl")).read()
  train_main_here([*argv, "--run.steps", "2"])
  assert f"the checkpoint in {out}/checkpoints is at step 2 = run.steps: the run is complete" in capfd.readouterr().out
  assert open(os.path.join(out, "metrics.jsonl")).read().count('"loss"') == lines_before.count('"loss"')


@pytest.mark.subprocess
def test_ctrl_c_during_the_warm_up_does_not_claim_an_abandoned_checkpoint(tmp_path):
  """A real ``scripts/train.py`` interrupted by SIGINT during the synthetic model's warm-up (before any step):
  exit 130 with one line saying there is no checkpoint, and no "checkpoint being written is abandoned" — none
  was being written (before: said always)."""
  import signal

  from helpers import cli_env

  out = tmp_path / "run"
  cmd = [
    sys.executable,
    os.path.join(ROOT, "scripts", "train.py"),
    "--model.synthetic",
    "{hidden_size: 16, num_layers: 1}",
    "--data.arithmetic",
    "{train_size: 64, eval_size: 2, sft_steps: 1000000}",
    "--run.out",
    str(out),
    "--no-progress",
  ]
  env = {**cli_env(tmp_path / "xla"), "PYTHONPATH": ROOT}
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    for line in proc.stdout:
      if line.startswith("devices:"):
        break
    time.sleep(5)  # building the model, then the warm-up's steps
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
  assert "step 1 " not in rest  # it was still in the warm-up
  assert "being written" not in err, err[-2000:]
  assert err.strip().splitlines()[-1] == (
    f"aborted by SIGINT: there is no complete checkpoint in {out}/checkpoints: the next run starts from step 0"
  ), err[-2000:]


def test_the_train_bar_shows_compiling_and_times_its_eta_from_the_first_step():
  """Issue 46 item 4: the trainer's ``train`` bar (``MetricsLogger``) says ``compiling`` until the first step's
  record, and its ETA counts the steps after it only (before: ``1/60 [00:19<18:58, 19.30s/step]`` for a 40 s run,
  the first step's compile taken as the step time)."""
  from jaxgrpo.services.metrics import MetricsLogger

  compile_s, step_s, total = 1.0, 0.02, 100
  logger = MetricsLogger(os.devnull, total_steps=total, tensorboard=False)
  bar = logger.bar
  bar.fp = io.StringIO()
  assert "compiling" in bar.format_meter(**bar.format_dict)
  time.sleep(compile_s)  # the warm-up, the first evaluation, the first step's compile
  logger({"step": 1, "loss": 0.1, "reward_mean": 0.5})
  assert "compiling" not in bar.format_meter(**bar.format_dict)
  time.sleep(step_s)
  logger({"step": 2, "loss": 0.1, "reward_mean": 0.5})
  eta = _eta_seconds(bar)
  logger.close()
  assert eta <= 0.5 + (total - 2) * step_s * 3, eta  # at the compile's pace it would be ~50 s


def test_train_reward_model_shows_a_bar_with_compiling_and_the_steps(tmp_path, capfd):
  """Issue 46 item 4: scripts/train_reward_model.py printed nothing for minutes (203 s on the demo); its fit
  now has a ``reward model`` bar: ``compiling``, then every step counted, with the loss. The script's ``main`` in
  this process (a child's start-up is ~3 CPU-s), its stdout and stderr read at the file descriptors."""
  with open(os.path.join(ROOT, "scripts", "configs", "demo_rm.yaml")) as f:
    text = f.read()
  config = tmp_path / "rm.yaml"
  config.write_text(text.replace("train_size: 4000", "train_size: 32").replace("eval_size: 128", "eval_size: 8"))
  argv = ["--config", str(config), "--out", str(tmp_path / "rm"), "--steps", "60", "--batch-size", "4"]
  argv += ["--hidden-size", "16", "--num-layers", "1"]
  capfd.readouterr()
  code = _load_script("train_reward_model").main(argv)
  r = capfd.readouterr()
  assert code == 0, r.err[-3000:]
  frames = re.split(r"[\r\n]", r.err)
  bars = [x for x in frames if x.startswith("reward model:")]
  assert any("compiling" in x and "0/60" in x for x in bars), bars
  assert any("60/60" in x and "loss=" in x for x in bars), bars
  assert "fitting the reward model" in r.out and "saved to" in r.out


#: the scripts whose parser needs nothing of the library: ``--help`` and a bad flag answer before jax is imported
LIGHT_HELP = ("export_hf", "multiturn_demo", "plan", "teacher_server", "train_reward_model")


@pytest.mark.subprocess
def test_help_and_a_bad_flag_answer_before_jax_is_imported():
  """``python scripts/X.py --help`` (and a missing required argument) of the scripts in ``LIGHT_HELP`` import
  neither jax nor jaxgrpo (``python -X importtime`` lists every module a process imports): ~0.07 CPU-s instead of
  ~2.7 (the suite runs every documented script's ``--help``), with the same options and help texts as ``main``'s
  parser."""
  from helpers import child_env

  procs = {
    (name, flag): subprocess.Popen(
      [sys.executable, "-X", "importtime", os.path.join(ROOT, "scripts", f"{name}.py"), flag],
      cwd=ROOT,
      env=child_env(1),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for name in LIGHT_HELP
    for flag in ("--help", "--no-such-flag")
  }
  for (name, flag), proc in procs.items():
    out, err = proc.communicate(timeout=120)
    imported = {line.rpartition("|")[2].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert proc.returncode == (0 if flag == "--help" else 2), (name, flag, err[-2000:])
    assert not imported & {"jax", "jaxgrpo", "flax", "transformers"}, (name, flag, sorted(imported)[:50])
    if flag == "--help":
      assert out.startswith(f"usage: {name}.py ") and _options(out) == _options(_help_of(name)), (name, out)
    else:
      assert err.rstrip().splitlines()[-1].startswith(f"{name}.py: error: "), (name, err[-500:])
