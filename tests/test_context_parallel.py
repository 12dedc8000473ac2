"""Context parallelism in the train step (8 CPU devices, child processes): with the sequence split over a ``context``
mesh axis (ring attention in the model, GSPMD elsewhere) the step equals the single-device step — the updated
parameters and the loss for GRPO, λ-GRPO and FRPO, packed and unpacked, and composed with fsdp and tensor — and the
λ-GRPO weights and FRPO's future-KL advantages of sequence-split inputs equal the NumPy formulas. The rows are long
enough (and their completions drawn from 2 tokens, so groups share long prefixes) that the segments, the shared
prefixes and the cumulative sums cross the shard boundaries."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from helpers import child_result, ref_lambda_sizes, start_child

pytestmark = [pytest.mark.subprocess]


def long_prefix_batch():
  """``helpers.make_batch`` of 8 rows (2 groups of 4), 8 prompt and 56 completion slots (``[prompt ‖ completion]``
  of 64: 4 context chunks of 16), whose rows share the first 20, 33 and 47 completion tokens with their group's
  first row: shared prefixes that end in the 2nd, 3rd and 4th chunk."""
  from helpers import make_batch

  batch = make_batch(b=8, p=8, t=56, g=4, vocab_small=2)
  comp, mask = np.array(batch.completions), np.array(batch.mask)
  for first in (0, 4):
    for j, shared in zip((1, 2, 3), (20, 33, 47)):
      comp[first + j, :shared], mask[first + j, :shared] = comp[first, :shared], True
      mask[first, :shared] = True
  comp = np.where(mask, comp, 0).astype(np.int32)
  old = np.where(mask, batch.old_logp + (~np.array(batch.mask)) * np.log(1 / 128), 0).astype(np.float32)
  ref = np.where(mask, old + 0.1, 0).astype(np.float32)
  return batch._replace(completions=comp, mask=mask, old_logp=old, ref_logp=ref)


_STEP = r"""
import jax, numpy as np, optax
from helpers import G, flat_params
from test_context_parallel import long_prefix_batch
from flax import nnx
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
cfg = Qwen3Config(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64, tie_word_embeddings=True)  # grouped heads: 2 query heads per kv head
model = build_model(cfg, rngs=nnx.Rngs(0))
opt = optax.sgd(0.5, momentum=0.9)  # linear in the gradient: last-bit gradient differences stay last-bit


def check(name, packing):  # the step on every mesh of MESHES against data=1 for one preset and layout
  MESHES = ["data=1", "fsdp=2,context=4"] + (["data=2,context=4", "tensor=2,context=4"] if name == "grpo" else [])
  config = preset(name)
  batch = long_prefix_batch()  # [prompt ‖ completion] of 64: 4 chunks of 16
  if not config.needs_reference:
    batch = batch._replace(ref_logp=None)
  # tree: packed prefix trees, each group's shared prefixes once, the tree mask in the ring
  tc = train.TrainConfig(micro_batches=1, group_size=G, chunk_size=16, packing=None if packing == "unpacked" else 128,
                         prefix_sharing="tree" if packing == "tree" else "none")
  results = {}
  for spec in MESHES:
    mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    if shd.context_size(mesh) > 1:  # the ring runs: K/V chunks passed around the context axis
      assert "collective-permute" in step.lower(state, batch).compile().as_text()
    losses = []
    for _ in range(2):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    results[spec] = flat_params(state.params), losses
    print(name, packing, spec, losses, flush=True)
  base, base_loss = results["data=1"]
  for spec in MESHES[1:]:
    params, loss = results[spec]
    np.testing.assert_allclose(loss, base_loss, rtol=1e-5, atol=1e-6, err_msg=f"{name} {packing} {spec} loss")
    for k in base:
      np.testing.assert_allclose(params[k], base[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {packing} {spec} {k}")
"""


#: the layouts each preset's check covers (prefix trees: λ-GRPO and FRPO, whose weights and future-KL use the tree)
LAYOUTS = {
  "grpo": ("unpacked", "packed"),
  "lambda_grpo": ("unpacked", "packed", "tree"),
  "frpo": ("unpacked", "packed", "tree"),
}
STEP_TEST = "test_context_parallel_step_equals_the_single_device_step_8_devices"
TERMS_TEST = "test_lambda_weights_and_future_kl_of_sequence_split_rows_equal_numpy_8_devices"

# the one child's driver: each part (``terms``, or ``preset:layout``) in turn; a part's failure is reported (its
# traceback, then ``FAILED part``) and the next still runs
_DRIVER = r"""
import json, sys, traceback
for part in sys.argv[1:]:
  try:
    if part == "terms":
      print("TERMS " + json.dumps(terms()), flush=True)
    else:
      check(*part.split(":"))
      print("OK", part, flush=True)
  except Exception:
    traceback.print_exc()
    print("FAILED", part, flush=True)
"""


def child_parts(items) -> list[str]:
  """The parts the selected tests of this module read: ``terms`` for the NumPy comparison, ``preset:layout`` for
  each layout's step test (a ``-m "not slow"`` run starts no step check)."""
  names = [
    (item.originalname, getattr(item, "callspec", None))
    for item in items
    if item.path.name == os.path.basename(__file__)
  ]
  parts = ["terms"] if any(name == TERMS_TEST for name, _ in names) else []
  packings = {spec.params["packing"] for name, spec in names if name == STEP_TEST}
  return parts + [f"{name}:{p}" for name, layouts in LAYOUTS.items() for p in layouts if p in packings]


@pytest.fixture(scope="module")
def context_parallel_child(request):
  """One 8-device child for the whole module: the λ-GRPO/FRPO terms, then every preset's layouts one after another
  (one JAX start-up and one model instead of one per preset, and one more for the terms), the parts the selected
  tests read (:func:`child_parts`): ``(exit status, stdout, stderr)``."""
  child = start_child(_TERMS + _STEP + _DRIVER, devices=8, args=child_parts(request.session.items))
  return child_result(child)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["unpacked", "packed", "tree"])
def test_context_parallel_step_equals_the_single_device_step_8_devices(packing, context_parallel_child):
  """GRPO, λ-GRPO and FRPO: ``fsdp=2,context=4`` (and for GRPO ``data=2,context=4`` and ``tensor=2,context=4``)
  against one device: the losses of two steps and the parameters after them agree to float32 rounding (1e-5), and
  the compiled program passes K/V chunks around the ring.
  ``tree``: packed prefix trees (``step.prefix_sharing: tree``, λ-GRPO and FRPO): the tree mask's bounds travel
  the ring with their key chunks."""
  rc, out, err = context_parallel_child
  for name, layouts in LAYOUTS.items():
    if packing in layouts:
      assert f"OK {name}:{packing}" in out.splitlines(), f"{name} {packing}: exit {rc}\n{out[-3000:]}\n{err[-8000:]}"


_TERMS = r"""
def terms():  # the λ-GRPO weights and FRPO advantages of sequence-split rows, then the refusals
  import json, sys
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from test_context_parallel import long_prefix_batch
  from jaxgrpo.kernels.config import preset
  from jaxgrpo.kernels.objective import rollout_advantages
  from jaxgrpo.parallel import sharding as shd

  mesh = shd.make_mesh("fsdp=2,context=4")
  split = NamedSharding(mesh, P(("data", "fsdp"), "context"))  # [B, T]: rows over fsdp, the sequence over context
  batch = long_prefix_batch()
  out = {}
  for name in ("lambda_grpo", "frpo"):
    config = preset(name)
    tokens, mask, old, ref = (jax.device_put(np.asarray(x), split) for x in
                              (batch.completions, batch.mask, batch.old_logp, batch.ref_logp))
    fn = jax.jit(lambda r, t, m, g, o, f: rollout_advantages(config, r, t, m, g, 2, old_logp=o, ref_logp=f,
                                                              max_group_size=4))
    with jax.set_mesh(mesh):
      adv, weights = fn(jnp.asarray(batch.rewards), tokens, mask, jnp.asarray(batch.group_ids), old, ref)
    out[name] = {"adv": np.asarray(adv).tolist(), "weights": np.asarray(weights).tolist()}

  # the refusals, one line each, before anything is compiled
  import optax, pytest
  from helpers import tiny_model
  from jaxgrpo.models.attention import context_implementation
  from jaxgrpo.step import train
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), optax.sgd(0.1), mesh)
  n = len(compiles)
  for packing, short, match in ((None, batch._replace(completions=batch.completions[:, :54], mask=batch.mask[:, :54],
      old_logp=batch.old_logp[:, :54], ref_logp=batch.ref_logp[:, :54]),
      r"the \[prompt ‖ completion\] row \(8 \+ 54\) length 62 is not divisible by the mesh's context axis "
      r"\(context=4\): pad it by 2 to 64 positions"),
      (126, batch, r"TrainConfig.packing \(the packed row\) length 126 is not divisible .* pad it by 2 to 128")):
    tc = train.TrainConfig(group_size=4, packing=packing)
    step = train.make_train_step(graphdef, optax.sgd(0.1), preset("grpo"), mesh=mesh, shardings=shardings,
                                 train_config=tc)
    with pytest.raises(ValueError, match=match):
      step(state, short._replace(ref_logp=None))
    reference = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
    with pytest.raises(ValueError, match=match):
      reference(state.params, short)
  assert len(compiles) == n and step.traces == 0, compiles[n:]
  with pytest.raises(ValueError, match="attention='splash' with a context mesh axis of size 4: .* use 'auto' or 'blockwise'"):
    context_implementation("splash", 4)
  assert context_implementation("auto", 4) == context_implementation("blockwise", 2) == "ring"
  assert context_implementation("auto", 1) is None and context_implementation("dense", 4) is None
  return out
"""


def test_lambda_weights_and_future_kl_of_sequence_split_rows_equal_numpy_8_devices(context_parallel_child):
  """The process-set sizes (prefix hashes over the completion) and FRPO's future-KL reversed cumulative sum, on
  ``[B, T]`` arrays split over ``fsdp=2,context=4`` (chunks of 14 completion tokens; shared prefixes of up to the
  whole row): λ-GRPO's token weights equal ``1/|λ(i,t)|`` by brute force, FRPO's advantages the NumPy cost-to-go."""
  from helpers import ref_advantages

  from jaxgrpo.kernels.config import preset

  rc, text, err = context_parallel_child
  line = [x for x in text.splitlines() if x.startswith("TERMS ")]
  assert line, f"terms: exit {rc}\n{text[-3000:]}\n{err[-8000:]}"
  out = json.loads(line[0][len("TERMS ") :])
  batch = long_prefix_batch()
  mask = np.asarray(batch.mask)
  sizes = ref_lambda_sizes(np.asarray(batch.completions), mask, np.asarray(batch.group_ids))
  assert (sizes[:, 42:][mask[:, 42:]] > 1).any()  # prefixes shared into the last chunk of 14 completion tokens
  want = np.where(mask, 1.0 / np.maximum(sizes, 1), 0.0)
  np.testing.assert_allclose(np.asarray(out["lambda_grpo"]["weights"]), want, rtol=1e-6, atol=1e-7)
  frpo = preset("frpo")
  want = np.where(mask, ref_advantages(frpo, batch), 0.0)  # the step's advantages are 0 on padding
  np.testing.assert_allclose(np.asarray(out["frpo"]["adv"]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_train_script_runs_with_a_context_axis(tmp_path):
  """``scripts/train.py --devices.mesh fsdp=2,context=4 --cpu-devices 8``: two steps of the tiny arithmetic run
  finish with finite losses, and the train step XLA compiled (its optimized HLO, dumped) runs the ring (the
  ``ppermute`` of ``shard_map`` in its optimized HLO's op names)."""
  import os

  from helpers import TEST_XLA_FLAGS, async_train_cmd, cli_env

  dump = tmp_path / "hlo"
  env = cli_env(tmp_path / "cache", xla_flags=f"{TEST_XLA_FLAGS} --xla_dump_to={dump} --xla_dump_hlo_as_text")
  cmd = async_train_cmd(tmp_path / "out", 2, **{"devices.mesh": "fsdp=2,context=4", "checkpoint.every": "0"})
  proc = subprocess.run([*cmd, "--cpu-devices", "8"], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all(), rows
  steps = [f for f in os.listdir(dump) if f.endswith("jit_fn.cpu_after_optimizations.txt")]
  assert steps and any("shard_map/ppermute" in (dump / f).read_text() for f in steps), sorted(os.listdir(dump))[:20]


def test_a_context_axis_of_size_1_is_the_3_axis_mesh_of_before():
  """``context=1`` (or no ``context``) builds the ``(data, fsdp, tensor)`` mesh, so the programs of meshes without
  context parallelism are unchanged; ``context`` is parsed only where named; ``check_sequence_divisible`` is a
  no-op without the axis."""
  import jax

  from jaxgrpo.parallel import sharding as shd

  one = jax.devices()[:1]
  assert shd.parse_mesh_spec("fsdp=2,context=4") == {"data": 1, "fsdp": 2, "tensor": 1, "context": 4}
  assert shd.parse_mesh_spec("fsdp=2") == {"data": 1, "fsdp": 2, "tensor": 1}
  for spec in ("data=1,context=1", "data=1"):
    mesh = shd.make_mesh(spec, devices=one)
    assert mesh.axis_names == shd.MESH_AXES and shd.context_size(mesh) == 1
    shd.check_sequence_divisible(61, mesh)
  assert shd.DEFAULT_RULES["activation_length"] == shd.CONTEXT_AXIS
  with pytest.raises(
    ValueError, match=r"has 4 devices \(data=1 x fsdp=1 x tensor=1 x context=4\) but there are 1 devices"
  ):
    shd.make_mesh("context=4", devices=one)


def test_train_script_refuses_rows_the_context_axis_does_not_divide(tmp_path):
  """``scripts/train.py`` exits 2 with one ``error:`` line before any weight is read when a row the run can train
  on does not split over the ``context`` axis: ``step.packing 126`` on ``context=4``, and on ``context=3`` the
  unpacked rows (a prompt bucket of 16 + the completion bucket of 64 = 80)."""

  from helpers import async_train_cmd, cli_env

  cases = {
    "packed": ({"devices.mesh": "fsdp=2,context=4", "step.packing": "126"}, "8"),
    "unpacked": ({"devices.mesh": "context=3", "rollout.max_new_tokens": "64"}, "3"),
  }
  procs = {
    name: subprocess.Popen(
      [*async_train_cmd(tmp_path / name, 1, **extra), "--cpu-devices", devices],
      env=cli_env(tmp_path / "cache"),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for name, (extra, devices) in cases.items()
  }
  errors = {}
  for name, proc in procs.items():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (name, err[-3000:])
    errors[name] = [line for line in err.splitlines() if line.startswith("error:")]
  assert errors["packed"] == [
    "error: devices.mesh 'fsdp=2,context=4' (8 devices) does not fit: step.packing (the packed row) length 126 is not "
    "divisible by the mesh's context axis (context=4): pad it by 2 to 128 positions or change the context size"
  ], errors
  assert errors["unpacked"] == [
    "error: devices.mesh 'context=3' (3 devices) does not fit: a [prompt ‖ completion] row of 16 + 64 = 80 positions "
    "(a prompt bucket of 16s + a completion bucket) is not divisible by the context axis (context=3); use a context "
    "size that divides every row (e.g. one dividing 16), or step.packing with a multiple of 3"
  ], errors
