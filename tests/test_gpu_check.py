"""The device script's CPU dry path (issue 38.4): ``DRY=1 bash scripts/gpu_check.sh`` runs its step plumbing
(limits, deadline, log, tarball) with ``scripts/bench_accel.py --dry``, the same code as the 0.6B/1.7B rows at a
toy shape; the FLOP and roofline formulas are checked against a hand count."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tarfile

import pytest
from helpers import ROOT, child_env

_spec = importlib.util.spec_from_file_location("bench_accel", os.path.join(ROOT, "scripts", "bench_accel.py"))
bench_accel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_accel)


def test_flops_and_roofline_formulas_by_hand():
  from jaxgrpo.models import Qwen3Config

  cfg = Qwen3Config(**bench_accel.SHAPES["toy"], tie_word_embeddings=True)
  # D=64, L=2, H=4, KV=2, K=16, F=128, V=512; B=2, P=3, T=5
  per_layer = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 128
  want = 6 * 2 * per_layer * 2 * 8 + 6 * 64 * 512 * 2 * 5 + 6 * 2 * 4 * 16 * 8 * 8 * 2
  assert bench_accel.model_flops(cfg, 2, 3, 5) == want
  kv = 2 * 2 * 2 * 16 * 2  # layers · (k, v) · kv heads · head_dim · bf16 bytes per token
  assert bench_accel.decode_bytes(cfg, 1000, 2, 3, 5) == 5 * 1000 * 2 + 2 * kv * (3 + 4 + 5 + 6 + 7)
  kind, peak, bw = bench_accel.chip(type("D", (), {"device_kind": "NVIDIA H100 80GB HBM3"})())
  assert (peak, bw) == (989e12, 3.35e12)
  assert bench_accel.chip(type("D", (), {"device_kind": "cpu"})())[1:] == (None, None)


@pytest.mark.slow
def test_dry_run_of_the_device_script(tmp_path):
  env = {**child_env(1), "DRY": "1", "OUT": str(tmp_path), "PY": "python"}
  r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env, capture_output=True, timeout=300)
  log = (tmp_path / "gpu.log").read_text()
  assert r.returncode == 0, log[-3000:]
  assert "=== accel_dry: rc 0" in log and "=== accel_0.6b" not in log, log[-3000:]
  with tarfile.open(tmp_path / "results.tgz") as tar:
    res = json.load(tar.extractfile("res/accel_toy.json"))
  assert res["shape"] == "toy" and res["step_s"] > 0 and res["decode_tokens_per_s"] > 0 and res["iteration_s"] > 0
  assert res["mfu_bf16_peak"] is None  # the CPU has no datasheet peak in the table: left out, not guessed
