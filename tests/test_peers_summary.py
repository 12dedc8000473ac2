"""The peers benchmark's summary (`scripts/peers/bench_peers.py`): medians per implementation and the
phase split of jaxgrpo's iteration, on hand-made records (no benchmark runs)."""

import importlib.util
import os
import sys

_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "peers")


def _bench_peers():
  sys.path.insert(0, _DIR)
  try:
    spec = importlib.util.spec_from_file_location("peers_bench", os.path.join(_DIR, "bench_peers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
  finally:
    sys.path.remove(_DIR)
  return mod


def _record(rnd, total, rollout, after, reward_ref):
  return {
    "impl": "jaxgrpo",
    "task": "iter",
    "round": rnd,
    "times": [total],
    "tokens": 16384,
    "peak_rss_gb": 3.4,
    "rollout_s": [rollout],
    "update_s": [after],
    "reward_and_ref_s": [reward_ref],
  }


def test_train_step_alone_is_what_follows_the_reward_and_reference_pass():
  """The worker's `update_s` is everything after the rollout (run E: 26.1 = 5.46 + 20.64, of which
  3.83 s reward + reference); the summary's train step is the rest, its median over the rounds."""
  bp = _bench_peers()
  records = [
    _record(0, 26.10, 5.46, 20.64, 3.83),
    _record(1, 22.24, 5.31, 16.93, 3.78),
    _record(2, 22.83, 5.49, 17.35, 3.94),
  ]
  before = [dict(r) for r in records]
  entry = bp.summarise(records)[("jaxgrpo", "iter")]
  assert abs(entry["step_s"] - (17.35 - 3.94)) < 1e-9  # per-round 16.81, 13.15, 13.41 -> median 13.41
  assert abs(entry["median_s"] - 22.83) < 1e-9 and entry["per_round"] == {0: 26.10, 1: 22.24, 2: 22.83}
  assert records == before  # the raw records are not modified
