"""Programs compiled for a TPU slice from this CPU host (issue 48, items 3-4), in the side environment
``.venv-tpu/`` (scripts/setup_tpu_venv.sh: jax[tpu] with libtpu, no TPU: ``jax.experimental.topologies`` gives
compile-only v5e devices). The child, tests/tpu_aot_checks.py, builds a bf16 Qwen3 model's train state abstractly
(``init_train_state(..., abstract=True)``: nothing allocated), lowers and compiles the GRPO step with
``TrainStep.lower`` for a v5e-4 (``v5e:2x2``) mesh ``data=2, fsdp=2``, and lowers the sampler and a mixture of
experts' step for it. Checked here against counts from the model's dimensions, not from the code:

- every product of the bf16 model is bf16 × bf16 (on the code before the target platform was read from the
  mesh, the host's "cpu" backend gave the TPU program float32 × float32 dots, 52 of the tiny model's 58), the LM
  head's log-prob kernel's backward included (before: a float32 cotangent times bf16);
- the step's argument bytes per chip equal the sharded state (bf16 parameters, AdamW's float32 first and bf16
  second moments, its count and the step counter) plus the batch rows of one chip, by formula, within 0.1%;
- the donated state aliases the output: alias bytes equal the state's bytes within 0.1%;
- the mixture of experts dispatches with ``ragged_dot`` (the TPU default), not the CPU's tiles;
- the CPU programs this environment lowers are the pinned ones (``tpu_aot_checks.CPU_PROGRAM_SHA256``).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import tpu_aot_checks as checks
from helpers import ROOT, ensure_side_venv, tpu_child_env

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def reports():
  """The child's JSON reports, ``tpu`` and ``splash`` (one child for the module: one start-up, one libtpu load;
  the splash step's test had a child of its own); a report that raised holds ``"failed"``, its traceback."""
  python = ensure_side_venv("tpu")
  env = tpu_child_env()
  proc = subprocess.run(
    [python, os.path.join(ROOT, "tests", "tpu_aot_checks.py"), "tpu", "splash"],
    env=env,
    capture_output=True,
    text=True,
    timeout=1500,
  )
  if proc.returncode:
    pytest.fail(f"tpu_aot_checks.py exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _report(reports, name: str) -> dict:
  r = reports[name]
  if "failed" in r:
    pytest.fail(f"the child's {name!r} report failed:\n{r['failed']}")
  return r


@pytest.fixture(scope="module")
def report(reports):
  """The ``tpu`` report: the sized model's step, sampler and MoE step for the slice, the CPU programs' hashes."""
  return _report(reports, "tpu")


def _mesh_sizes() -> dict[str, int]:
  return {k: int(v) for k, v in (part.split("=") for part in checks.MESH.split(","))}


def _state_bytes_per_chip() -> int:
  """The train state on one chip, from the model's dimensions: every weight matrix has one model-width (D) dim,
  split over ``fsdp`` (and replicated over ``data``); the RMSNorm scales are replicated."""
  s, f = checks.SIZED, checks.SIZED_F
  d, v, h, n, k, layers = (
    s[x] for x in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "num_layers")
  )
  matrices = v * d + layers * (d * h * k + 2 * d * n * k + h * k * d + 3 * d * f)  # tied embedding; q, k, v, o; MLP
  scales = layers * (2 * k + 2 * d) + d  # q/k norms, the two layer norms, the final norm
  per_chip = matrices // _mesh_sizes()["fsdp"] + scales
  param, mu, nu = 2, 4, 2  # bf16 parameters; AdamW's first moment float32 (mu_dtype), second in the params' dtype
  return per_chip * (param + mu + nu) + 4 + 4  # + AdamW's int32 count + the step's int32 counter


def _batch_bytes_per_chip() -> int:
  """The batch fields the GRPO step reads (β = 0: no reference log-probs), rows split over ``data × fsdp``."""
  m = _mesh_sizes()
  b, p, t = (checks.SIZED_BATCH[x] for x in ("b", "p", "t"))
  rows = b // (m["data"] * m["fsdp"])
  # prompt tokens int32 + mask bool; completions int32 + mask bool + old log-probs f32; group ids int32, rewards f32
  return rows * (p * (4 + 1) + t * (4 + 1 + 4) + 4 + 4)


def test_the_program_is_compiled_for_the_tpu_slice_not_the_cpu_host(report):
  assert report["platform"] == "tpu" and report["chips"] == 4 and report["device_kind"] == "TPU v5 lite", report
  assert report["default_backend"] == "cpu"  # the host's: what the choices must not read


def test_a_bf16_model_compiled_for_a_tpu_has_bf16_products(report):
  """No dot_general of the bf16 model's train step or sampler multiplies two float32 operands: the sampler's are
  all bf16 × bf16, the step's too but for the backward products of the attention softmax's hand-written gradient
  (a float32 cotangent times a bf16 activation; issue 50 replaces that attention); a mixture of experts' step
  dispatches with ragged_dot."""
  for name in ("step", "sample", "sample_mesh"):  # sample_mesh: lower_generate(..., mesh=the slice's mesh)
    dots = report[f"{name}_dots"]
    assert dots and report[f"{name}_f32_dots"] == [], (name, report[f"{name}_f32_dots"])
    assert all("xbf16>" in d.split("->")[0] for d in dots), (name, dots)
  mixed = [d for d in report["step_dots"] if d.split("->")[0].count("xbf16>") == 1]
  assert all(d.split("->")[1].strip().endswith("xf32>") for d in mixed), mixed
  assert all(d.split("->")[0].count("xbf16>") == 2 for d in report["sample_dots"]), report["sample_dots"]
  assert report["moe_ragged_dot"]


def test_the_lm_head_kernel_backward_multiplies_bf16_by_bf16_on_a_tpu(report):
  """Every product of the bf16 TPU step that has a vocabulary-sized operand (V = 5120, a size no other dimension
  of the sized model has: the LM head's forward and its log-prob kernel's two backward products) is bf16 × bf16
  accumulated in float32. Before, the kernel's backward took the transpose of the forward's dot: its float32
  cotangent times the bf16 weight or hidden states (f32 × bf16, which a TPU runs as a float32 matmul)."""
  v = checks.SIZED["vocab_size"]
  head = [d for d in report["step_dots"] if f"x{v}x" in d.split("->")[0] or f"<{v}x" in d.split("->")[0]]
  assert len(head) >= 3, report["step_dots"]  # the forward and the two backward products (more: chunks, remat)
  assert all(d.split("->")[0].count("xbf16>") == 2 for d in head), head
  assert all(d.split("->")[1].strip().endswith("xf32>") for d in head), head


def test_argument_bytes_are_the_sharded_state_and_batch_and_the_donated_state_aliases(report):
  mem = report["memory"]
  state, batch = _state_bytes_per_chip(), _batch_bytes_per_chip()
  assert abs(mem["argument"] - (state + batch)) <= 1e-3 * (state + batch), (mem, state, batch)
  assert abs(mem["alias"] - state) <= 1e-3 * state, (mem, state)


def test_libtpu_changes_no_cpu_program(report):
  """The CPU programs lowered in the TPU environment are the pinned ones (tests/test_target_platform.py checks
  them all in the main environment)."""
  hashes = report["cpu_hashes"]
  assert hashes and hashes == {k: checks.CPU_PROGRAM_SHA256[k] for k in hashes}


def test_a_state_for_compile_only_devices_is_refused_in_one_line_naming_abstract(report):
  """``init_train_state`` without ``abstract=True`` on the slice's devices: one line naming the fix, before any
  transfer (before: XLA's "MakeArraysFromHostBufferShards not available with compile-only client")."""
  line = report["concrete_refusal"]
  assert line is not None and "\n" not in line and "abstract=True" in line and "TPU v5 lite" in line, line


def test_a_partitioned_tpu_step_runs_the_splash_kernel_under_shard_map(reports):
  """A tiny bf16 Qwen3's GRPO step at 640 positions with attention ``auto``, compiled for v5e-4 partitioned as
  ``fsdp=4``: the model resolves splash, the lowered program holds the Mosaic kernel (``tpu_custom_call``) inside
  a ``shard_map``, and it compiles. Before, ``auto`` took blockwise in a partitioned program (XLA: "Mosaic kernels
  cannot be automatically partitioned"), so the program held no Mosaic call. (The module's child compiles it.)"""
  r = _report(reports, "splash")
  assert r["platform"] == "tpu" and r["chips"] == 4, r
  assert r["implementation"] == "splash" and r["mosaic_kernel"] and r["shard_map"], r
  assert r["temp_bytes"] > 0, r
