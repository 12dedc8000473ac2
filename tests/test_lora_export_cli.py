"""A LoRA run on the synthetic base, exported (issue 22, item 13), through the real scripts: the PEFT
directory names a base that is written beside it (before: ``base_model_name_or_path: null`` and no
base weights anywhere), ``peft`` on that base alone reproduces the trained policy, ``lora.load_peft``
closes the loop, and rebuilding the policy from the checkpoint reads the stored base instead of
re-running the supervised warm-up."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import train_main_here

from jaxgrpo import models
from jaxgrpo.models import lora
from jaxgrpo.run import builders
from jaxgrpo.tasks import arithmetic

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
  "--config",
  os.path.join(ROOT, "scripts", "configs", "demo_lora.yaml"),
  "--model.synthetic",
  "{hidden_size: 32, num_layers: 1}",
  "--data.arithmetic",
  "{train_size: 64, eval_size: 4, sft_steps: 150, sft_learning_rate: 1e-2, sft_batch_size: 16}",
  "--lora.targets",
  "[gate, up, down]",  # MLP adapters
  "--lora.dropout",
  "0",
  "--rollout.group_size",
  "4",
  "--rollout.prompts_per_step",
  "2",
  "--rollout.max_new_tokens",
  "12",
  "--optim.learning_rate",
  "3e-2",
  "--eval.samples",
  "1",
  "--eval.pass_k",
  "[1]",
  "--reward.timeout_s",
  "null",
  "--reward.weights",
  "{accuracy: 1.0, format: 1.0}",  # varies within groups of the briefly warmed-up model: non-zero updates
  "--step.temperature",
  "1.5",
  "--run.steps",
  "3",
  "--run.save_model",
  "true",
  "--no-plot",
  "--no-progress",
  "--no-tensorboard",  # not what is tested; its import (tensorboardX imports torch) is ~2.5 s of CPU
]


def _logits(model, tokens):
  mask = jnp.ones(tokens.shape, bool)
  hidden, _ = model(jnp.asarray(tokens), models.positions_from_mask(mask))
  return np.asarray(model.logits(hidden, out_dtype=jnp.float32))


def _export_script():
  spec = importlib.util.spec_from_file_location("export_hf_script", os.path.join(ROOT, "scripts", "export_hf.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_lora_export_on_the_synthetic_base_names_and_writes_the_base(tmp_path, monkeypatch, capfd):
  monkeypatch.chdir(tmp_path)  # relative paths, as a user types them: the run, the exports, the PEFT base
  out = tmp_path / "run"
  # scripts/train.py's main in this process (helpers.train_main_here: a child's start-up is ~3 CPU-s)
  train_main_here([*ARGS, "--run.out", "run"])
  assert os.path.isfile(out / "checkpoints" / "base" / "model.safetensors")  # the warmed-up base, stored once

  # rebuilding the policy reads the stored base: the warm-up is never run (export and load_policy)
  def no_warm_up(*a, **k):
    raise AssertionError("load_policy re-ran the supervised warm-up")

  monkeypatch.setattr(arithmetic, "warm_up", no_warm_up)
  # scripts/export_hf.py's main in this process (a child's start-up is ~8 s of CPU; the guard above holds here)
  capfd.readouterr()
  assert _export_script().main(["run", "hf"]) == 0
  r = capfd.readouterr()
  assert "wrote " in r.out and "supervised warm-up" not in r.out + r.err
  policy, _, cfg = builders.load_policy(str(out))
  assert cfg.lora.targets == ("gate", "up", "down")
  tokens = np.random.default_rng(0).integers(3, policy.config.vocab_size, (3, 12))
  ours = _logits(policy, tokens)
  assert np.abs(ours - _logits(lora.reference_model(policy), tokens)).max() > 1e-3  # the adapters were trained

  for export in ("run/model", "hf"):  # end of the run (run.save_model) and scripts/export_hf.py
    peft_dir = f"{export}-peft"
    base_dir = json.loads(open(os.path.join(peft_dir, "adapter_config.json")).read())["base_model_name_or_path"]
    # the path relative to where the export ran, as PEFT writes a base loaded by its path (issue 46, item 7;
    # before: the absolute path, /home/<user>/... in a directory meant to be shared)
    assert base_dir == f"{export}-base" and os.path.isdir(base_dir), base_dir
    with torch.no_grad():  # peft reads the base from adapter_config.json itself
      peft_model = peft.AutoPeftModelForCausalLM.from_pretrained(peft_dir, dtype=torch.float32).eval()
      got = peft_model(torch.from_numpy(tokens)).logits.numpy()
    err = np.abs(got - ours).max()
    assert err < 1e-4, err
    print(f"{export}: peft on the exported base vs the policy: max |Δ logit| = {err:.2e}")
    transformers.AutoTokenizer.from_pretrained(base_dir)  # the base carries its tokenizer
    with jax.default_matmul_precision("float32"):
      back = lora.load_peft(models.load_hf(base_dir), peft_dir)
      assert np.abs(_logits(back, tokens) - ours).max() < 1e-4
