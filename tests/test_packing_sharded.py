"""Activation sharding on 8 virtual CPU devices (a child process): under ``jax.set_mesh(mesh)`` the
models' activations carry their rules table's constraints (seen in the lowered program), values and
gradients equal the model's without a mesh, other rules retrace (they are part of the graphdef), and
indivisible activations fail loudly."""

from __future__ import annotations

import pytest
from helpers import start_child

_CHILD = r"""
import re
import jax, jax.numpy as jnp, numpy as np, pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxgrpo import models; from jaxgrpo.step import packing; from jaxgrpo.parallel import sharding as shd

assert jax.device_count() == 8
cfg = models.Qwen3Config(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=64, tie_word_embeddings=True)
model = models.build_model(cfg, rngs=nnx.Rngs(0), remat="dots_no_batch")
graphdef, state = nnx.split(model)
rng = np.random.default_rng(0)
B, Pl, T, L, R = 8, 4, 12, 16, 8  # at most one row per sequence: R = B always fits
plen, clen = rng.integers(1, Pl + 1, B), rng.integers(0, T + 1, B)
pm, cm = np.arange(Pl)[None] >= Pl - plen[:, None], np.arange(T)[None] < clen[:, None]
pt = np.where(pm, rng.integers(1, 128, (B, Pl)), 0).astype(np.int32)
ct = np.where(cm, rng.integers(1, 128, (B, T)), 0).astype(np.int32)
pk = packing.pack(pt, pm, ct, cm, row_length=L, num_rows=R)
args = tuple(jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids))
w = jnp.asarray(rng.standard_normal((R, L)), jnp.float32)

def make_fn(graphdef):
  def loss(st, tokens, positions, seg):
    m = nnx.merge(graphdef, st)
    hidden, _ = m(tokens, positions, segment_ids=seg)
    lp = models.token_log_probs(m, hidden[:, :-1], tokens[:, 1:], chunk_size=8)
    return jnp.sum(jnp.where(seg[:, 1:] > 0, lp * w[:, 1:], 0.0)), hidden
  return jax.jit(jax.value_and_grad(loss, has_aux=True))

fn = make_fn(graphdef)
(ref_loss, ref_hidden), ref_grads = fn(state, *args)
assert "sharding_constraint" not in fn.lower(state, *args).as_text()  # no mesh: no constraint

def constraints_of(text):
  found = re.findall(r"sdy.sharding_constraint %\S+ <@\w+, \[(.*?)\]> : tensor<([0-9x]+)xf32>", text)
  return [(shape, spec.replace(" ", "")) for spec, shape in found]

mesh = shd.make_mesh("data=2,fsdp=2,tensor=2")
sharded_state, _ = shd.shard_tree(state, mesh)
placed = shd.place_batch(args, mesh)
with jax.set_mesh(mesh):
  constraints = constraints_of(fn.lower(sharded_state, *placed).as_text())
  (loss_, hidden), grads = fn(sharded_state, *placed)
batch = '{"data","fsdp"}'
expect = {
  ("8x16x32", f'{batch},{{}},{{}}'),                # residual stream [B, S, D]
  ("8x16x4x8", f'{batch},{{}},{{"tensor"}},{{}}'),  # queries and attention output [B, S, H, K]
  ("8x16x2x8", f'{batch},{{}},{{"tensor"}},{{}}'),  # keys, values [B, S, N, K]
  ("8x16x64", f'{batch},{{}},{{"tensor"}}'),        # MLP hidden [B, S, F]
}
assert expect <= set(constraints), (expect - set(constraints), constraints)
per_forward = cfg.num_layers * 6 + 2  # q, k, v, attention out, MLP hidden, layer output; embeddings, final
assert len(constraints) >= per_forward, len(constraints)
assert hidden.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, None)), 3), hidden.sharding
np.testing.assert_allclose(float(loss_), float(ref_loss), rtol=1e-5)
np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), rtol=0, atol=1e-5)
for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
  np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-4, atol=1e-6, err_msg=str(path))
print("constraints", len(constraints))

# other rules: the residual stream's D on the tensor axis. The rules live in the graphdef, so one jitted
# function with the graphdef as a static argument retraces for them (nothing stale from a cache).
rules = {**shd.DEFAULT_RULES, "activation_embed": "tensor"}
other = models.build_model(cfg, rngs=nnx.Rngs(0), remat="dots_no_batch", rules=rules)
assert other.rules == rules and model.rules == shd.DEFAULT_RULES
other_graphdef, _ = nnx.split(other)
assert other_graphdef != graphdef
residual = lambda gd: {spec for shape, spec in constraints_of(
    jax.jit(lambda g, st, t, p, s: nnx.merge(g, st)(t, p, segment_ids=s)[0], static_argnums=0)
    .lower(gd, sharded_state, *placed).as_text()) if shape == "8x16x32"}
with jax.set_mesh(mesh):
  assert residual(graphdef) == {f'{batch},{{}},{{}}'}, residual(graphdef)
  assert residual(other_graphdef) == {f'{batch},{{}},{{"tensor"}}'}, residual(other_graphdef)
  (loss2, _), _ = make_fn(other_graphdef)(sharded_state, *placed)
np.testing.assert_allclose(float(loss2), float(ref_loss), rtol=1e-5)

# loud failures: rows that do not divide data x fsdp, a rule using a mesh axis twice, an Explicit mesh
odd = tuple(x[:6] for x in args)
twice = models.build_model(cfg, rngs=nnx.Rngs(0), rules={**shd.DEFAULT_RULES, "activation_length": "tensor"})
with jax.set_mesh(mesh):
  with pytest.raises(ValueError, match=r"embeddings: dim 0 \('batch', size 6\) is not divisible by mesh axis 'data'×'fsdp' of size 4"):
    fn.lower(state, *odd)
  with pytest.raises(ValueError, match="attention queries: mesh axis 'tensor' used twice"):
    make_fn(nnx.split(twice)[0]).lower(sharded_state, *placed)
explicit = jax.make_mesh((2, 2, 2), shd.MESH_AXES, axis_types=(AxisType.Explicit,) * 3)
with jax.set_mesh(explicit):
  with pytest.raises(ValueError, match="not AxisType.Auto"):
    fn.lower(state, *args)
with pytest.raises(TypeError, match="rules must be a mapping"):
  models.build_model(cfg, rngs=nnx.Rngs(0), rules=[("batch", "data")])
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_activation_constraints_follow_the_rules_and_change_no_value():
  proc = start_child(_CHILD, devices=8)
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, f"child failed:\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-8000:]}"
  assert "OK" in out, out
  # the layouts are consistent: XLA never falls back to replicating a tensor to reshard it
  assert "Involuntary full rematerialization" not in err, err[-4000:]
