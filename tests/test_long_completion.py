"""The long-completion demo (issue 50): ``scripts/configs/long_completion_cpu.yaml`` run by ``scripts/train.py`` as a
real subprocess, shortened to one step of 1,024 new tokens (the documented command: 4,096). Completions sampled
past EOS (``rollout.ignore_eos``) fill every row, the train step's attention is the CPU's blockwise kernel (``auto``
from 512 positions), the step's loss is finite, and the peak RSS the script reports is the child's own, measured
here by ``os.wait4``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, cli_env

from jaxgrpo.run import builders
from jaxgrpo.run.specs import load_config
from jaxgrpo.tasks import arithmetic

CONFIG = os.path.join(ROOT, "scripts", "configs", "long_completion_cpu.yaml")
T = 1024  # the short version's new tokens (>= 512: `auto` is the kernel; the prompt adds its padded length)
SHORT = [
  "--run.steps", "1", f"--rollout.max_new_tokens={T}", "--model.synthetic.max_positions", "1088",
  "--data.arithmetic.eval_size", "2", "--rollout.prompts_per_step", "1",
]  # fmt: skip


def test_the_synthetic_models_positions_are_a_field_the_length_check_names():
  """``model.synthetic.max_positions`` sets the synthetic model's positions (default 2048, as before); rows longer
  than them are refused in one line naming that field as a fix (before: no such field, 2048 fixed)."""
  cfg = load_config(CONFIG, {})
  vocab = len(arithmetic.build_tokenizer())
  assert arithmetic.model_config(cfg.model.synthetic, vocab).max_position_embeddings == 4224
  assert load_config(None, {}).model.synthetic.max_positions == arithmetic.SYNTHETIC_POSITIONS == 2048
  builders.check_lengths(cfg, arithmetic.model_config(cfg.model.synthetic, vocab))  # 64 + 4,096 <= 4,224
  longer = load_config(CONFIG, {"rollout.max_new_tokens": 8192})
  with pytest.raises(ValueError, match=r"= 8256 exceeds the 4224 positions .* raise model.synthetic.max_positions$"):
    builders.check_lengths(longer, arithmetic.model_config(longer.model.synthetic, vocab))
  with pytest.raises(TypeError, match=r"^config field `rollout.ignore_eos`: expected bool; got .yes. \(str\)$"):
    load_config(CONFIG, {"rollout.ignore_eos": "yes"})


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_long_completion_config_trains_through_train_py_with_blockwise_attention(tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config", CONFIG, "--no-plot", "--no-progress"]
  proc = subprocess.Popen(
    [*cmd, "--run.out", str(out), *SHORT], env=cli_env(tmp_path / "cache"), cwd=ROOT, stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT, text=True,
  )  # fmt: skip
  log = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage (not every child's of this process)
  proc.returncode = os.waitstatus_to_exitcode(status)
  assert proc.returncode == 0, log[-4000:]
  positions = re.search(r"attention: model.attention='auto' -> (\w+) in the train step \((\d+) positions", log)
  assert positions and positions.group(1) == "blockwise" and int(positions.group(2)) >= T + 1, log[-4000:]
  step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
  assert len(step) == 1 and math.isfinite(step[0]["loss"]) and math.isfinite(step[0]["grad_norm"]), step
  assert step[0]["completion_length"] == T and step[0]["tokens"] == 4 * T, step  # G = 4 rows, none ended early
  reported = float(re.search(r"peak RSS (\d+) MiB", log).group(1))
  measured = usage.ru_maxrss / 1024  # KiB on Linux
  assert abs(reported - measured) <= 0.02 * measured + 1, (reported, measured)


def test_the_attention_line_names_packed_rows_and_per_batch_episodes():
  """The trainer's attention line for a packed run names the packed row (``step.packing``), and a multi-turn run
  (no fixed prompt width before its first batch) says the choice is made per batch (before: a TypeError in
  ``Trainer.__init__`` of every ``env`` run)."""
  import jax

  from jaxgrpo.parallel import sharding as shd
  from jaxgrpo.run import assemble

  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  packed = load_config(CONFIG, {"step.packing": 2048})
  assert assemble.attention_line(packed, mesh, 64).endswith(
    "-> blockwise in the train step (2048 positions a row); the sampler's decode reads the filled part of its "
    "4159-slot KV cache, in blocks of 640"
  )  # 64 + 4,096 - 1 slots: decode_block's ceil(4159 / 8) rounded up to 128
  small = load_config(None, {"rollout.max_new_tokens": 20})
  assert assemble.attention_line(small, mesh, 64).endswith(
    f"-> dense in the train step ({64 + 20} positions a row); the sampler's decode reads its whole {64 + 19}-slot "
    "KV cache (under 1024 slots)"
  )
  assert assemble.attention_line(small, mesh, None).endswith(
    "chosen per batch by its row length (episodes' prompts vary); the sampler's decode reads only the filled slots "
    "of a KV cache of 1024 slots or more"
  )
  spec = load_config(CONFIG, {"rollout.speculative": "ngram", "rollout.speculative_tokens": 3})
  assert assemble.attention_line(spec, mesh, 64).endswith("its 4162-slot KV cache, in blocks of 640")
  dense = load_config(CONFIG, {"model.attention": "dense"})
  assert assemble.attention_line(dense, mesh, 64).endswith(
    "; the sampler's decode reads its whole KV cache (attention 'dense')"
  )
  other = load_config(CONFIG, {"rollout.engine": "vllm", "devices.mesh": ""})
  assert "sampler" not in assemble.attention_line(other, mesh, 64)
  # an env run's trajectories are env.max_tokens wide; rollout.max_new_tokens (1,024 by default) is not used there
  # (before: the line named 48 + 1,024 positions and "blockwise", while the step ran dense rows of 48 + 64)
  env = load_config(os.path.join(ROOT, "scripts", "configs", "demo_env.yaml"), {"env.max_tokens": 64})
  assert env.rollout.max_new_tokens != 64
  assert "-> dense in the train step (112 positions a row); the sampler's decode reads only the filled slots" in (
    assemble.attention_line(env, mesh, 48)
  )
