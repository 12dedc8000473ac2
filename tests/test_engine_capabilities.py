"""Issue 49 item 1: the built-in sampler is an engine, engines are built by name through one registry, and what
differs between engines is asked of the engine's class (capabilities), never of its name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxgrpo.rollout.engines import BuiltinEngine, registry
from jaxgrpo.rollout.sampling import SamplingConfig
from jaxgrpo.run import assemble
from jaxgrpo.run.specs import load_config
from jaxgrpo.run.trainer import Trainer

BASE = {
  "model.synthetic": {"hidden_size": 32, "num_layers": 1},
  "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0},
  "data.max_prompt_tokens": 64,
  "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
  "step.chunk_size": None,
  "reward.timeout_s": None,
  "eval.every": 0,
  "run": {"steps": 2, "log_every": 1},
  "devices.mesh": "",
}


class FilteringEngine(BuiltinEngine):
  """A user's engine whose class declares vLLM's two limits (a name that is not ``vllm``)."""

  name = "filtering"
  samples_on_mesh = False
  records_routing = False
  filtered_logprobs_off_unit_temperature = True
  routing_replay_refusal = "`rollout.engine`: the filtering engine cannot return routed experts; set none"


class CountingBuiltin(BuiltinEngine):
  """The built-in sampler, counting the calls the rollout source makes on the mesh path."""

  name = "counting"

  def __init__(self, **_):
    super().__init__()
    self.rows_calls = self.generate_calls = 0

  def sample_rows(self, *args, **kw):
    self.rows_calls += 1
    return super().sample_rows(*args, **kw)

  def generate(self, *args, **kw):
    self.generate_calls += 1
    return super().generate(*args, **kw)


def test_a_users_engine_is_refused_by_its_capabilities_not_its_name():
  """``filtered_logprobs_off_unit_temperature`` and ``routing_replay_refusal`` on a user's class refuse what
  they refuse for vLLM, one line at load naming the engine string (before: only ``engine == "vllm"`` was
  refused, so this engine trained on wrong log-probs); what it receives follows the same attributes."""
  name = "test_engine_capabilities:FilteringEngine"
  with pytest.raises(ValueError) as e:
    load_config(None, {**BASE, "rollout.engine": name, "step.temperature": 0.7, "rollout.top_k": 5})
  msg = str(e.value)
  assert "\n" not in msg and f"`rollout.engine: {name}` with `step.temperature`=0.7 != 1" in msg and "top_k=5" in msg
  moe = {"model.synthetic": {"hidden_size": 32, "num_layers": 1, "num_experts": 4, "experts_per_tok": 2}}
  with pytest.raises(ValueError, match="the filtering engine cannot return routed experts"):
    load_config(None, {**BASE, **moe, "rollout.engine": name})
  cfg = load_config(None, {**BASE, "rollout.engine": name, "step.temperature": 0.7})
  sampling = SamplingConfig(num_samples=4, max_new_tokens=8, pad_id=0, suppress_ids=(3,), record_routing=True)
  sent = assemble.engine_sampling(cfg, sampling)
  assert sent.suppress_ids == () and sent.record_routing is False
  assert dataclasses.replace(sent, suppress_ids=(3,), record_routing=True) == sampling  # nothing else changed
  # the built-in sampler receives the run's settings unchanged (it records routing; its log-probs are unfiltered)
  assert assemble.engine_sampling(load_config(None, {**BASE, "step.temperature": 0.7}), sampling) == sampling
  # vLLM, by its class: the same answers as before, from the registry
  assert registry.capability("vllm", "filtered_logprobs_off_unit_temperature") is True
  assert "Triton" in registry.capability("vllm", "routing_replay_refusal", None)
  assert registry.capability("jax", "routing_replay_refusal", None) is None


def test_the_registry_builds_the_builtin_engine_and_the_source_samples_through_it(tmp_path):
  """``rollout.engine: jax`` builds a ``BuiltinEngine`` (before: None, and the source branched on it); a user's
  engine declaring ``samples_on_mesh`` is driven on the built-in path (``sample_rows`` on the mesh, no
  ``generate``, no ``old_logp`` recomputation) and trains bit for bit as the default run."""
  default = Trainer(load_config(None, {**BASE, "run.out": str(tmp_path / "a")}), log=None)
  assert type(default.engine) is BuiltinEngine and registry.engine_class("jax") is BuiltinEngine
  want = [r for r in default.run() if "loss" in r]
  default.close()
  counted = Trainer(
    load_config(
      None, {**BASE, "run.out": str(tmp_path / "b"), "rollout.engine": "test_engine_capabilities:CountingBuiltin"}
    ),
    log=None,
  )
  engine = counted.engine
  got = [r for r in counted.run() if "loss" in r]
  counted.close()
  assert engine.rows_calls == 2 and engine.generate_calls == 0  # one rollout per step, on the mesh path
  assert len(got) == len(want) == 2
  for a, b in zip(got, want):
    assert "engine/mismatch_k3" not in a and "engine/push_s" not in a  # no recomputation, nothing copied
    for k in ("loss", "reward_mean", "completion_length", "grad_norm"):
      assert np.float64(a[k]).tobytes() == np.float64(b[k]).tobytes(), (k, a[k], b[k])
