"""Packing and activation sharding in the train step on 8 virtual CPU devices (one child process): the
packed step gives the parameters of the unpacked one-device step on every 8-device mesh (on one device:
test_train_packing.py), its program carries the models' activation constraints (traced under
``jax.set_mesh``), each device packs its own sequences (no gather of the rows across devices), and XLA
never replicates a tensor to reshard it."""

from __future__ import annotations

import pytest
from helpers import start_child

_CHILD = r"""
import re
import jax, numpy as np, optax
from helpers import G, flat_params, make_batch, tiny_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
config = preset("lambda_frpo")
model = tiny_model(layers=1)
opt = optax.sgd(0.5, momentum=0.9)
B, P, T = 32, 4, 12
batch = make_batch(b=B, p=P, t=T)

def run(spec, packing, micro=2, mini=2):
  mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=micro, mini_batches=mini, group_size=G, chunk_size=4, packing=packing)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  ref = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  b = step.pack(batch)
  ref_logp = np.asarray(ref(state.params, b))
  placed = step.place_batch(b)
  lowered = step.lower(state, placed)  # under jax.set_mesh(mesh), as a call runs it
  text, hlo = lowered.as_text(), lowered.compile().as_text()
  for _ in range(2):
    state, metrics = step(state, placed)
  assert step.traces == 1
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}, ref_logp, text, hlo, step, placed

want, want_m, want_ref, *_ = run("data=1", None)
# packed == unpacked on one device is test_train_packing.py's (every preset): here the meshes of 8 devices
for spec in ["data=8", "data=2,fsdp=2,tensor=2", "fsdp=2,tensor=4"]:
  got, m, ref_logp, text, hlo, step, placed = run(spec, P + T)
  np.testing.assert_allclose(ref_logp, want_ref, rtol=0, atol=1e-5, err_msg=spec)
  for key in ("loss", "grad_norm", "entropy", "tree/mean_process_set_size"):
    np.testing.assert_allclose(m[key], want_m[key], rtol=2e-5, err_msg=f"{spec} {key}")
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{spec} {k}")
  mesh = step.mesh
  if shd.batch_shards(mesh) > 1:
    # traced under the mesh: the residual stream of one micro-batch's packed rows [R/(M·K), L, D] is
    # constrained to rows over data × fsdp (the model's rules table)
    rows = placed.packed.tokens.shape[0] // 4
    found = re.findall(r"sdy.sharding_constraint %\S+ <@\w+, \[(.*?)\]> : tensor<([0-9x]+)xf32>", text)
    residual = {s.replace(" ", "") for s, shape in found if shape == f"{rows}x{P + T}x32"}
    assert residual == {'{"data","fsdp"},{},{}'}, (spec, residual)
    # each device packs its own sequences: inside the update loop no collective feeds a gather or
    # scatter of the packed rows (the collectives there: FSDP weight gathers for the matmuls, the
    # vocab-parallel LM head's reductions, the vocab-sharded embedding lookup `jit(_take)`)
    loop = [re.search(r'op_name="([^"]*)"', line) for line in hlo.splitlines()
            if re.search(r"= \S+ (all-gather|all-to-all|collective-permute|all-reduce)\(", line)]
    loop = [n.group(1) for n in loop if n and n.group(1).startswith("jit(fn)/while/body/closed_call/while/")]
    bad = [n for n in loop if re.search(r"gather|scatter", n.rsplit("/", 1)[-1]) and "jit(_take)" not in n]
    assert not bad, (spec, bad)
  print(spec, round(m["loss"], 6), "OK")
print("ALL OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_packed_step_is_mesh_invariant_8_devices():
  proc = start_child(_CHILD, devices=8)
  out, err = proc.communicate(timeout=1500)
  assert proc.returncode == 0, f"child failed:\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-8000:]}"
  assert out.strip().endswith("ALL OK"), out
  # the layouts are consistent: XLA never falls back to replicating a tensor to reshard it
  assert "Involuntary full rematerialization" not in err, err[-4000:]
