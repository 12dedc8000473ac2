"""The int8 rollout sampler compiled ahead of time for a TPU chip (issue 51.2), in the side environment
``.venv-tpu/`` (jax[tpu] with libtpu; ``jax.experimental.topologies`` gives a compile-only v5e device, no TPU). The
child, tests/tpu_quant_checks.py, lowers and compiles ``generate``'s program for a bf16 Qwen3 and a Qwen3-MoE
whose sampler copy is int8 (``SamplingConfig(quantize="int8")``), and reports the StableHLO dots and the optimised
HLO's computations. Checked here:

- the state the program takes holds int8 codes (one per projection: 7 for one dense layer; 4 attention + 3 expert
  stacks for the MoE layer), and every StableHLO product is bf16 × bf16 (the LM head and attention included);
- in the decode loop of the dense model, the int8 codes enter the fusions that multiply: every computation that
  converts codes (int8 parameters, a non-int8 root) is nested in a product fusion, so no bf16 copy of a weight is
  written per token; only the prefill (outside the loop, once per call) may dequantise a weight on its own.
- the mixture of experts' routed experts (``ragged_dot``) are dequantised by a computation of their own inside the
  loop (the measured limit: XLA's ragged product takes no fused operand), recorded as such.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT, ensure_side_venv, tpu_child_env

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def report():
  """The child's JSON report (one libtpu start, two TPU compiles)."""
  python = ensure_side_venv("tpu")
  env = tpu_child_env()
  proc = subprocess.run(
    [python, os.path.join(ROOT, "tests", "tpu_quant_checks.py")], env=env, capture_output=True, text=True, timeout=1500
  )
  if proc.returncode:
    pytest.fail(f"tpu_quant_checks.py exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _is_loop(name: str) -> bool:
  """A computation that is neither the entry nor a fusion: the decode loop's body (or condition)."""
  return name != "ENTRY" and not name.startswith(("fused_computation", "copy_fusion", "fusion"))


def _dequantisers(model_report) -> list[dict]:
  """The computations that read int8 codes and produce something else (the convert and the scale) without
  multiplying themselves."""
  return [c for c in model_report["computations"] if "s8" in c["params"] and c["root"] != "s8" and not c["product"]]


def test_the_program_is_for_a_tpu_and_its_state_is_int8(report):
  assert report["platform"] == "tpu" and report["device_kind"] == "TPU v5 lite", report
  for name in ("dense", "moe"):
    r = report[name]
    assert "int8" in r["state_dtypes"] and r["codes"] == 7, (name, r["state_dtypes"], r["codes"])
    assert r["dots"] and all(d.split("->")[0].count("xbf16>") == 2 for d in r["dots"]), (name, r["dots"])
  assert report["moe"]["ragged_dot"] and not report["dense"]["ragged_dot"]


def test_in_the_decode_loop_the_int8_codes_enter_the_product_fusions(report):
  comps = {c["name"]: c for c in report["dense"]["computations"]}
  deq = _dequantisers(report["dense"])
  assert deq
  for c in deq:  # nested in a product fusion, or the prefill's (called from the entry, once per call)
    assert all(comps.get(k, {}).get("product") or k == "ENTRY" for k in c["callers"]), c
  in_loop = [c for c in comps.values() if c["product"] and "s8" in c["params"] and any(map(_is_loop, c["callers"]))]
  assert len(in_loop) >= 3, in_loop  # the attention, MLP-in and MLP-out products of the decode step take codes
  assert not [c for c in deq if any(map(_is_loop, c["callers"]))]  # no bf16 weight written per token


def test_the_moe_experts_are_dequantised_in_the_loop_before_the_ragged_product(report):
  """Recorded limit (docs/sampling.md, "Quantized rollout weights"): the three expert stacks' conversion is a
  computation of the decode loop itself (not fused into ``ragged_dot``); the attention's codes still fuse."""
  deq = _dequantisers(report["moe"])
  alone = [c for c in deq if any(map(_is_loop, c["callers"]))]
  assert len(alone) == 3, alone
