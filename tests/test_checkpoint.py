"""jaxgrpo.services.checkpoint on small hand-built snapshots (no trainer): Orbax's atomic step directories and
our manifest, interrupted and corrupt saves, mismatch errors (trees, run identity, guarded settings),
retention (last K + best), parameters-only restore, and HF export (jaxgrpo.run.builders) checked against
transformers' logits.

The trainer-level tests (exact resume, mesh change, SIGKILL) are in test_checkpoint_resume.py.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxgrpo import models
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.run import builders
from jaxgrpo.run.specs import ModelSpec, load_config
from jaxgrpo.run.trainer import run_meta
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services.checkpoint import RunMeta, Snapshot
from jaxgrpo.step import train as train_lib
from jaxgrpo.tasks.arithmetic import SyntheticModel


def _state(step: int, seed: int = 0, shape=(4, 3)) -> Snapshot:
  rng = np.random.default_rng([seed, step])
  params = {
    "w": jnp.asarray(rng.normal(size=shape), jnp.float32),
    "b": jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32),
  }
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = opt.update(grads, opt_state, params)  # non-trivial moments and count
  key = jax.random.fold_in(jax.random.key(seed), step)
  return Snapshot(
    params,
    opt_state,
    jnp.asarray(step, jnp.int32),
    key,
    {"epoch": 0, "offset": 2 * step, "seed": seed, "num_prompts": 64, "shuffle": True},
  )


def _leaves_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _assert_same_state(got: Snapshot, want: Snapshot):
  assert _leaves_equal(got.params, want.params)
  assert _leaves_equal(got.opt_state, want.opt_state)
  assert int(got.step) == int(want.step)
  assert np.array_equal(jax.random.key_data(got.key), jax.random.key_data(want.key))
  assert got.data_position == want.data_position
  assert jax.tree.structure(got.opt_state) == jax.tree.structure(want.opt_state)


def _run(hidden=64, lr=1e-3, steps=5) -> RunMeta:
  """A hand-written run meta: nested identity, one guarded setting, a config."""
  return RunMeta(
    identity={"model": {"hidden_size": hidden, "path": None}, "seed": 0},
    guarded={"learning_rate": lr},
    config={"run": {"steps": steps}, "model": {"hidden_size": hidden}, "tags": ("a", "b")},
  )


CFG = _run()


def test_save_is_atomic_manifest_inside_and_exact_roundtrip(tmp_path, monkeypatch):
  """Orbax 0.12.8 writes into ``<step>.orbax-checkpoint-tmp`` and renames; our manifest is written
  into the temporary directory (the final one does not exist yet), so a renamed step always has it."""
  seen = []
  orig = ck.Checkpointer._finalized

  def spy(self):
    step = self._saves.step
    seen.append(
      (
        os.path.isdir(os.path.join(self.directory, f"{step}{ck.TMP_SUFFIX}")),
        os.path.exists(os.path.join(self.directory, str(step))),
      )
    )
    orig(self)

  monkeypatch.setattr(ck.Checkpointer, "_finalized", spy)
  root = str(tmp_path / "ckpt")
  states = {s: _state(s) for s in (1, 2)}
  with ck.Checkpointer(root, log=None) as c:
    for s in (1, 2):
      assert c.save(states[s], CFG) == s
  assert seen == [(True, False), (True, False)]  # callback ran before the rename
  assert sorted(os.listdir(root)) == ["1", "2"]  # no temporary directory left
  for s in (1, 2):
    ck.verify_step(os.path.join(root, str(s)))
    assert os.path.exists(os.path.join(root, str(s), ck.MANIFEST))
  c = ck.Checkpointer(root, log=None)
  assert c.steps() == [1, 2] and c.latest_step() == 2
  got = c.restore(_state(0), CFG)  # template with other values, same tree
  _assert_same_state(got, states[2])
  _assert_same_state(c.restore(_state(0), CFG, step=1), states[1])
  meta = c.read_meta(2)
  assert meta["config"] == {"run": {"steps": 5}, "model": {"hidden_size": 64}, "tags": ["a", "b"]}
  assert meta["identity"] == {"model": {"hidden_size": 64, "path": None}, "seed": 0} and meta["format"] == ck.FORMAT
  c.close()


def test_interrupted_save_and_missing_manifest_are_ignored_with_a_message(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(_state(1), CFG)
    c.save(_state(2), CFG)
  # a save killed before its rename: a temporary directory with partial contents
  shutil.copytree(os.path.join(root, "2"), os.path.join(root, f"3{ck.TMP_SUFFIX}"))
  os.remove(os.path.join(root, f"3{ck.TMP_SUFFIX}", ck.MANIFEST))
  # a step directory without a manifest (an older version's foreground save killed between Orbax's
  # rename and the manifest write): incomplete for readers, moved aside by a Checkpointer
  shutil.copytree(os.path.join(root, "2"), os.path.join(root, "4"))
  os.remove(os.path.join(root, "4", ck.MANIFEST))
  msgs = []
  assert ck.complete_steps(root, log=msgs.append) == [1, 2]
  assert any("incomplete checkpoint save" in m and "3.orbax-checkpoint-tmp" in m for m in msgs)
  assert any("4" in m and "did not complete" in m for m in msgs)
  msgs.clear()
  c = ck.Checkpointer(root, log=msgs.append)
  assert any("incomplete" in m for m in msgs)
  assert any("moved aside" in m and "4.incomplete-" in m for m in msgs)
  _assert_same_state(c.restore_fn(CFG, _state(0)), _state(2))
  c.save(_state(3), CFG)  # the resumed run saves step 3 again ...
  c.save(_state(4), CFG)  # ... and step 4 (before: StepAlreadyExistsError at every restart)
  c.close()
  assert not os.path.exists(os.path.join(root, f"3{ck.TMP_SUFFIX}"))  # Orbax cleaned the leftover up
  assert ck.complete_steps(root, log=None) == [2, 3, 4]  # keep 3: step 1 went after step 4 completed
  (aside,) = [n for n in os.listdir(root) if n.startswith("4.incomplete-")]  # kept for inspection
  _assert_same_state(ck.Checkpointer(root, log=None).restore(_state(0), CFG, step=4), _state(4))


def test_truncated_file_clear_error_nothing_changed_previous_resumes(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(_state(1), CFG)
    c.save(_state(2), CFG)
  data = sorted(
    (
      os.path.join(d, f)
      for d, _, fs in os.walk(os.path.join(root, "2", "params"))
      for f in fs
      if os.sep + "d" + os.sep in os.path.join(d, f)
    ),
    key=os.path.getsize,
  )[-1]
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)
  before = {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}
  c = ck.Checkpointer(root, log=None, on_corrupt="stop")
  with pytest.raises(ck.CheckpointError) as e:
    c.restore_fn(CFG, _state(0))
  msg = str(e.value)
  assert "corrupt" in msg and os.path.relpath(data, os.path.join(root, "2")) in msg and "truncated" in msg
  assert "Recovery: move it aside" in msg and "earlier complete step ([1]; e.g. --step 1)" in msg
  assert "--on-corrupt quarantine" in msg
  after = {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}
  assert after == before  # a failed restore changes nothing
  _assert_same_state(c.restore(_state(0), CFG, step=1), _state(1))
  os.rename(os.path.join(root, "2"), os.path.join(root, "2.corrupt"))  # what the message suggests
  _assert_same_state(c.restore_fn(CFG, _state(0)), _state(1))
  c.close()


@pytest.mark.parametrize("lost", ["params/_METADATA", "meta/metadata"])
def test_corrupt_latest_step_is_quarantined_and_the_previous_one_resumes(tmp_path, lost):
  """A file of the newest step gone. Before: every restart stopped with the same error (rc 2 from
  scripts/train.py; `meta/metadata` with no recovery hint), so a restarting scheduler looped.
  Default now: the step is renamed (nothing deleted), a WARNING names the file, the previous step is
  resumed, and that step is saved again; a second restart finds nothing corrupt."""
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    for step in (1, 2, 3):
      c.save(_state(step), CFG)
  files_before = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
  os.remove(os.path.join(root, "3", lost))
  with pytest.raises(ck.CheckpointError) as e:  # what --on-corrupt stop does: one error naming the recovery
    ck.Checkpointer(root, log=None, on_corrupt="stop").check_run(CFG)
  assert f"{lost}: missing" in str(e.value) and "Recovery: move it aside" in str(e.value)
  assert ck.complete_steps(root, log=None) == [1, 2, 3]  # stop changes nothing
  logged = []
  c = ck.Checkpointer(root, log=logged.append)
  assert c.check_run(CFG) == 2
  (aside,) = [n for n in os.listdir(root) if n.startswith("3.corrupt-")]
  (warning,) = [m for m in logged if m.startswith("WARNING:")]
  assert f"checkpoint {root}/3 is corrupt" in warning and f"{lost}: missing" in warning
  assert f"moved aside to {root}/{aside}" in warning and "resuming from the previous complete step 2" in warning
  assert "--on-corrupt stop" in warning
  _assert_same_state(c.restore_fn(CFG, _state(0)), _state(2))
  c.save(_state(3, seed=1), CFG)  # the resumed run saves step 3 again
  c.close()
  kept = sorted(
    os.path.relpath(os.path.join(d, f), os.path.join(root, aside))
    for d, _, fs in os.walk(os.path.join(root, aside))
    for f in fs
  )
  assert kept == sorted(os.path.relpath(f, "3") for f in files_before if f.startswith("3/") and f != f"3/{lost}")
  logged.clear()
  c = ck.Checkpointer(root, log=logged.append)  # the next restart: nothing corrupt any more
  _assert_same_state(c.restore_fn(CFG, _state(0)), _state(3, seed=1))
  assert not [m for m in logged if "WARNING" in m or "is corrupt" in m]
  c.close()


def test_only_step_corrupt_starting_over_is_explicit(tmp_path):
  """Every checkpoint corrupt: the resume is refused naming each step and the way to start over, nothing moved
  (before: the step was moved aside and the run silently started from step 0); set_aside_corrupt() moves them
  aside, then the run starts fresh."""
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(_state(1), CFG)
    c.save(_state(2), CFG)
  os.remove(os.path.join(root, "1", "params", "_METADATA"))
  os.remove(os.path.join(root, "2", "meta", "metadata"))
  logged = []
  with ck.Checkpointer(root, log=logged.append) as c:
    with pytest.raises(
      ck.CheckpointError,
      match=r"every checkpoint in .* is corrupt \(step 2: .*meta/metadata: "
      r"missing; step 1: .*params/_METADATA: missing\); .*nothing was moved.*--no-resume",
    ):
      c.restore_fn(CFG, _state(0))
    assert sorted(os.listdir(root)) == ["1", "2"]
    assert len(c.set_aside_corrupt()) == 2
    assert c.restore_fn(CFG, _state(0)) is None
  assert sorted(n.split(".")[0] for n in os.listdir(root) if ".corrupt-" in n) == ["1", "2"]
  assert ck.recovery_hint(root, 3).startswith("Recovery: there is no earlier complete checkpoint")


def test_recovery_hint_recommends_only_intact_steps(tmp_path):
  """A corrupt step 3 whose earlier step 2 is corrupt too: the hint names step 1, never 2 (before: "e.g. --step
  2"); with step 1 corrupt as well, it says there is no earlier intact checkpoint."""
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None, max_to_keep=None) as c:
    for step in (1, 2, 3):
      c.save(_state(step), CFG)
  for step in (3, 2):
    with open(os.path.join(root, str(step), "meta", "metadata"), "r+b") as f:
      f.write(b"#")
  hint = ck.recovery_hint(root, 3)
  assert "use an earlier complete step ([1]; e.g. --step 1)" in hint and "step 2" not in hint, hint
  with open(os.path.join(root, "1", "meta", "metadata"), "r+b") as f:
    f.write(b"#")
  assert ck.recovery_hint(root, 3).startswith(
    "Recovery: there is no earlier intact checkpoint (steps [1, 2] are corrupt too)"
  )


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(_state(1), CFG)
  meta = os.path.join(root, "1", "meta", "metadata")
  raw = bytearray(open(meta, "rb").read())
  raw[len(raw) // 2] ^= 0x01
  open(meta, "wb").write(bytes(raw))
  with pytest.raises(ck.CheckpointError, match=r"meta/metadata: CRC32 differs"):
    ck.verify_step(os.path.join(root, "1"))


def test_wrong_shapes_and_wrong_model_give_named_errors(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, log=None) as c:
    c.save(_state(1), CFG)
    with pytest.raises(ck.CheckpointError) as e:
      c.restore(_state(0, shape=(5, 3)), CFG)
    assert "['w']: shape (4, 3) in the checkpoint, (5, 3) in the model" in str(e.value)
    assert "Nothing was overwritten" in str(e.value)
    other = _state(0)
    other = other._replace(params={**other.params, "extra": jnp.zeros(2)})
    with pytest.raises(ck.CheckpointError, match=r"\['extra'\]: in the running model, not in the checkpoint"):
      c.restore(other, CFG)
    with pytest.raises(ck.CheckpointError, match=r"model.hidden_size: 64 in the checkpoint, 32 now"):
      c.restore(_state(0), _run(hidden=32))
    with pytest.raises(ck.CheckpointError, match=r"model.path: None in the checkpoint, absent now"):
      c.restore(_state(0), RunMeta({"model": {"hidden_size": 64}, "seed": 0}, {"learning_rate": 1e-3}))
    msgs = []
    c.log = msgs.append
    c.restore(_state(0), _run(steps=9))  # a harmless change is reported only
    assert any("run.steps: 5 -> 9" in m for m in msgs)
    # a guarded setting: refused, unless allowed explicitly (then reported)
    with pytest.raises(ck.CheckpointError, match=r"learning_rate: 0.001 in the checkpoint, 0.002 now[\s\S]*allow"):
      c.restore(_state(0), _run(lr=2e-3))
    # the same checks without reading an array (scripts/train.py runs them before building the model)
    assert c.check_run(_run(steps=9)) == 1
    with pytest.raises(ck.CheckpointError, match=r"learning_rate: 0.001 in the checkpoint, 0.002 now"):
      c.check_run(_run(lr=2e-3))
    with pytest.raises(ck.CheckpointError, match=r"does not match[\s\S]*model.hidden_size"):
      c.check_run(_run(hidden=32))
  assert ck.Checkpointer(str(tmp_path / "empty"), log=None).check_run(_run()) is None
  msgs = []
  with ck.Checkpointer(root, log=msgs.append, allow_changed=True) as c:
    _assert_same_state(c.restore(_state(0), _run(lr=2e-3)), _state(1))
  assert any("changed settings (allowed): learning_rate: 0.001 in the checkpoint, 0.002 now" in m for m in msgs)


def test_a_checkpoint_of_another_format_is_refused_with_a_message(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, async_save=False, log=None) as c:
    c.save(_state(1), CFG)
  meta_path = os.path.join(root, "1", "meta", "metadata")
  meta = json.load(open(meta_path))
  meta.pop("format")
  json.dump(meta, open(meta_path, "w"))
  ck.write_manifest(os.path.join(root, "1"), 1, checksum=True)  # a consistent step of the old format
  with pytest.raises(ck.CheckpointError, match=r"meta format 1, this jaxgrpo reads format 2"):
    ck.Checkpointer(root, log=None).restore(_state(0), CFG)


def test_keeps_last_k_and_best_by_eval_metric(tmp_path):
  root = str(tmp_path / "ckpt")
  evals = {2: 0.9, 4: 0.1, 6: 0.5}
  with ck.Checkpointer(root, max_to_keep=2, best_metric="eval_accuracy", log=None) as c:
    for s in range(1, 8):
      c.observe({"step": s, "loss": 0.0})
      if s in evals:
        c.observe({"step": s, "eval_accuracy": evals[s]})
      c.save(_state(s), CFG)
  assert ck.complete_steps(root, log=None) == [2, 6, 7]
  root2 = str(tmp_path / "ckpt_min")
  with ck.Checkpointer(root2, max_to_keep=1, best_metric="eval_accuracy", best_mode="min", log=None) as c:
    for s in range(1, 8):
      if s in evals:
        c.observe({"step": s, "eval_accuracy": evals[s]})
      c.save(_state(s), CFG)
  assert ck.complete_steps(root2, log=None) == [4, 7]


def test_best_checkpoint_survives_a_restart_and_a_collapse(tmp_path):
  """A good run (eval 0.6 at step 2), then a restart with a learning rate that collapses the policy
  (finite parameters, eval 0.0 from then on). Before: Orbax kept the metrics in memory only, so the
  restarted run's keep-last-2 deleted step 2 with every newer save."""
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, max_to_keep=2, best_metric="eval_accuracy", log=None) as c:
    for s, acc in ((1, 0.2), (2, 0.6), (3, 0.4)):
      c.observe({"step": s, "eval_accuracy": acc})
      c.save(_state(s), CFG)
  with ck.Checkpointer(root, max_to_keep=2, best_metric="eval_accuracy", log=None) as c:  # the restart
    for s in range(4, 9):
      c.observe({"step": s, "eval_accuracy": 0.0 if s % 2 == 0 else float("nan")})  # collapsed
      c.save(_state(s), CFG)
  assert ck.complete_steps(root, log=None) == [2, 7, 8]
  _assert_same_state(ck.Checkpointer(root, log=None).restore(_state(0), CFG, step=2), _state(2))


def test_sync_saving_writes_the_manifest_too(tmp_path):
  root = str(tmp_path / "ckpt")
  with ck.Checkpointer(root, async_save=False, log=None) as c:
    c.save(_state(3), CFG)
  ck.verify_step(os.path.join(root, "3"))
  assert ck.has_checkpoint(str(tmp_path)) is False and ck.complete_steps(root, log=None) == [3]


def _tiny_demo_state(seed=0):
  """A snapshot of the arithmetic task's synthetic model and the run meta a trainer gives it."""

  cfg = load_config(None, {"model.synthetic": {"hidden_size": 32, "num_layers": 1}, "run.seed": seed})
  model, _ = builders.build_policy(cfg.model, seed=seed)
  graphdef, ts, _ = train_lib.init_train_state(model, optax.adamw(1e-3), shd.make_mesh(None))
  position = {"epoch": 0, "offset": 0, "seed": seed, "num_prompts": 8, "shuffle": True}
  return run_meta(cfg), graphdef, Snapshot(ts.params, ts.opt_state, ts.step, jax.random.key(seed), position)


@pytest.mark.slow
def test_restore_params_only_into_a_module_and_a_tree(tmp_path):

  run, graphdef, state = _tiny_demo_state(seed=1)
  root = str(tmp_path / "run" / "checkpoints")
  with ck.Checkpointer(root, log=None) as c:
    c.save(state, run)
  fresh, _ = builders.build_policy(ModelSpec(synthetic=SyntheticModel(hidden_size=32, num_layers=1)), seed=7)
  assert not _leaves_equal(nnx.state(fresh), state.params)
  out = ck.restore_params(str(tmp_path / "run"), fresh)  # a run directory works too
  assert out is fresh and _leaves_equal(nnx.state(fresh), state.params)
  tree = ck.restore_params(os.path.join(root, "0"), jax.tree.map(jnp.zeros_like, state.params))
  assert _leaves_equal(tree, state.params)
  model, tok, saved_cfg = builders.load_policy(root)
  assert saved_cfg.model.synthetic.hidden_size == 32 and _leaves_equal(nnx.state(model), state.params)
  wrong, _ = builders.build_policy(ModelSpec(synthetic=SyntheticModel(hidden_size=64, num_layers=1)), seed=0)
  with pytest.raises(ck.CheckpointError, match=r"shape \(64, 32\) in the checkpoint|in the checkpoint, \("):
    ck.restore_params(root, wrong)


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_the_same_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")

  run, graphdef, state = _tiny_demo_state(seed=2)
  root = str(tmp_path / "run" / "checkpoints")
  with ck.Checkpointer(root, log=None) as c:
    c.save(state, run)
  (out,) = builders.export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = tok(["What is 3 + 4?", "1+1=2"], padding=False)["input_ids"]
  n = min(len(ids[0]), len(ids[1]))
  tokens = np.asarray([ids[0][:n], ids[1][:n]], np.int64)
  with torch.no_grad():
    want = hf(torch.from_numpy(tokens)).logits.numpy()
  jax_model = nnx.merge(graphdef, state.params)
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  hidden, _ = jax_model(jnp.asarray(tokens, jnp.int32), pos)
  got = jax_model.logits(hidden)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  assert np.abs(want).max() > 1e-3  # not trivially zero
  # the CLI does the same

  root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(root_dir, "scripts", "export_hf.py"),
      str(tmp_path / "run"),
      str(tmp_path / "hf2"),
      "--step",
      "0",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=root_dir),  # this checkout's jaxgrpo
    preexec_fn=lambda: os.umask(0o027),  # the files follow the user's umask
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "read only" not in r.stdout + r.stderr and "read_only" not in r.stderr, r.stderr[
    -3000:
  ]  # Orbax's notice on a read-only restore
  hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), dtype=torch.float32).eval()
  with torch.no_grad():
    np.testing.assert_array_equal(hf2(torch.from_numpy(tokens)).logits.numpy(), want)
  ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  assert models.load_hf(str(tmp_path / "hf2")).config == dataclasses.replace(
    jax_model.config, bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"]
  )

  # issue 33, item 3: the tokenizer's special-token ids are in the export, so generate stops at EOS
  assert tok.eos_token_id is not None and tok.pad_token_id is not None
  for d in (out, str(tmp_path / "hf2")):
    config = json.load(open(os.path.join(d, "config.json")))
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    assert {k: config[k] for k in ids} == ids and {k: gen.get(k) for k in ids} == ids
  assert hf.generation_config.eos_token_id == tok.eos_token_id
  assert hf.generation_config.pad_token_id == tok.pad_token_id
  eos = tok.eos_token_id

  calls = []

  def emit_eos_after_two(module, args, logits):  # the model emits EOS as its 3rd new token (one call a token)
    calls.append(1)
    if len(calls) >= 3:
      logits = logits.clone()
      logits[:, -1, eos] = 1e4
    return logits

  prompt = torch.from_numpy(tokens[:1])
  with torch.no_grad():
    hf.lm_head.register_forward_hook(emit_eos_after_two)
    # watch only the new tokens: the model's own greedy picks, then EOS; none after it
    got = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, tokens.shape[1] :].tolist()
  assert len(got) == 3 and got[-1] == eos and eos not in got[:-1], got

  # the usual file modes (safetensors writes 0600): 0644 under umask 022, 0640 under the CLI's 027
  for d, mode in ((out, 0o666 & ~_umask()), (str(tmp_path / "hf2"), 0o640)):
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
      assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == mode, (d, name)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_restore_waits_for_a_save_still_being_written(tmp_path):
  """A restore right after an asynchronous save of the same Checkpointer reads that save (the template is built
  first, so the restore starts while the files are written; without the wait: "no complete checkpoint")."""
  root = str(tmp_path / "ck")
  state, template = _state(3), _state(0)
  with ck.Checkpointer(root, log=None) as c:
    c.save(state, CFG)
    _assert_same_state(c.restore(template, CFG), state)


def test_close_removes_a_failed_saves_directory_that_a_late_write_recreated(tmp_path):
  """Orbax reports the first failed write of a save while its other writes may still run, and a write creates
  its parent directories again (CI: `test_disk_full_on_a_small_tmpfs` found a temporary directory after the
  run had exited). A late writer thread recreates the failed step's temporary directory 0.3 s after the
  failure was reported; close() must still leave none (before: it removed them once and returned)."""
  root = str(tmp_path / "ck")
  c = ck.Checkpointer(root, log=None, on_save_error="continue")
  c.save(_state(1))
  c.wait()
  tmp = os.path.join(root, f"2{ck.TMP_SUFFIX}-1234")
  os.makedirs(os.path.join(tmp, "d"))
  c._saves.fail(2, OSError(errno.ENOSPC, "No space left on device"))  # what the save's watcher reports
  assert not os.path.exists(tmp)  # removed at once

  def late_write():
    time.sleep(0.3)
    os.makedirs(os.path.join(tmp, "d", "chunk"), exist_ok=True)

  writer = threading.Thread(target=late_write)
  writer.start()
  c.close()
  writer.join()
  assert sorted(os.listdir(root)) == ["1"], os.listdir(root)
