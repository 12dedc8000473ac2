"""The first commands a new user types (issue 22, items 8-10 and 12): ``python scripts/train.py`` with
the defaults, overrides without ``--config``, and bad inputs that must be refused in one line naming
their real cause (field or file) before any weight is read or the warm-up runs.

The model directories here hold ``config.json`` and a tokenizer but no weights: an error that comes
from the right check cannot have read any."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import train_main_here
from hf_utils import tiny_hf_config

from jaxgrpo.run import builders
from jaxgrpo.run.specs import TrainerConfig, load_config
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.tasks import arithmetic


def _model_dir(path, *, chat_template=True, tokenizer=True, **config) -> str:
  """``config.json`` of a tiny Qwen3 (``config`` overrides its fields) and the arithmetic tokenizer."""
  os.makedirs(path, exist_ok=True)
  tok = arithmetic.build_tokenizer()
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**tiny_hf_config("qwen3", vocab_size=len(tok)), **config}, f)
  if tokenizer:
    if not chat_template:
      tok.chat_template = None
    tok.save_pretrained(str(path))
  return str(path)


def _hf(path, **changes):
  over = {"model.path": path, "data.arithmetic.sft_steps": 0, "data.max_prompt_tokens": 32}
  over.update({"rollout.max_new_tokens": 8, "rollout.group_size": 2, "rollout.prompts_per_step": 2})
  return load_config(None, {**over, **changes})


@pytest.mark.parametrize(
  "case, want",
  [
    ("no tokenizer", r"^model.path '\S+' holds no tokenizer \(none of tokenizer.json, "),
    ("mamba", r"^model.path '\S+': Unsupported model_type='mamba'"),
    ("no config.json", r"^model.path '\S+': cannot read its config.json"),
    ("no chat template", r"^model.path '\S+': the tokenizer has no chat template"),
    (
      "micro-batches",
      r"^the rollout batch of 4 rows .* does not split into step.micro_batches 3 × step.mini_batches 1",
    ),
    ("too long", r"^data.max_prompt_tokens 32 \(padded to 32\) \+ rollout.max_new_tokens 40 = 72 exceeds the 64 "),
  ],
)
def test_each_bad_input_names_its_real_cause_not_the_mesh(tmp_path, case, want):
  """Before, all of these were reported as "devices.mesh 'fsdp=-1' ... does not fit: ...", and a
  missing tokenizer or chat template raised transformers' own error."""
  kw, changes = {}, {}
  if case == "no tokenizer":
    kw = {"tokenizer": False}
  elif case == "mamba":
    kw = {"model_type": "mamba"}
  elif case == "no chat template":
    kw = {"chat_template": False}
  elif case == "micro-batches":
    changes = {"step.micro_batches": 3}
  elif case == "too long":
    changes = {"rollout.max_new_tokens": 40}  # 32 + 40 > max_position_embeddings 64
  path = _model_dir(tmp_path / "m", **kw)
  if case == "no config.json":
    os.remove(os.path.join(path, "config.json"))
  with pytest.raises(ValueError) as err:
    Trainer(_hf(path, **changes), log=None)
  msg = str(err.value)
  assert re.search(want, msg), msg
  assert "devices.mesh" not in msg and "\n" not in msg


def test_a_good_directory_passes_every_check_and_reaches_the_weights(tmp_path):
  """The checks refuse only what is wrong: a directory that is fine except for its missing weights
  gets past all of them, to the loader's own error naming the weight files."""
  with pytest.raises(ValueError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
    Trainer(_hf(_model_dir(tmp_path / "m")), log=None)


def test_the_defaults_fit_the_default_model():
  """``TrainerConfig()`` (no ``--config``): the longest prompt (512) + ``rollout.max_new_tokens``
  (1024) fits the synthetic model, which had 256 positions (issue 22, item 8)."""
  cfg = TrainerConfig()
  config = builders.model_config(cfg.model)
  assert config.max_position_embeddings == arithmetic.SYNTHETIC_POSITIONS >= 512 + 1024
  builders.check_lengths(cfg, config)
  too_long = load_config(None, {"rollout.max_new_tokens": 2000})
  with pytest.raises(ValueError, match=r"= 2512 exceeds the 2048 positions of model.synthetic"):
    builders.check_lengths(too_long, config)


def _cli(tmp_path, capfd, *args):
  """``scripts/train.py``'s ``main`` on ``args`` in this process (``helpers.train_main_here``: the same code as the
  command, without a child's ~3 CPU-s of start-up): ``(exit status, stdout, stderr)``."""
  argv = ["--no-plot", "--no-progress", "--run.out", str(tmp_path / "out"), *args]
  capfd.readouterr()
  try:
    train_main_here(argv)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  r = capfd.readouterr()
  return code, r.out, r.err


@pytest.mark.slow
def test_cli_defaults_with_overrides_and_no_config_run(tmp_path, capfd):
  """``scripts/train.py`` without ``--config``: overrides of single fields of the default model and
  data (``--model.dtype``, ``--data.split``) keep the synthetic model and the arithmetic task (item
  9; before: "got path=None, synthetic=None"), and the default lengths (512 prompt tokens + 1024 new
  tokens) fit the model (item 8; before: refused after the 800-step warm-up). The warm-up, the run
  length and the sizes are cut to keep the test short; prompt and completion lengths stay the defaults."""
  small = ["--data.arithmetic.sft_steps", "0", "--data.arithmetic.eval_size", "2", "--data.arithmetic.train_size", "8"]
  small += ["--rollout.prompts_per_step", "1", "--rollout.group_size", "2", "--eval.samples", "1", "--run.steps", "1"]
  # the verifier's worker process and TensorBoard are not what is tested (~8 s of CPU)
  small += ["--reward.timeout_s", "null", "--no-tensorboard"]
  code, out, err = _cli(tmp_path, capfd, "--model.dtype", "float32", "--data.split", "train", *small)
  assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
  cfg = json.load(open(tmp_path / "out" / "config.json"))
  assert (
    cfg["model"]["synthetic"]
    == {"hidden_size": 64, "num_layers": 2, "num_experts": 0, "experts_per_tok": 2, "max_positions": 2048}
    and cfg["model"]["path"] is None
  )
  assert cfg["data"]["max_prompt_tokens"] == 512 and cfg["rollout"]["max_new_tokens"] == 1024
  assert cfg["data"]["arithmetic"]["max_operand"] == 19


@pytest.mark.parametrize(
  "args, want",
  [
    (["--optim.learning_rate", "inf"], r"config field `optim.learning_rate`: expected a finite number; got inf"),
    (["--data.arithmetic.sft_steps", "1"], r"`arithmetic.sft_steps` must be 0 \(no warm-up\) or >= 2"),
  ],
)
def test_cli_bad_numbers_and_old_keys_are_one_line_before_any_work(tmp_path, capfd, args, want):
  """Through the real script's ``main``: ``inf`` on the command line is a number, refused as non-finite (item
  12; before: a type error for the string 'inf', and ``.inf`` in a file was accepted and the run died
  at step 1); ``sft_steps: 1`` is refused naming the field (before: optax's ``decay_steps`` error after
  the data was built)."""
  code, out, err = _cli(tmp_path, capfd, *args)
  assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
  lines = [x for x in err.splitlines() if x.strip()]
  assert re.search(want, lines[-1]), err
  assert "Traceback" not in err and "supervised warm-up" not in out
  assert not os.path.exists(tmp_path / "out")
