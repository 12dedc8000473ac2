"""The binary-tree synthetic task of λ-GRPO (Sullivan & Koller, arXiv:2509.21154, §4 and Table 1).
One job: that experiment — the tree, its rewards, the policies, the exact whole-tree training step and the runs over
cells and seeds — in one module, so the paper's setting reads in one place (the CLI is ``binary_tree_cli``).

A trajectory is ``depth`` actions, each L (token 0) or R (token 1): a path from the root of a complete
binary tree to one of its ``2**depth`` leaves. One leaf path is the target ``T``. Rewards::

    r(T) = +1.0 (target_reward)
    r(p) = r_neg < 0    for every other path p sharing T's first n actions (n = prefix_len)
    r(p) = +0.7 (other_reward) for every remaining path

GRPO samples ``T`` early (it starts at ``2**-depth``) and then abandons it, because the process step
"T's first n actions" has a negative Monte-Carlo process reward that GRPO multiplies by ``|λ|``, the
number of group members that took it. λ-GRPO divides every token term by ``|λ|`` and converges to
``T``. The metric is the frequency of ``T`` among the samples of the last 50 training steps.

Leaves are numbered by their actions read as a binary number, first action most significant
(``LLRL`` → ``0b0010`` = 2). A tree node (internal, ``2**depth - 1`` of them) is numbered in heap
order: the node reached after ``t`` actions with prefix value ``v`` is ``2**t - 1 + v``.

Design (purejaxrl-style):

- *The whole tree in one forward.* A causal policy's action distribution at step ``t`` depends only on
  the ``t`` previous actions, so one forward pass over the ``2**(depth-1)`` distinct input rows
  ``[BOS, a_0, ..., a_{depth-2}]`` yields the distribution at every node, hence
  ``leaf_logp[ℓ, t] = log π(a_t(ℓ) | a_<t(ℓ))`` for all leaves ℓ (``f32[2**depth, depth]``). A group
  is sampled exactly from the leaf distribution; the sampled trajectories' per-token log-probs are rows
  of that table. ``jax.vjp`` keeps the forward's pullback, so a training step costs one forward and
  one backward over ``2**(depth-1) * depth`` tokens, whatever the group size.
- The loss is the library's own: ``rollout_advantages`` → ``objective_terms`` → ``finalize_terms``
  on the sampled ``int32[G, depth]`` tokens; its gradient with respect to the leaf table is pulled
  back to the parameters. μ = 1: ``old_logp = stop_gradient(logp)``; FRPO's reference is the initial
  policy (its leaf table is computed once).
- One ``jit`` per algorithm runs ``lax.scan`` over steps of a step ``vmap``-ped over cells
  (a cell = one ``(n, r_neg)``, i.e. one ``f32[2**depth]`` reward table) and seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.kernels.config import GRPOConfig, preset
from jaxgrpo.kernels.objective import objective_terms, rollout_advantages
from jaxgrpo.loop.iteration import rollout_loss
from jaxgrpo.models import GPT2Config, build_model

__all__ = [
  "ALGORITHMS",
  "GRID_FIELDS",
  "PAPER_CELLS",
  "PAPER_TABLE1",
  "POLICIES",
  "TabularPolicy",
  "TransformerPolicy",
  "TreeTask",
  "leaf_actions",
  "leaf_rewards",
  "make_optimizer",
  "make_policy",
  "make_sweep",
  "run_sweep",
  "summarize_cell",
]

L, R, BOS = 0, 1, 2
ALGORITHMS = ("grpo", "lambda_grpo", "frpo", "lambda_frpo", "dr_grpo", "gspo", "gspo_token", "cispo", "sapo", "gmpo")
POLICIES = ("gpt2", "gpt2-small", "tabular")
OPTIMIZERS = ("adam", "sgd")
MAX_DEPTH = 12

#: The paper's sweep: (n = prefix_len, r_neg).
PAPER_CELLS: tuple[tuple[int, float], ...] = ((1, -0.5), (1, -1.0), (1, -1.5), (2, -0.5), (2, -1.0), (2, -1.5))
#: λ-GRPO paper, Table 1: target frequency over the last 50 steps, mean of 5 seeds, (GRPO, λ-GRPO).
PAPER_TABLE1: dict[tuple[int, float], tuple[float, float]] = {
  (1, -0.5): (0.3995, 0.5663),
  (1, -1.0): (0.0000, 0.7535),
  (1, -1.5): (0.2000, 0.4463),
  (2, -0.5): (0.1980, 0.4292),
  (2, -1.0): (0.0488, 0.3612),
  (2, -1.5): (0.0000, 0.3820),
}


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------


def parse_path(path: str | Sequence[int], depth: int | None = None) -> tuple[int, ...]:
  """A path as a tuple of actions (0 = L, 1 = R) from ``"LLRL"`` or a sequence of 0/1."""
  if isinstance(path, str):
    bad = set(path.upper()) - {"L", "R"}
    if bad:
      raise ValueError(f"target path must be a string of L/R; got {path!r}")
    acts = tuple(L if c == "L" else R for c in path.upper())
  else:
    acts = tuple(int(a) for a in path)
    if any(a not in (L, R) for a in acts):
      raise ValueError(f"target path actions must be 0 (L) or 1 (R); got {path!r}")
  if depth is not None and len(acts) != depth:
    raise ValueError(f"target path {path!r} has {len(acts)} actions but depth={depth}")
  return acts


def path_str(actions: Sequence[int]) -> str:
  """``(0, 0, 1, 0)`` → ``"LLRL"``."""
  return "".join("LR"[int(a)] for a in actions)


def leaf_index(actions: Sequence[int]) -> int:
  """The leaf number of a path: its actions as a binary number, first action most significant."""
  out = 0
  for a in actions:
    out = 2 * out + int(a)
  return out


def leaf_actions(depth: int) -> np.ndarray:
  """``int32[2**depth, depth]``: row ℓ holds the actions of leaf ℓ (bit ``depth-1-t`` of ℓ at step t)."""
  _check_depth(depth)
  leaves = np.arange(2**depth)[:, None]
  shifts = np.arange(depth - 1, -1, -1)[None, :]
  return ((leaves >> shifts) & 1).astype(np.int32)


def leaf_rewards(
  depth: int,
  target: str | Sequence[int],
  prefix_len: int,
  neg_reward: float,
  *,
  other_reward: float = 0.7,
  target_reward: float = 1.0,
) -> np.ndarray:
  """``f32[2**depth]``: the outcome reward of every leaf.

  ``target_reward`` for the target; ``neg_reward`` for the other leaves whose first ``prefix_len``
  actions equal the target's; ``other_reward`` for the rest.
  """
  tgt = parse_path(target, depth)
  if not 1 <= prefix_len <= depth:
    raise ValueError(f"prefix length n must be in [1, depth={depth}]; got n={prefix_len}")
  acts = leaf_actions(depth)
  shares = np.all(acts[:, :prefix_len] == np.array(tgt[:prefix_len])[None, :], axis=1)
  out = np.where(shares, neg_reward, other_reward).astype(np.float32)
  out[leaf_index(tgt)] = target_reward
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeTask:
  """One binary-tree environment (a cell of the sweep is one ``(prefix_len, neg_reward)``).

  Attributes:
    depth: actions per trajectory (the paper: 4).
    target: the target path, ``"LLRL"``-style or 0/1 actions (the paper does not say which; any
      path is equivalent up to relabelling for the tabular policy).
    prefix_len: n, the number of the target's first actions shared by the negative paths.
    neg_reward: r_neg (< 0 in the paper; any float is accepted).
    other_reward: the reward of paths off the target's n-prefix (0.7).
    target_reward: the target's reward (1.0).
  """

  depth: int = 4
  target: str = "LLRL"
  prefix_len: int = 1
  neg_reward: float = -1.0
  other_reward: float = 0.7
  target_reward: float = 1.0

  def __post_init__(self):
    _check_depth(self.depth)
    object.__setattr__(self, "target", path_str(parse_path(self.target, self.depth)))
    if not 1 <= self.prefix_len <= self.depth:
      raise ValueError(f"prefix length n must be in [1, depth={self.depth}]; got n={self.prefix_len}")

  @property
  def target_leaf(self) -> int:
    return leaf_index(parse_path(self.target))

  def rewards(self) -> np.ndarray:
    """``f32[2**depth]`` leaf rewards (see :func:`leaf_rewards`)."""
    return leaf_rewards(
      self.depth,
      self.target,
      self.prefix_len,
      self.neg_reward,
      other_reward=self.other_reward,
      target_reward=self.target_reward,
    )


def _check_depth(depth):
  if not isinstance(depth, (int, np.integer)) or not 1 <= depth <= MAX_DEPTH:
    raise ValueError(f"depth must be an int in [1, {MAX_DEPTH}]; got {depth!r}")


# ----------------------------------------------------------------------------------------------------
# Policies: init(key) -> params, leaf_logp(params) -> f32[2**depth, depth]
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TabularPolicy:
  """A softmax per internal tree node: ``params`` is ``f32[2**depth - 1, 2]`` logits (heap order).

  Initialised to zeros (uniform) for every seed, so seeds differ only in their samples.
  """

  depth: int = 4
  init_scale: float = 0.0

  def init(self, key):
    """``f32[2**depth - 1, 2]`` logits: ``init_scale`` · N(0, 1) (zeros, i.e. uniform, by default)."""
    shape = (2**self.depth - 1, 2)
    return self.init_scale * jax.random.normal(key, shape, jnp.float32)

  def leaf_logp(self, params):
    """``f32[2**depth, depth]``: log π(a_t(ℓ) | a_<t(ℓ)) for every leaf ℓ and step t."""
    acts = leaf_actions(self.depth)
    leaves = np.arange(2**self.depth)[:, None]
    steps = np.arange(self.depth)[None, :]
    nodes = (2**steps - 1) + (leaves >> (self.depth - steps))  # [2^d, d]
    logp = jax.nn.log_softmax(params.astype(jnp.float32), axis=-1)  # [nodes, 2]
    return logp[nodes, acts]


@dataclasses.dataclass(frozen=True)
class TransformerPolicy:
  """A randomly initialised GPT-2-architecture transformer from :mod:`jaxgrpo.models`.

  Vocabulary ``{L: 0, R: 1, BOS: 2}`` (``vocab_size`` may be larger; extra ids are never used); the
  root is the BOS token; every logit but L/R is masked to ``-inf`` before the log-softmax.
  ``params`` is the ``nnx.State`` of the model (``nnx.split`` once; pure functions of the state).
  """

  depth: int = 4
  hidden_size: int = 32
  num_layers: int = 2
  num_heads: int = 4
  vocab_size: int = 3

  @property
  def model_config(self) -> GPT2Config:
    """The GPT-2 config of this policy (context ``depth`` positions)."""
    return GPT2Config(
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      max_position_embeddings=max(self.depth, 1),
    )

  def init(self, key):
    """The ``nnx.State`` of a freshly initialised model (GPT-2 init: N(0, 0.02²) weights)."""
    return nnx.split(build_model(self.model_config, rngs=nnx.Rngs(params=key)))[1]

  def num_params(self) -> int:
    state = jax.eval_shape(self.init, jax.random.key(0))
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))

  def graphdef(self):
    """The model's ``nnx.GraphDef``, built abstractly once per policy configuration."""
    return _graphdef(self)

  def leaf_logp(self, params):
    """``f32[2**depth, depth]`` from one forward over the ``2**(depth-1)`` distinct input rows."""
    model = nnx.merge(self.graphdef(), params)
    d = self.depth
    rows = leaf_actions(d)[::2, :-1]  # [2^(d-1), d-1]
    inputs = np.concatenate([np.full((rows.shape[0], 1), BOS, np.int32), rows], axis=1)
    positions = np.broadcast_to(np.arange(d, dtype=np.int32), inputs.shape)
    hidden, _ = model(jnp.asarray(inputs), jnp.asarray(positions))  # [2^(d-1), d, D]
    logits = model.logits(hidden, out_dtype=jnp.float32)  # [2^(d-1), d, V]
    allowed = jnp.arange(logits.shape[-1]) < 2
    logp = jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)[..., :2]
    acts = leaf_actions(d)
    leaves = np.arange(2**d)
    return logp[(leaves >> 1)[:, None], np.arange(d)[None, :], acts]  # [2^d, d]


@functools.cache
def _graphdef(policy: TransformerPolicy):
  abstract = nnx.eval_shape(lambda: build_model(policy.model_config, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


def make_policy(name: str, depth: int = 4, **overrides):
  """``"gpt2"`` (small default transformer), ``"gpt2-small"`` (D=768, 12 layers, 12 heads, the
  paper's size, random init) or ``"tabular"``. ``overrides`` replace dataclass fields."""
  if name == "tabular":
    return TabularPolicy(depth=depth, **overrides)
  if name == "gpt2":
    return TransformerPolicy(depth=depth, **overrides)
  if name == "gpt2-small":
    return TransformerPolicy(depth=depth, **{**dict(hidden_size=768, num_layers=12, num_heads=12), **overrides})
  raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
  """``"adam"`` (optax defaults b1=0.9, b2=0.999, eps=1e-8) or ``"sgd"`` (plain, no momentum)."""
  if not learning_rate > 0:
    raise ValueError(f"learning rate must be > 0; got {learning_rate}")
  if name == "adam":
    return optax.adam(learning_rate)
  if name == "sgd":
    return optax.sgd(learning_rate)
  raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


# ----------------------------------------------------------------------------------------------------
# Training: one jitted function per algorithm, scan over steps of a step vmapped over cells × seeds
# ----------------------------------------------------------------------------------------------------


def _algorithm_config(algorithm: str | GRPOConfig) -> GRPOConfig:
  if isinstance(algorithm, GRPOConfig):
    return algorithm
  if algorithm not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
  return preset(algorithm)


def make_sweep(
  algorithms: str | GRPOConfig | Sequence[str | GRPOConfig],
  policy,
  optimizer: optax.GradientTransformation,
  *,
  depth: int,
  target_leaf: int,
  group_size: int,
  steps: int,
  progress: Callable[[int], None] | None = None,
  objective_fn: Callable = objective_terms,
  advantages_fn: Callable = rollout_advantages,
  grid: Mapping[str, Sequence[float]] | None = None,
):
  """A jitted ``run(seeds int32[S], rewards f32[C, 2**depth]) -> dict of f32[(A,) (H,) C, S, steps]``.

  Every (algorithm, cell, seed) triple is an independent training run of ``steps`` steps with one
  group of ``group_size`` trajectories per step. A seed fixes the policy's initial parameters and
  the sampling keys (the same across cells and algorithms: common random numbers).

  ``algorithms``: one preset name (or ``GRPOConfig``): outputs are ``[C, S, steps]``; or a sequence
  of them: outputs are ``[A, C, S, steps]``. Several algorithms share one compilation: the policy's
  forward/backward is ``vmap``-ped over them and each algorithm's loss
  (:func:`jaxgrpo.loop.iteration.rollout_loss`: ``advantages_fn`` → ``objective_fn`` → ``finalize_terms``
  under its own config, the train step's hooks and defaults) is a branch of ``lax.switch`` on the
  algorithm's index. Under ``vmap`` every branch is evaluated and
  selected, which costs little: the branches see only ``[G, depth]`` arrays.

  Returned per-step metrics: ``target_freq`` (fraction of the group equal to the target),
  ``target_prob`` (π(target), the expected frequency), ``reward`` (group mean reward), ``loss``.

  ``progress``: called on the host with the step index (``jax.debug.callback``) after each step.

  ``grid``: ``{name: H values}`` for one or more of :data:`GRID_FIELDS` (β, ε_low, ε_high; several
  names are zipped, equal lengths): the H values are traced inputs of every algorithm's objective
  (:meth:`GRPOConfig.hyper`, the train step's ``hyper``) and the whole sweep is ``vmap``-ped over
  them — one compilation for the grid, outputs ``[(A,) H, C, S, steps]``. A β grid with a value > 0
  switches the KL term on for an algorithm whose preset has β = 0 (its KL estimator and placement
  unchanged). None (the default): the configs' numbers as constants, outputs as without a grid.
  """
  single = isinstance(algorithms, (str, GRPOConfig))
  configs = [_algorithm_config(a) for a in ([algorithms] if single else algorithms)]
  if not configs:
    raise ValueError("no algorithm given")
  for config in configs:
    if config.num_iterations != 1:
      raise ValueError("the binary-tree task runs μ = 1 (one update per rollout batch)")
  if group_size < 2:
    raise ValueError(f"group size must be >= 2; got {group_size}")
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be a positive int; got {steps!r}")
  grid = check_grid(grid)
  if grid is not None:
    configs = [switch_on(c, grid) for c in configs]
  actions = jnp.asarray(leaf_actions(depth))
  mask = jnp.ones((group_size, depth), bool)
  group_ids = jnp.zeros((group_size,), jnp.int32)
  sg = jax.lax.stop_gradient

  def init(seed):
    key = jax.random.key(seed)
    params = policy.init(jax.random.fold_in(key, 0))
    return (params, optimizer.init(params)), sg(policy.leaf_logp(params))

  def loss_and_grad(config, table, leaves, tokens, rewards, ref_logp, values):
    """The library's objective for one sampled group; gradient w.r.t. the leaf log-prob table."""
    extras = {} if grid is None else {"hyper": config.hyper(**values)}  # values: {name: f32[]}

    def loss_fn(tab):
      logp = tab[leaves]  # [G, d]; μ = 1: the rollout policy is the current one
      return rollout_loss(
        config,
        logp,
        sg(logp),
        rewards,
        tokens,
        mask,
        group_ids,
        1,
        ref_logp=ref_logp,
        max_group_size=group_size,
        objective_fn=objective_fn,
        advantages_fn=advantages_fn,
        **extras,
      )

    (loss, _), g_table = jax.value_and_grad(loss_fn, has_aux=True)(table)
    return loss, g_table

  branches = [functools.partial(loss_and_grad, c) for c in configs]

  def step(carry, ref_table, rewards_table, key, algo, values):
    params, opt_state = carry
    table, pullback = jax.vjp(policy.leaf_logp, params)  # [2^d, d]
    seq_logp = jnp.sum(sg(table), axis=-1)  # [2^d]
    leaves = jax.random.categorical(key, seq_logp, shape=(group_size,))
    tokens = actions[leaves]  # [G, d]
    rewards = rewards_table[leaves]  # [G]
    operands = (table, leaves, tokens, rewards, ref_table[leaves], values)
    if len(branches) == 1:
      loss, g_table = branches[0](*operands)
    else:
      loss, g_table = jax.lax.switch(algo, branches, *operands)
    (g_params,) = pullback(g_table)
    updates, opt_state = optimizer.update(g_params, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {
      "target_freq": jnp.mean((leaves == target_leaf).astype(jnp.float32)),
      "target_prob": jnp.exp(seq_logp[target_leaf]),
      "reward": jnp.mean(rewards),
      "loss": loss,
    }
    return (params, opt_state), metrics

  # algorithms × (grid ×) cells × seeds: seeds vary (carry, ref, key); cells (carry, rewards); grid
  # values (carry, values); algorithms (carry, index).
  vstep = jax.vmap(step, in_axes=(0, 0, None, 0, None, None))
  vstep = jax.vmap(vstep, in_axes=(0, None, 0, None, None, None))
  if grid is not None:
    vstep = jax.vmap(vstep, in_axes=(0, None, None, None, None, 0))
  vstep = jax.vmap(vstep, in_axes=(0, None, None, None, 0, None))
  num_algos = len(configs)
  values = {} if grid is None else {n: jnp.asarray(v, jnp.float32) for n, v in grid.items()}  # f32[H] each
  grid_lead = () if grid is None else (len(next(iter(grid.values()))),)

  @jax.jit
  def run(seeds, rewards):
    lead = (num_algos, *grid_lead, rewards.shape[0])
    carry, ref = jax.vmap(init)(seeds)
    carry = jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), carry)
    keys = jax.vmap(lambda s: jax.random.split(jax.random.fold_in(jax.random.key(s), 1), steps))(seeds)
    algos = jnp.arange(num_algos)

    def body(c, xs):
      i, k = xs
      c, m = vstep(c, ref, rewards, k, algos, values)
      if progress is not None:
        jax.debug.callback(progress, i)
      return c, m

    _, metrics = jax.lax.scan(body, carry, (jnp.arange(steps), jnp.swapaxes(keys, 0, 1)))
    metrics = jax.tree.map(lambda x: jnp.moveaxis(x, 0, -1), metrics)  # [A, (H,) C, S, steps]
    return jax.tree.map(lambda x: x[0], metrics) if single else metrics

  return run


#: The numbers a binary-tree sweep can take as a vmapped grid (``make_sweep(..., grid=)``).
GRID_FIELDS = ("beta", "clip_eps_low", "clip_eps_high")


def check_grid(grid):
  """``{name: tuple of floats}`` (names in GRID_FIELDS, equal non-zero lengths), or None."""
  if grid is None:
    return None
  grid = {name: tuple(float(v) for v in values) for name, values in dict(grid).items()}
  bad = sorted(set(grid) - set(GRID_FIELDS))
  if not grid or bad:
    raise ValueError(f"grid names must be some of {', '.join(GRID_FIELDS)}; got {sorted(grid) or 'none'}")
  lengths = {len(v) for v in grid.values()}
  if len(lengths) != 1 or 0 in lengths:
    raise ValueError(f"grid values must be non-empty and of one length (they are zipped); got {grid}")
  return grid


def switch_on(config: GRPOConfig, grid) -> GRPOConfig:
  """``config`` with its KL term on when a β of the grid is > 0 (the structure; the value is traced)."""
  top = max(grid.get("beta", (0.0,)))
  return config.replace(beta=top) if config.beta == 0 and top > 0 else config


def run_sweep(
  algorithm,
  policy,
  optimizer,
  *,
  seeds: Sequence[int],
  cells: Sequence[tuple[int, float]],
  depth: int = 4,
  target: str = "LLRL",
  other_reward: float = 0.7,
  group_size: int = 16,
  steps: int = 250,
  progress=None,
  objective_fn: Callable = objective_terms,
  advantages_fn: Callable = rollout_advantages,
  grid: Mapping[str, Sequence[float]] | None = None,
) -> dict:
  """Train every (cell, seed) under ``algorithm``: numpy arrays ``[C, S, steps]`` per metric, or
  ``[A, C, S, steps]`` when ``algorithm`` is a sequence (one compilation for all; see :func:`make_sweep`).
  ``objective_fn``/``advantages_fn``: the train step's hooks (default: the presets' objective).
  ``grid``: a vmapped β/ε grid (:func:`make_sweep`), adding an ``H`` axis before ``C``."""
  tasks = [
    TreeTask(depth=depth, target=target, prefix_len=n, neg_reward=r, other_reward=other_reward) for n, r in cells
  ]
  rewards = np.stack([t.rewards() for t in tasks])
  run = make_sweep(
    algorithm,
    policy,
    optimizer,
    depth=depth,
    target_leaf=tasks[0].target_leaf,
    group_size=group_size,
    steps=steps,
    progress=progress,
    objective_fn=objective_fn,
    advantages_fn=advantages_fn,
    grid=grid,
  )
  out = run(jnp.asarray(np.asarray(seeds, np.int32)), jnp.asarray(rewards))
  return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


# ----------------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------------

_T975 = {
  1: 12.706,
  2: 4.303,
  3: 3.182,
  4: 2.776,
  5: 2.571,
  6: 2.447,
  7: 2.365,
  8: 2.306,
  9: 2.262,
  10: 2.228,
  11: 2.201,
  12: 2.179,
  13: 2.160,
  14: 2.145,
  15: 2.131,
  16: 2.120,
  17: 2.110,
  18: 2.101,
  19: 2.093,
  20: 2.086,
  25: 2.060,
  30: 2.042,
  40: 2.021,
  60: 2.000,
  120: 1.980,
}


def t_quantile_975(df: int) -> float:
  """Student-t 97.5% quantile (table; the next smaller tabulated df beyond 20, 1.96 beyond 120)."""
  if df < 1:
    return float("nan")
  if df > 120:
    return 1.96
  return _T975[max(k for k in _T975 if k <= df)]


def summarize_cell(per_seed: Sequence[float]) -> tuple[float, tuple[float, float]]:
  """Mean and Student-t 95% confidence interval of per-seed values (CI = the mean when S = 1)."""
  x = np.asarray(per_seed, np.float64)
  m = float(x.mean())
  if x.size < 2:
    return m, (m, m)
  half = t_quantile_975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
  return m, (m - half, m + half)
