"""The sharded GRPO-family train step: one jitted ``(state, batch) -> (state, metrics)``.

Per call (one rollout batch), inside one compiled program:

1. rollout-level quantities, once: outcome advantages of the preset, FRPO's future-KL advantage
   (from the rollout and reference log-probs), λ-GRPO's ``1/|λ|`` token weights
   (:func:`jaxgrpo.objective.rollout_advantages`) and the process-tree statistics;
2. μ (``GRPOConfig.num_iterations``) passes over the batch, each split into ``mini_batches``
   optimizer updates (PPO-style); ratios are always taken against the rollout log-probs;
3. each update accumulates gradients over ``micro_batches`` (``lax.scan``): the loss of a mini-batch
   is ``Σ_k numerator_k / denominator`` where the denominator (it does not depend on the parameters)
   is computed first, so the update equals the full-batch update for every aggregation mode;
4. clipping by global norm and the optax update.

Rows are assigned to mini/micro-batches by ``row = i·(M·K) + m·K + k`` (mini-batch m, micro-batch k),
so the split is the same on every mesh and stays local to each device's rows.

The model is split once (``nnx.split``) and the step is a plain function of
``(graphdef, TrainState, Batch)``, jitted with explicit shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo import sharding as shd
from jaxgrpo.config import GRPOConfig
from jaxgrpo.losses import LossTerms, combine_terms, finalize_terms
from jaxgrpo.models.base import positions_from_mask
from jaxgrpo.objective import objective_terms, rollout_advantages
from jaxgrpo.process_sets import process_set_sizes, process_tree_stats

__all__ = [
  "Batch",
  "TrainConfig",
  "TrainState",
  "TrainStep",
  "bucket_length",
  "completion_log_probs",
  "init_train_state",
  "make_reference_fn",
  "make_train_step",
  "pad_to_bucket",
]

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Batch(NamedTuple):
  """One rollout batch (B = N trajectories, P prompt slots, T completion slots).

  Attributes:
    prompt_tokens: ``int32[B, P]`` left-padded prompts (``Rollout.prompt_tokens``), P >= 1.
    prompt_mask: ``bool[B, P]`` real prompt tokens.
    completions: ``int32[B, T]`` sampled tokens, right-padded.
    mask: ``bool[B, T]`` real completion tokens.
    old_logp: ``f32[B, T]`` rollout-policy log-probs of the completions (``Rollout.log_probs``).
    group_ids: ``int32[B]`` prompt index of each row.
    rewards: ``f32[B]`` outcome rewards r_i.
    ref_logp: ``f32[B, T]`` reference-model log-probs (:func:`make_reference_fn`), or None when the
      preset needs none (β = 0).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completions: jax.Array
  mask: jax.Array
  old_logp: jax.Array
  group_ids: jax.Array
  rewards: jax.Array
  ref_logp: jax.Array | None = None

  @classmethod
  def from_rollout(cls, rollout, rewards, ref_logp=None) -> "Batch":
    """A batch from a ``jaxgrpo.sampling.Rollout`` and its ``f32[N]`` rewards."""
    return cls(
      rollout.prompt_tokens,
      rollout.prompt_mask,
      rollout.completions,
      rollout.mask,
      rollout.log_probs,
      rollout.group_ids,
      jnp.asarray(rewards, jnp.float32),
      ref_logp,
    )


class TrainState(NamedTuple):
  """``params``: the model's ``nnx.State``; ``opt_state``: optax state; ``step``: ``int32[]`` calls
  of the train step so far."""

  params: Any
  opt_state: Any
  step: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """How the step is executed (the objective itself is the :class:`~jaxgrpo.config.GRPOConfig`).

  Attributes:
    micro_batches: K, gradient-accumulation steps per optimizer update (same update for any K).
    mini_batches: M, optimizer updates per pass over the batch (PPO mini-batches); μ passes are
      made (``GRPOConfig.num_iterations``), so a step makes μ·M updates.
    max_grad_norm: clip the gradient to this global norm (None: no clipping).
    temperature: the sampling temperature the log-probs refer to.
    chunk_size: positions per chunk of the float32 logits (None: unchunked). A chunk holds
      ``rows per micro-batch × chunk_size × V`` float32 logits: aim for a few thousand tokens (64 rows ×
      32 positions at V = 32000 is 262 MB; 64 × 128 was 1 GB per chunk and a slower step).
    group_size: G, the largest group (bounds ``process_set_sizes``' work; None: B, always correct).
    tree_stats: compute the process-tree statistics for presets without λ weights too (the λ presets
      always report them: they come free from the weights).
    entropy: report the policy entropy (one extra pass over each logits chunk, no gradient).
    compiler_options: XLA options for compiling the step and the reference pass (None: defaults),
      e.g. ``{"xla_backend_optimization_level": 0}`` compiles about twice as fast on CPU (tests).
  """

  micro_batches: int = 1
  mini_batches: int = 1
  max_grad_norm: float | None = 1.0
  temperature: float = 1.0
  chunk_size: int | None = 256
  group_size: int | None = None
  tree_stats: bool = False
  entropy: bool = True
  compiler_options: Mapping[str, Any] | None = None

  def __post_init__(self):
    for name in ("micro_batches", "mini_batches"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"`{name}` must be an int >= 1; got {v!r}")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError(f"`max_grad_norm` must be > 0 or None; got {self.max_grad_norm}")
    if not self.temperature > 0:
      raise ValueError(f"`temperature` must be > 0; got {self.temperature}")
    if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size < 1):
      raise ValueError(f"`chunk_size` must be a positive int or None; got {self.chunk_size!r}")
    if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
      raise ValueError(f"`group_size` must be a positive int or None; got {self.group_size!r}")


# ----------------------------------------------------------------------------- log-probs


def _chunked_logp_entropy(model, hidden, targets, temperature, chunk_size, with_entropy):
  """``(logp f32[B, T], entropy f32[B, T] or None)`` from hidden ``[B, T, D]``; the float32 logits
  exist one ``[B, C, V]`` chunk at a time and are recomputed in the backward pass."""
  b, t, d = hidden.shape

  @jax.checkpoint
  def chunk(args):
    h, tgt = args
    logits = model.logits(h, out_dtype=jnp.float32) / temperature  # [B, C, V] f32
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
      return logp, None
    sl, slse = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    ent = slse - jnp.sum(jnp.exp(sl - slse[..., None]) * sl, axis=-1)  # H = lse - Σ p·z
    return logp, ent

  if chunk_size is None or chunk_size >= t:
    return chunk((hidden, targets))
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk_size, d).swapaxes(0, 1)
  tgt = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk_size).swapaxes(0, 1)
  logp, ent = jax.lax.map(chunk, (h, tgt))  # [n, B, C]
  unchunk = lambda x: None if x is None else x.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]
  return unchunk(logp), unchunk(ent)


def completion_log_probs(
  model,
  prompt_tokens,
  prompt_mask,
  completions,
  mask,
  *,
  temperature=1.0,
  chunk_size: int | None = 256,
  with_entropy: bool = False,
):
  """Log-probs (and optionally entropies) of the completion tokens given their prompts.

  One forward over ``[prompt ‖ completion]`` (positions from the joint mask); only the T completion
  positions go through the LM head, in float32 chunks.

  Args:
    model: a ``jaxgrpo.models`` causal LM.
    prompt_tokens: ``int32[B, P]`` (left-padded); prompt_mask: ``bool[B, P]``.
    completions: ``int32[B, T]``; mask: ``bool[B, T]``.

  Returns:
    ``(logp f32[B, T], entropy f32[B, T] or None)``, both 0 where ``mask`` is False. The entropy is
    that of the temperature-scaled policy, without gradient.
  """
  p = prompt_tokens.shape[1]
  if p < 1:
    raise ValueError(f"`prompt_tokens` must have at least one column; got shape {prompt_tokens.shape}")
  tokens = jnp.concatenate([prompt_tokens, completions], axis=1).astype(jnp.int32)  # [B, P+T]
  attn = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
  hidden, _ = model(tokens, positions_from_mask(attn), attention_mask=attn)
  h = hidden[:, p - 1 : -1]  # predicts completions[:, t]
  logp, ent = _chunked_logp_entropy(model, h, completions.astype(jnp.int32), temperature, chunk_size, with_entropy)
  logp = jnp.where(mask, logp, 0.0)
  ent = None if ent is None else jnp.where(mask, ent, 0.0)
  return logp, ent


# ----------------------------------------------------------------------------- state


def _check_params_only(state):
  others = [p for p, v in nnx.to_flat_state(state) if not isinstance(v, nnx.Param)]
  if others:
    raise ValueError(
      f"the model holds non-parameter state {others[:5]}; the train step optimizes every "
      "variable of the model, so it must hold only nnx.Param"
    )


def _copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


def init_train_state(
  model, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Mapping[str, Any] | None = None
):
  """Split ``model`` once and place its parameters and a fresh optimizer state on ``mesh``.

  Returns:
    ``(graphdef, state, shardings)``: the static graph, a :class:`TrainState` whose parameters and
    optimizer moments are sharded by the logical-axis ``rules`` (FSDP over ``fsdp``, tensor
    parallelism over ``tensor``), and the matching :class:`TrainState` of shardings (for
    :func:`make_train_step`). Raises ValueError (before anything is compiled) for any dimension the
    mesh does not divide, e.g. heads % tensor.
  """
  graphdef, params = nnx.split(model)
  _check_params_only(params)
  param_sh = shd.tree_shardings(params, mesh, rules)
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_sh = shd.tree_shardings(opt_abstract, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = TrainState(param_sh, opt_sh, replicated)
  params = jax.device_put(params, param_sh)
  # the step donates its state: copy, so that the model's own arrays are never donated
  params = jax.jit(_copy_tree, out_shardings=param_sh)(params)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return graphdef, TrainState(params, opt_state, step), shardings


# ----------------------------------------------------------------------------- the step


def _split_rows(x, m: int, k: int):
  """``[B, ...] -> [M, K, B/(M·K), ...]`` with row ``i·(M·K) + m·K + k`` at ``[m, k, i]``."""
  if x is None:
    return None
  b = x.shape[0]
  x = x.reshape((b // (m * k), m, k) + x.shape[1:])
  return jnp.moveaxis(x, 0, 2)


def _zero_terms(example: LossTerms) -> LossTerms:
  big = jnp.float32(jnp.finfo(jnp.float32).max)
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
  extrema = {k: (-big if k.endswith("_max") else big) for k in example.extrema}
  return LossTerms(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros(example.sums), extrema)


def _reduce_updates(metrics):
  """Metrics stacked over the μ·M updates -> one value each (max of maxima, min of minima, else mean)."""
  out = {}
  for k, v in metrics.items():
    v = v.reshape(-1)
    out[k] = jnp.max(v) if k.endswith("_max") else jnp.min(v) if k.endswith("_min") else jnp.mean(v)
  return out


def _step_fn(
  graphdef, optimizer, config: GRPOConfig, tc: TrainConfig, param_sh, rows_sh, state: TrainState, batch: Batch
):
  b, t = batch.completions.shape
  mm, kk = tc.mini_batches, tc.micro_batches
  g = b if tc.group_size is None else min(tc.group_size, b)
  num_groups = b if tc.group_size is None else -(-b // g)

  # 1. once per rollout batch (no gradient): advantages, λ weights, tree statistics.
  adv, weights = rollout_advantages(
    config,
    batch.rewards,
    batch.completions,
    batch.mask,
    batch.group_ids,
    num_groups,
    old_logp=batch.old_logp,
    ref_logp=batch.ref_logp,
    max_group_size=g,
  )
  tree = {}
  sizes = None
  if weights is not None:  # 1/|λ| exactly; |λ| is a small integer, so round(1/w) recovers it
    sizes = jnp.where(weights > 0, jnp.round(1.0 / jnp.where(weights > 0, weights, 1.0)), 0).astype(jnp.int32)
  elif tc.tree_stats:
    sizes = process_set_sizes(batch.completions, batch.mask, batch.group_ids, max_group_size=g)
  if sizes is not None:
    stats = process_tree_stats(batch.completions, batch.mask, batch.group_ids, num_groups, sizes=sizes)
    tree = {f"tree/{k}": v for k, v in stats.items()}
  kl_in_loss = config.kl_placement == "loss" and config.beta > 0
  rows = dict(
    prompt_tokens=batch.prompt_tokens,
    prompt_mask=batch.prompt_mask,
    completions=batch.completions,
    mask=batch.mask,
    old_logp=batch.old_logp,
    adv=adv,
    weights=weights,
    ref_logp=batch.ref_logp if kl_in_loss else None,
  )
  # [M, K, R, ...], R over data×fsdp: each device keeps its own rows
  rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(_split_rows(x, mm, kk), rows_sh), rows)

  def micro_terms(p, mb, den):
    model = nnx.merge(graphdef, p)
    logp, ent = completion_log_probs(
      model,
      mb["prompt_tokens"],
      mb["prompt_mask"],
      mb["completions"],
      mb["mask"],
      temperature=tc.temperature,
      chunk_size=tc.chunk_size,
      with_entropy=tc.entropy,
    )
    terms = objective_terms(
      config, logp, mb["old_logp"], mb["adv"], mb["mask"], token_weights=mb["weights"], ref_logp=mb["ref_logp"]
    )
    ent_sum = jnp.zeros((), jnp.float32) if ent is None else jnp.sum(ent)
    return terms.numerator / den, (terms, ent_sum)

  def denominator(mini):  # Σ_k denominator_k: depends on masks only, not on the parameters
    def one(mb):
      zeros = jnp.zeros_like(mb["old_logp"])
      return objective_terms(
        config, zeros, mb["old_logp"], mb["adv"], mb["mask"], token_weights=mb["weights"], ref_logp=mb["ref_logp"]
      ).denominator

    return jnp.sum(jax.vmap(one)(mini))

  example_mb = jax.tree.map(lambda x: x[0, 0], rows)
  terms_shape = jax.eval_shape(lambda p, mb: micro_terms(p, mb, jnp.float32(1))[1][0], state.params, example_mb)

  def update(carry, mini):  # mini: [K, R, ...]
    params, opt_state = carry
    den = denominator(mini)
    safe_den = jnp.where(den != 0, den, 1.0)
    grad_fn = jax.grad(micro_terms, has_aux=True)

    def accumulate(acc, mb):
      grads, terms, ent = acc
      g_k, (terms_k, ent_k) = grad_fn(params, mb, safe_den)
      grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grads, g_k)
      grads = jax.lax.with_sharding_constraint(grads, param_sh)
      return (grads, combine_terms(terms, terms_k), ent + ent_k), None

    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero_grads = jax.lax.with_sharding_constraint(zero_grads, param_sh)
    (grads, terms, ent), _ = jax.lax.scan(
      accumulate, (zero_grads, _zero_terms(terms_shape), jnp.zeros((), jnp.float32)), mini
    )
    grad_norm = optax.tree.norm(grads)
    if tc.max_grad_norm is not None:
      scale = jnp.where(grad_norm > tc.max_grad_norm, tc.max_grad_norm / jnp.maximum(grad_norm, 1e-30), 1.0)
      grads = jax.tree.map(lambda x: x * scale, grads)
    grads = jax.tree.map(lambda x, p: x.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    _, metrics = finalize_terms(terms)
    n = terms.sums["tokens"]
    metrics["entropy"] = jnp.where(n > 0, ent / jnp.where(n > 0, n, 1.0), 0.0)
    metrics["grad_norm"] = grad_norm
    return (params, opt_state), metrics

  def epoch(carry, _):
    return jax.lax.scan(update, carry, rows)

  (params, opt_state), metrics = jax.lax.scan(
    epoch, (state.params, state.opt_state), None, length=config.num_iterations
  )
  metrics = _reduce_updates(metrics)
  metrics.update(tree)
  return TrainState(params, opt_state, state.step + 1), metrics


def _options(tc: TrainConfig):
  return None if tc.compiler_options is None else dict(tc.compiler_options)


class TrainStep:
  """The compiled train step; call as ``state, metrics = step(state, batch)``.

  Created by :func:`make_train_step`. Shapes are validated in Python before the jitted call (clear
  ValueErrors, nothing compiled); ``traces`` counts how often the step was traced (the same shapes
  never retrace or recompile).
  """

  def __init__(
    self, graphdef, optimizer, config: GRPOConfig, mesh: Mesh, shardings: TrainState, train_config: TrainConfig, rules
  ):
    self.config, self.train_config, self.mesh, self.rules = config, train_config, mesh, rules
    self.shardings = shardings
    self.batch_sharding = shd.batch_sharding(mesh, rules)
    self.traces = 0

    batch_spec = self.batch_sharding.spec
    rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *batch_spec))

    def fn(state, batch):
      self.traces += 1
      return _step_fn(graphdef, optimizer, config, train_config, shardings.params, rows_sh, state, batch)

    replicated = NamedSharding(mesh, PartitionSpec())
    self.jitted = jax.jit(
      fn,
      in_shardings=(shardings, self.batch_sharding),
      out_shardings=(shardings, replicated),
      donate_argnums=0,
      compiler_options=_options(train_config),
    )

  def check_batch(self, batch: Batch) -> None:
    """ValueError unless ``batch`` fits this step (shapes, divisibility over data×fsdp and K·M)."""
    if not isinstance(batch, Batch):
      raise TypeError(f"batch must be a jaxgrpo.train.Batch; got {type(batch).__name__}")
    b, t = np.shape(batch.completions)
    expect = {
      "prompt_tokens": 2,
      "prompt_mask": 2,
      "completions": 2,
      "mask": 2,
      "old_logp": 2,
      "group_ids": 1,
      "rewards": 1,
      "ref_logp": 2,
    }
    for name, rank in expect.items():
      x = getattr(batch, name)
      if x is None:
        continue
      shape = np.shape(x)
      if len(shape) != rank or shape[0] != b:
        raise ValueError(f"batch.{name} must have rank {rank} and {b} rows; got shape {shape}")
    for name in ("mask", "old_logp") + (("ref_logp",) if batch.ref_logp is not None else ()):
      if np.shape(getattr(batch, name)) != (b, t):
        raise ValueError(
          f"batch.{name} must have shape {(b, t)} like completions; got {np.shape(getattr(batch, name))}"
        )
    if np.shape(batch.prompt_mask) != np.shape(batch.prompt_tokens):
      raise ValueError(
        f"batch.prompt_mask shape {np.shape(batch.prompt_mask)} != prompt_tokens shape {np.shape(batch.prompt_tokens)}"
      )
    if self.config.needs_reference and batch.ref_logp is None:
      raise ValueError(
        f"preset {self.config.name!r} (beta={self.config.beta}) needs batch.ref_logp: compute it with make_reference_fn"
      )
    tc = self.train_config
    shd.check_batch_divisible(b, self.mesh, self.rules, splits=tc.micro_batches * tc.mini_batches)

  def __call__(self, state: TrainState, batch: Batch):
    self.check_batch(batch)
    if not self.config.needs_reference and batch.ref_logp is not None:
      batch = batch._replace(ref_logp=None)  # not used: keep one compiled program
    return self.jitted(state, batch)


def make_train_step(
  graphdef,
  optimizer: optax.GradientTransformation,
  config: GRPOConfig,
  *,
  mesh: Mesh,
  shardings: TrainState,
  train_config: TrainConfig | None = None,
  rules: Mapping[str, Any] | None = None,
) -> TrainStep:
  """The jitted step ``(TrainState, Batch) -> (TrainState, metrics)`` for ``config`` on ``mesh``.

  Args:
    graphdef, shardings: from :func:`init_train_state`.
    optimizer: any optax transformation (clipping by global norm is done by the step,
      ``train_config.max_grad_norm``).
    config: the objective (a preset from ``jaxgrpo.config.preset``).
    train_config: micro/mini-batches, clipping, temperature, log-prob chunking.

  The state argument is donated. Metrics (replicated ``f32[]``, averaged over the μ·M updates,
  extrema over them): ``loss``, ``policy_loss``, ``kl``, ``clip_frac_low/high/dual``, ``approx_kl``
  (to the rollout policy), ``ratio_mean/min/max``, ``advantage_mean/std/min/max``, ``entropy``,
  ``grad_norm`` (before clipping), ``tokens``, ``sequences`` and, for λ presets or with
  ``tree_stats``, ``tree/nontrivial_group_fraction``, ``tree/mean_path_depth``,
  ``tree/intermediate_proportion``, ``tree/mean_process_set_size``.
  """
  if not isinstance(config, GRPOConfig):
    raise TypeError(f"config must be a GRPOConfig (jaxgrpo.config.preset(...)); got {type(config).__name__}")
  train_config = TrainConfig() if train_config is None else train_config
  return TrainStep(graphdef, optimizer, config, mesh, shardings, train_config, rules)


def make_reference_fn(
  graphdef,
  *,
  mesh: Mesh,
  param_shardings,
  train_config: TrainConfig | None = None,
  rules: Mapping[str, Any] | None = None,
) -> Callable:
  """Jitted ``(ref_params, batch) -> ref_logp f32[B, T]`` (batch-sharded) under the same mesh.

  ``ref_params`` has the policy's structure and shardings (e.g. a copy of the initial parameters).
  Only needed when the preset has β > 0 (``config.needs_reference``): GRPO's KL term in the loss or
  FRPO's future-KL; skip it otherwise. The rows are processed in ``train_config.micro_batches``
  sequential micro-batches (``lax.map``), exactly as the train step splits them, so the reference
  pass never holds more activations or logits chunks than one micro-batch of the step.
  """
  tc = TrainConfig() if train_config is None else train_config
  bsh = shd.batch_sharding(mesh, rules)
  rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *bsh.spec))
  k = tc.micro_batches

  def fn(params, batch):
    model = nnx.merge(graphdef, params)
    cols = (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)
    cols = [jax.lax.with_sharding_constraint(_split_rows(x, 1, k), rows_sh)[0] for x in cols]  # [K, R, ...]

    def one(mb):
      return completion_log_probs(model, *mb, temperature=tc.temperature, chunk_size=tc.chunk_size)[0]

    logp = jax.lax.map(one, tuple(cols))  # [K, R, T]
    return jnp.moveaxis(logp, 0, 1).reshape(batch.completions.shape)  # inverse of _split_rows

  jitted = jax.jit(fn, in_shardings=(param_shardings, bsh), out_shardings=bsh, compiler_options=_options(tc))

  def reference_log_probs(ref_params, batch: Batch):
    shd.check_batch_divisible(np.shape(batch.completions)[0], mesh, rules, splits=k)
    return jitted(ref_params, batch._replace(ref_logp=None))

  return reference_log_probs


# ----------------------------------------------------------------------------- bucketing


def bucket_length(length: int, buckets=DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= ``length`` (``length`` itself when it exceeds every bucket)."""
  fits = [b for b in sorted(buckets) if b >= length]
  return fits[0] if fits else int(length)


def pad_to_bucket(batch: Batch, buckets=DEFAULT_BUCKETS) -> Batch:
  """Trim or pad the completion axis to the bucket of the longest real completion (host side).

  Completion columns past the longest real completion are padding in every row, so trimming them
  changes no loss; padding adds masked columns. A few bucket lengths mean a few compiled programs.
  """
  mask = np.asarray(batch.mask)
  longest = int(mask.any(axis=0).nonzero()[0].max() + 1) if mask.any() else 1
  target = bucket_length(longest, buckets)
  t = mask.shape[1]

  def fit(x, fill):
    if x is None:
      return None
    x = np.asarray(x)
    if target <= t:
      return x[:, :target]
    return np.pad(x, ((0, 0), (0, target - t)), constant_values=fill)

  return batch._replace(
    completions=fit(batch.completions, 0),
    mask=fit(batch.mask, False),
    old_logp=fit(batch.old_logp, 0.0),
    ref_logp=fit(batch.ref_logp, 0.0),
  )
