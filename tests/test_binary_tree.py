"""The binary-tree task: environment, policies, the jitted loop, the CLI's errors.

References are independent of the code under test: hand-written reward tables and process-set sizes,
NumPy brute force for the tabular policy, per-path full forwards for the transformer.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo import finalize_terms, objective_terms, preset, process_set_sizes, rollout_advantages
from jaxgrpo.loop.iteration import rollout_loss
from jaxgrpo.tasks import binary_tree as bt

ROOT = Path(__file__).resolve().parents[1]
N, P, O, T = "n", "p", "o", "t"  # placeholders in the hand tables: r_neg, (unused), 0.7, 1.0


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------

# Target LLRL = leaf 0b0010 = 2. Leaves 0..7 start with L, 0..3 with LL (written out by hand).
HAND_TABLES = {
  1: [N, N, T, N, N, N, N, N, O, O, O, O, O, O, O, O],
  2: [N, N, T, N, O, O, O, O, O, O, O, O, O, O, O, O],
  3: [O, O, T, N, O, O, O, O, O, O, O, O, O, O, O, O],
  4: [O, O, T, O, O, O, O, O, O, O, O, O, O, O, O, O],
}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("r_neg", [-0.5, -1.0, -1.5])
def test_reward_table_by_hand(n, r_neg):
  want = [{N: r_neg, O: 0.7, T: 1.0}[c] for c in HAND_TABLES[n]]
  got = bt.leaf_rewards(4, "LLRL", n, r_neg)
  assert got.dtype == np.float32 and got.shape == (16,)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
  assert np.allclose(bt.TreeTask(prefix_len=n, neg_reward=r_neg).rewards(), want)


@pytest.mark.parametrize("target", ["RLRR", "LLLL", "RRRRR", "LR"])
@pytest.mark.parametrize("n", [1, 2])
def test_reward_table_brute_force(target, n):
  depth = len(target)
  paths = ["".join(p) for p in itertools.product("LR", repeat=depth)]  # lexicographic = leaf order
  want = [1.0 if p == target else (-1.5 if p[:n] == target[:n] else 0.3) for p in paths]
  got = bt.leaf_rewards(depth, target, n, -1.5, other_reward=0.3)
  np.testing.assert_allclose(got, want)
  assert [bt.path_str(a) for a in bt.leaf_actions(depth)] == paths


def test_task_validation():
  with pytest.raises(ValueError, match="prefix length"):
    bt.TreeTask(depth=2, prefix_len=3, target="LL")
  with pytest.raises(ValueError, match="L/R"):
    bt.TreeTask(target="LLXL")
  with pytest.raises(ValueError, match="depth"):
    bt.TreeTask(depth=3, target="LLRL")
  assert bt.TreeTask(target="llrl").target_leaf == 2


def test_process_set_sizes_of_tree_paths():
  paths = ["LLRL", "LLRL", "LLRR", "LRLL", "RRRR", "RRRL", "RLLL", "LLLL"]
  tokens = jnp.asarray([bt.parse_path(p) for p in paths], jnp.int32)
  mask = jnp.ones(tokens.shape, bool)
  want = np.array(
    [  # by hand: 5 paths start with L, 3 with R
      [5, 4, 3, 2],
      [5, 4, 3, 2],
      [5, 4, 3, 1],
      [5, 1, 1, 1],
      [3, 2, 2, 1],
      [3, 2, 2, 1],
      [3, 1, 1, 1],
      [5, 4, 1, 1],
    ]
  )
  got = process_set_sizes(tokens, mask, jnp.zeros(8, jnp.int32), max_group_size=8)
  np.testing.assert_array_equal(np.asarray(got), want)
  # the token weights the training loop uses are 1/|λ|
  cfg = preset("lambda_grpo")
  rewards = jnp.asarray(bt.leaf_rewards(4, "LLRL", 1, -1.0))[
    jnp.asarray([bt.leaf_index(bt.parse_path(p)) for p in paths])
  ]
  _, w = rollout_advantages(cfg, rewards, tokens, mask, jnp.zeros(8, jnp.int32), 1, max_group_size=8)
  np.testing.assert_allclose(np.asarray(w), 1.0 / want, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------------


def test_tabular_leaf_logp_brute_force():
  pol = bt.TabularPolicy(depth=3, init_scale=1.0)
  params = pol.init(jax.random.key(3))
  table = np.asarray(params, np.float64)
  got = np.asarray(pol.leaf_logp(params))
  for leaf, acts in enumerate(itertools.product([0, 1], repeat=3)):
    node = 0  # heap order: children of k are 2k+1 (L), 2k+2 (R)
    for t, a in enumerate(acts):
      z = table[node]
      want = z[a] - np.log(np.exp(z).sum())
      assert got[leaf, t] == pytest.approx(want, abs=1e-5)
      node = 2 * node + 1 + a
  assert np.exp(got.sum(-1)).sum() == pytest.approx(1.0, abs=1e-5)


def test_transformer_leaf_logp_matches_per_path_forward():
  from flax import nnx

  pol = bt.make_policy("gpt2", depth=3, hidden_size=16, num_layers=1, num_heads=2, vocab_size=5)
  acts = bt.leaf_actions(3)
  seqs = np.concatenate([np.full((8, 1), bt.BOS), acts[:, :-1]], axis=1)  # one row per leaf

  @jax.jit  # one program (eager, every op of the init and the forwards compiles on its first call)
  def run(key, seqs):
    params = jax.tree.map(lambda x: x * 8.0, pol.init(key))  # far from uniform, so the test can fail
    model = nnx.merge(pol.graphdef(), params)
    hidden, _ = model(seqs, jnp.broadcast_to(jnp.arange(3), seqs.shape))  # the plain per-path forward
    return pol.leaf_logp(params), model.logits(hidden)

  got, logits = run(jax.random.key(0), jnp.asarray(seqs))
  got = np.asarray(got)
  logits = np.asarray(logits, np.float64)[..., :2]  # L/R entries only
  top = logits.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
  want = np.take_along_axis(logits, acts[..., None], -1)[..., 0] - lse
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert np.exp(got.sum(-1)).sum() == pytest.approx(1.0, abs=1e-5)
  assert np.ptp(got) > 1.0


# ----------------------------------------------------------------------------------------------------
# The jitted loop
# ----------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=16, num_layers=1, num_heads=2)
# seed 0 twice: "same seed, same run" is read off every sweep of this shape
SHORT = dict(seeds=[0, 1, 0], cells=[(1, -1.0), (2, -0.5)], steps=4, group_size=4)


@functools.cache
def _short_tabular(algorithm):
  """The tabular policy's SHORT sweep under plain SGD (lr 1): one compilation of the single-algorithm
  program per algorithm, shared by the tests below (the separate runs the multi-algorithm sweep is
  compared with). Algorithms ``tuple``: the multi-algorithm sweep."""
  pol = bt.make_policy("tabular", init_scale=0.5)  # random init: seeds differ from step 0
  algorithm = list(algorithm) if isinstance(algorithm, tuple) else algorithm
  return bt.run_sweep(algorithm, pol, bt.make_optimizer("sgd", 1.0), **SHORT)


@pytest.mark.parametrize("algorithm", bt.ALGORITHMS)
def test_short_run_deterministic_per_seed(algorithm):
  out = _short_tabular(algorithm)
  assert out["target_prob"].shape == (2, 3, 4)
  for k in out:
    np.testing.assert_array_equal(out[k][:, 0], out[k][:, 2])  # same seed, same run
    assert np.all(np.isfinite(out[k]))
  assert not np.array_equal(out["target_prob"][:, 0], out["target_prob"][:, 1])  # seeds differ
  assert not np.allclose(out["target_prob"][:, :, 0], out["target_prob"][:, :, -1])  # it learns


def test_algorithms_in_one_compilation_match_separate_runs():
  """Every algorithm as a branch of the one-compilation sweep equals its separate run (the separately
  compiled single-algorithm program), and the branches differ."""
  multi = _short_tabular(bt.ALGORITHMS)
  assert multi["target_prob"].shape == (len(bt.ALGORITHMS), 2, 3, 4)
  assert all(np.all(np.isfinite(v)) for v in multi.values())
  for i, a in enumerate(bt.ALGORITHMS):
    one = _short_tabular(a)
    for k in one:
      np.testing.assert_allclose(multi[k][i], one[k], rtol=1e-5, atol=1e-6, err_msg=f"{a}: {k}")
  lam, frpo = bt.ALGORITHMS.index("lambda_grpo"), bt.ALGORITHMS.index("frpo")
  assert not np.allclose(multi["target_prob"][lam], multi["target_prob"][frpo])  # the branches differ


def test_new_losses_share_one_compilation_with_grpo():
  """GSPO, GSPO-token, CISPO, SAPO and GMPO as branches of the one-compilation sweep equal their
  separate runs (test above). On this task they also equal GRPO: μ = 1 makes every ratio 1, where each of them has
  GRPO's gradient −A·∇log π (SAPO's gate slope and CISPO's weight are 1), and every trajectory has
  `depth` tokens, so the per-sequence and per-token means weigh tokens alike."""
  multi = _short_tabular(bt.ALGORITHMS)
  grpo = multi["target_prob"][bt.ALGORITHMS.index("grpo")]
  for a in ["gspo", "gspo_token", "cispo", "sapo", "gmpo"]:
    np.testing.assert_allclose(multi["target_prob"][bt.ALGORITHMS.index(a)], grpo, rtol=1e-4, atol=1e-6, err_msg=a)
    np.testing.assert_allclose(_short_tabular(a)["target_prob"], grpo, rtol=1e-4, atol=1e-6, err_msg=a)


@pytest.mark.slow  # four compilations of the tabular sweep: ~15 s idle, > 40 s on a loaded CPU
def test_a_vmapped_beta_grid_matches_separate_runs(tmp_path):
  """``grid={"beta": ...}``: one compilation for every β, each equal to the run whose config has that β
  as a constant (GRPO's KL in the loss switched on by the grid, FRPO's future-KL); then the CLI flag."""
  pol = bt.make_policy("tabular", init_scale=0.5)
  algos, betas = ["grpo", "frpo"], [0.0, 0.3]
  multi = bt.run_sweep(algos, pol, bt.make_optimizer("sgd", 1.0), **SHORT, grid={"beta": betas})
  assert multi["target_prob"].shape == (2, 2, 2, 3, 4)
  for i, h in ((0, 1), (1, 0)):  # GRPO with its KL switched on by the grid; FRPO at β = 0
    a, beta = algos[i], betas[h]
    one = bt.run_sweep(bt.preset(a, beta=beta), pol, bt.make_optimizer("sgd", 1.0), **SHORT)
    for k in one:
      np.testing.assert_allclose(multi[k][i, h], one[k], rtol=1e-5, atol=1e-6, err_msg=f"{a} β={beta}: {k}")
  for i in range(len(algos)):
    assert not np.allclose(multi["loss"][i, 0], multi["loss"][i, 1])  # β changes the run
  summary = _script().main(
    "--policy tabular --optimizer sgd --lr 1.0 --seeds 2 --steps 3 --group-size 4 --cells 1:-1.0 "
    f"--algorithms grpo --grid beta=0,0.3 --quiet --no-plot --out {tmp_path}".split()
  )
  assert summary["config"]["algorithms"] == ["grpo@beta=0", "grpo@beta=0.3"]
  assert summary["config"]["grid"] == {"beta": [0.0, 0.3]}
  assert "GRPO [beta=0.3] (ours)" in (tmp_path / "table.md").read_text()


@pytest.mark.slow  # two compilations of the transformer's backward: ~15 s idle, > 60 s on a loaded CPU
def test_transformer_run_deterministic_and_batch_independent():
  pol = bt.make_policy("gpt2", **TINY)
  opt = bt.make_optimizer("adam", 1e-2)
  a = bt.run_sweep("lambda_frpo", pol, opt, **SHORT)
  assert np.all(np.isfinite(a["loss"])) and not np.array_equal(a["target_prob"][:, 0], a["target_prob"][:, 1])
  np.testing.assert_array_equal(a["target_prob"][:, 0], a["target_prob"][:, 2])  # same seed, same run
  # a separately compiled run of seed 1 alone reproduces seed 1 of the batch
  c = bt.run_sweep("lambda_frpo", pol, opt, **{**SHORT, "seeds": [1]})
  for k in a:
    np.testing.assert_allclose(c[k][:, 0], a[k][:, 1], rtol=1e-5, atol=1e-6, err_msg=k)


def test_objective_hook_plugs_into_the_sweep():
  """The sweep's loss is jaxgrpo.loop.iteration.rollout_loss with the train step's hooks: an objective that
  doubles the loss under plain SGD at half the learning rate is the same run (SGD is linear in the
  gradient), and rollout_loss equals the kernels composed by hand."""
  pol = bt.make_policy("tabular", init_scale=0.5)

  def doubled(config, logp, old_logp, advantages, mask, **kw):
    terms = objective_terms(config, logp, old_logp, advantages, mask, **kw)
    return terms._replace(numerator=2.0 * terms.numerator)

  want = _short_tabular("lambda_grpo")
  got = bt.run_sweep("lambda_grpo", pol, bt.make_optimizer("sgd", 0.5), objective_fn=doubled, **SHORT)
  for k in ("target_prob", "target_freq", "reward"):
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(got["loss"], 2 * want["loss"], rtol=1e-5, atol=1e-6)

  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 2, (6, 4)), jnp.int32)
  mask, gid = jnp.ones((6, 4), bool), jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)
  logp = jnp.asarray(-rng.random((6, 4)), jnp.float32)
  rewards = jnp.asarray(rng.random(6), jnp.float32)
  cfg = preset("lambda_grpo")
  loss, _ = rollout_loss(cfg, logp, logp, rewards, tokens, mask, gid, 2)
  adv, w = rollout_advantages(cfg, rewards, tokens, mask, gid, 2, old_logp=logp)
  want_loss, _ = finalize_terms(objective_terms(cfg, logp, logp, adv, mask, token_weights=w))
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)


def test_first_step_samples_uniform_tree():
  out = bt.run_sweep(
    "grpo",
    bt.make_policy("tabular"),
    bt.make_optimizer("sgd", 1e-9),
    seeds=range(64),
    cells=[(1, -1.0)],
    steps=1,
    group_size=16,
  )
  assert out["target_prob"][0, :, 0] == pytest.approx(1 / 16, abs=1e-6)
  freq = out["target_freq"][0, :, 0].mean()  # 1024 draws, p = 1/16: sd ≈ 0.0076
  assert abs(freq - 1 / 16) < 0.03
  # mean reward of the first groups ≈ the uniform tree's mean reward
  want = bt.leaf_rewards(4, "LLRL", 1, -1.0).mean()
  assert abs(out["reward"][0, :, 0].mean() - want) < 0.1


def test_tabular_lambda_grpo_moves_toward_target():
  out = bt.run_sweep(
    "lambda_grpo",
    bt.make_policy("tabular"),
    bt.make_optimizer("sgd", 1.0),
    seeds=range(8),
    cells=[(2, -0.5)],
    steps=150,
    group_size=16,
  )
  p = out["target_prob"][0]
  assert np.all(p[:, -1] > 1 / 16)
  assert p[:, -1].mean() > 0.5


def test_summarize_cell():
  m, (lo, hi) = bt.summarize_cell([0.0, 1.0])
  assert m == 0.5 and hi - m == pytest.approx(12.706 * np.sqrt(0.5) / np.sqrt(2))
  assert bt.summarize_cell([0.3]) == (0.3, (0.3, 0.3))


# ----------------------------------------------------------------------------------------------------
# The script's flag errors
# ----------------------------------------------------------------------------------------------------


def _script():
  spec = importlib.util.spec_from_file_location("binary_tree_script", ROOT / "scripts" / "binary_tree.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize(
  "argv, needle",
  [
    (["--depth", "1", "--cells", "2:-1.0"], "depth"),
    (["--group-size", "1"], "group size"),
    (["--algorithms", "grpo,ppo"], "unknown algorithm"),
    (["--policy", "gpt9"], "policy"),
    (["--cells", "1;-1"], "cells"),
    (["--seeds", "0"], "seeds"),
    (["--steps", "0"], "steps"),
    (["--grid", "gamma=1"], "--grid"),
    (["--grid", "beta=x"], "--grid"),
  ],
)
def test_bad_flags_one_line_error(argv, needle, capsys, tmp_path):
  with pytest.raises(SystemExit) as exc:
    _script().main(argv + ["--out", str(tmp_path)])
  assert exc.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "Traceback" not in err
  assert needle in err


# ----------------------------------------------------------------------------------------------------
# The phenomenon, end to end through the CLI (default transformer settings, fewer seeds and cells)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_transformer_reproduces_the_collapse(tmp_path):
  summary = _script().main(
    [
      "--seeds",
      "8",
      "--seed-offset",
      "500",
      "--cells",
      "1:-1.0,2:-1.5",
      "--algorithms",
      "grpo,lambda_grpo",
      "--quiet",
      "--no-plot",
      "--out",
      str(tmp_path),
    ]
  )
  results = __import__("json").loads((tmp_path / "results.json").read_text())
  assert results == __import__("json").loads(__import__("json").dumps(summary))
  by = {(c["prefix_len"], c["neg_reward"], c["algorithm"]): c for c in results["cells"]}
  for n, r in [(1, -1.0), (2, -1.5)]:
    g, lam = by[(n, r, "grpo")], by[(n, r, "lambda_grpo")]
    assert len(g["target_freq"]) == 8
    assert g["mean"] == pytest.approx(np.mean(g["target_freq"]), abs=1e-4)
    assert lam["mean"] > g["mean"] + 0.2, (n, r, g["mean"], lam["mean"])
  g = by[(1, -1.0, "grpo")]
  assert g["frac_seeds_sampling_target_early"] >= 0.5  # it samples T early ...
  assert g["frac_seeds_below_0.1"] >= 0.5  # ... then abandons it
  assert (tmp_path / "table.md").read_text().count("\n| 1 | -1 |") == 1
