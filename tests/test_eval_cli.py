"""scripts/eval.py on an HF directory written by a (tiny) demo run with save_model, and on the run's
checkpoint (the model rebuilt from the config saved with it): the same policy gives the same numbers."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from helpers import train_main_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import eval as eval_cli  # noqa: E402  (scripts/eval.py)

from jaxgrpo.models import load_hf  # noqa: E402
from jaxgrpo.run.specs import load_config  # noqa: E402
from jaxgrpo.run.trainer import Trainer  # noqa: E402
from jaxgrpo.services.checkpoint import Checkpointer, checkpoint_dir  # noqa: E402


def _train_tiny(out, **changes) -> list[dict]:
  """A tiny arithmetic run (no warm-up) into ``out``, ``changes`` over its settings; returns its records."""
  settings = {
    "model.synthetic": {"hidden_size": 32, "num_layers": 1},
    "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0, "max_operand": 9},
    "data.max_prompt_tokens": 64,
    "rollout.group_size": 2,
    "rollout.prompts_per_step": 2,
    "rollout.max_new_tokens": 6,
    "step.chunk_size": None,
    "run.steps": 1,
    "reward.timeout_s": None,
    "run.save_model": True,
    "run.out": str(out),
  }
  cfg = load_config(None, {**settings, **changes})
  with Checkpointer(checkpoint_dir(out), log=None) as ckpt:
    return Trainer(cfg, log=None, checkpoint_fn=ckpt.checkpoint_fn).run()


@pytest.mark.slow
def test_eval_script_reads_a_saved_run(saved_run, capsys):
  """The module's saved run (its model saved at the end, step 2: the latest checkpoint's parameters)."""
  assert os.path.exists(saved_run / "model" / "config.json")
  common = ["-k", "2", "--pass-k", "1", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "64", "--timeout", "30"]
  out = eval_cli.main(
    [
      "--model",
      str(saved_run / "model"),
      "--arithmetic",
      *common,
      "--arithmetic-eval-size",
      "8",
      "--arithmetic-train-size",
      "64",
      "--arithmetic-max-operand",
      "9",
    ]
  )
  assert out["problems"] == 8 and out["samples"] == 2
  assert 0.0 <= out["eval_accuracy"] <= out["eval_pass@2"] <= 1.0
  assert "eval_pass@1" in capsys.readouterr().out
  # the checkpoint: the run's own task and seed, the same parameters -> the same numbers
  from_ckpt = eval_cli.main(["--checkpoint", str(saved_run), "--arithmetic", *common, "--json"])
  assert from_ckpt == out


@pytest.mark.slow
def test_eval_of_a_checkpoint_is_the_trainers_own_evaluation_of_that_step(tmp_path, capsys):
  """Issue 46 item 3: ``eval.py --checkpoint OUT --step N`` (and the README's ``--arithmetic -k K`` form) gives
  the numbers of step N's eval record in metrics.jsonl: one computation (``evaluation.evaluate_checkpoint``:
  the run's prompts, padded length, completion length, batch size (each sampling call has its own key) and
  verifier). Before, eval.py sampled up to 1024 new tokens in batches of 64 where the demo's trainer samples 20
  in batches of 128 (demo: mean@4 0.443 against the trainer's 0.471 at step 60)."""
  changes = {
    "data.arithmetic": {"train_size": 256, "eval_size": 24, "sft_steps": 120, "max_operand": 4},
    "rollout.group_size": 4,
    "rollout.prompts_per_step": 4,
    "rollout.max_new_tokens": 12,
    "optim.learning_rate": 3.0e-3,
    "run.steps": 2,
    "run.save_model": False,
    "eval.every": 1,
    "eval.samples": 4,
    "eval.pass_k": [1, 4],
    "eval.batch_prompts": 8,  # 3 sampling calls, each with its own key
    "checkpoint.every": 1,
  }
  records = _train_tiny(tmp_path, **changes)
  evals = {r["step"]: r for r in records if "eval_accuracy" in r}
  assert evals[2]["eval_accuracy"] > 0  # the warm-up makes some answers right: the comparison is not 0 == 0
  for step in (1, 2):
    out = eval_cli.main(["--checkpoint", str(tmp_path), "--step", str(step), "--json"])
    want = {k: v for k, v in evals[step].items() if k.startswith("eval_")}
    assert {k: out[k] for k in want} == want, step
    assert out["problems"] == 24 and out["samples"] == 4
  # the command form: --arithmetic on an arithmetic run is the run's own held-out set
  out = eval_cli.main(["--checkpoint", str(tmp_path), "--arithmetic", "-k", "4", "--pass-k", "1", "4"])
  assert {k: out[k] for k in ("eval_accuracy", "eval_pass@1", "eval_pass@4")} == {
    k: evals[2][k] for k in ("eval_accuracy", "eval_pass@1", "eval_pass@4")
  }
  assert "the run's held-out set (24 problems, k=4, T=1.0)" in capsys.readouterr().out


# ------------------------------------------------------------------ issue 46 item 13: eval.py's bad input


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A 2-step tiny run with checkpoints at steps 1 and 2 and its model saved as an HF directory."""
  out = tmp_path_factory.mktemp("run")
  _train_tiny(out, **{"run.steps": 2, "eval.samples": 2, "eval.pass_k": [1, 2], "checkpoint.every": 1})
  return out


def _one_error_line(argv, capsys) -> str:
  """eval.py's ``main(argv)`` must exit 2 with one ``error:`` line on stderr and nothing else."""
  with pytest.raises(SystemExit) as e:
    eval_cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0]


@pytest.mark.parametrize(
  "options, expected",
  [
    (["-k", "0"], "error: -k is the samples per problem: expected an int >= 1; got 0"),
    (["--temperature", "-1"], "error: --temperature: expected a finite number >= 0 (0 = greedy); got -1.0"),
    (["--max-prompt-tokens", "5"], "longer than max_prompt_tokens=5 (--max-prompt-tokens 5): raise it"),
    (["-k", "2", "--pass-k", "1", "8"], "error: --pass-k 1 8: pass@j needs j <= -k (the samples per problem, 2)"),
    (["--step", "999"], "no step 999 in "),
  ],
)
def test_eval_bad_options_are_one_error_line(saved_run, capsys, options, expected):
  """Before: ValueError tracebacks (exit 1) for -k 0, --temperature -1, --max-prompt-tokens 5; --pass-k 8 with
  -k 2 dropped without a word; --step 999 called corrupt, with a `mv` of a folder that does not exist."""
  line = _one_error_line(["--checkpoint", str(saved_run), "--arithmetic", *options], capsys)
  assert expected in line, line
  if options[0] == "--step":
    assert "the complete steps are [1, 2] (e.g. --step 2)" in line and "mv " not in line and "corrupt" not in line


def test_eval_a_run_pass_k_above_a_smaller_k_is_said(saved_run, capsys):
  """The run's own pass@2 with -k 1 is not reported, and stderr says so (before: dropped without a word)."""
  out = eval_cli.main(["--checkpoint", str(saved_run), "-k", "1", "--json"])
  assert "eval_pass@1" in out and "eval_pass@2" not in out and out["samples"] == 1
  assert "note: the run's pass@[2] not reported: -k 1 samples per problem" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_eval_a_config_json_without_a_required_key_names_the_file_and_key(saved_run, tmp_path, capsys, key):
  """Before: a KeyError traceback ending in the bare key."""
  model = tmp_path / "model"
  shutil.copytree(saved_run / "model", model)
  cfg = json.loads((model / "config.json").read_text())
  del cfg[key]
  (model / "config.json").write_text(json.dumps(cfg))
  line = _one_error_line(["--model", str(model), "--arithmetic"], capsys)
  assert f"{model / 'config.json'}: missing the key '{key}'" in line, line


def test_eval_a_missing_local_model_path_is_not_looked_up_on_the_hub(tmp_path, capsys, monkeypatch):
  """Before: "'./models/nope' is not a local directory and could not be fetched from the hub: ..."."""
  monkeypatch.chdir(tmp_path)
  line = _one_error_line(["--model", "./models/nope", "--arithmetic"], capsys)
  assert line == (
    "error: --model ./models/nope: no such file or directory (a local path; a hub id has the form owner/name)"
  )
  with pytest.raises(ValueError, match=r"'./models/nope' is not a local directory: no such path \(a path, not a hub"):
    load_hf("./models/nope")


def test_train_names_the_config_json_and_the_missing_key(saved_run, tmp_path, capfd):
  """train.py's message was ``error: model.path '…': 'hidden_size'``; now the file and the key (its ``main`` in
  this process: ``helpers.train_main_here``)."""
  model = tmp_path / "model"
  shutil.copytree(saved_run / "model", model)
  cfg = json.loads((model / "config.json").read_text())
  del cfg["hidden_size"]
  (model / "config.json").write_text(json.dumps(cfg))
  argv = ["--config", os.path.join(ROOT, "scripts", "configs", "demo.yaml"), "--model.path", str(model)]
  argv += ["--model.synthetic", "null", "--data.arithmetic.sft_steps", "0", "--run.out", str(tmp_path / "out")]
  capfd.readouterr()
  with pytest.raises(BaseException) as e:
    train_main_here(argv)
  err = capfd.readouterr().err
  assert getattr(e.value, "code", None) == 2, (e.value, err[-3000:])
  assert f"{model / 'config.json'}: missing the key 'hidden_size'" in err, err[-3000:]
  assert "Traceback" not in err
