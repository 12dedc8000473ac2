"""scripts/eval.py on an HF directory written by a (tiny) demo run with save_model."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


@pytest.mark.slow
def test_eval_script_reads_a_saved_run(tmp_path, capsys):
  import eval as eval_cli

  from jaxgrpo.trainer import Trainer, TrainerConfig

  cfg = TrainerConfig(
    model="demo",
    dataset="demo",
    demo_hidden_size=32,
    demo_layers=1,
    demo_train_size=64,
    demo_eval_size=8,
    demo_sft_steps=0,
    group_size=2,
    prompts_per_step=2,
    max_new_tokens=6,
    max_prompt_tokens=64,
    chunk_size=None,
    steps=1,
    reward_timeout_s=None,
    save_model=True,
    out=str(tmp_path),
    demo_max_operand=9,
  )
  Trainer(cfg, log=None).run()
  assert os.path.exists(tmp_path / "model" / "config.json")
  out = eval_cli.main(
    [
      "--model",
      str(tmp_path / "model"),
      "--dataset",
      "demo",
      "-k",
      "2",
      "--pass-k",
      "1",
      "2",
      "--max-new-tokens",
      "6",
      "--max-prompt-tokens",
      "64",
      "--demo-eval-size",
      "8",
      "--demo-train-size",
      "64",
      "--demo-max-operand",
      "9",
      "--timeout",
      "30",
    ]
  )
  assert out["problems"] == 8 and out["samples"] == 2
  assert 0.0 <= out["eval_accuracy"] <= out["eval_pass@2"] <= 1.0
  assert "eval_pass@1" in capsys.readouterr().out
