"""The edge where a :class:`~jaxgrpo.kernels.config.GRPOConfig` is unpacked into the pure kernels.

Two calls, matching the two time scales of GRPO training:

1. :func:`rollout_advantages` — once per rollout batch: outcome advantages, FRPO's future-KL
   advantage (from the rollout and reference log-probs, fixed across updates) and λ-GRPO's token
   weights ``1/|λ(i,t)|``.
2. :func:`objective_terms` — once per (micro-)batch update: the config's surrogate (``loss``: PPO's
   clip, GSPO, GSPO-token, CISPO, SAPO, GMPO) with the per-token KL term when ``kl_placement="loss"``,
   the off-policy correction (``importance_correction``) and the entropy bonus (``entropy_coef``),
   returned as additive :class:`~jaxgrpo.kernels.losses.LossTerms`.

The train step and the binary-tree task both call these; research code may call the kernels directly.
Both are jitted with the config (frozen, hashable) and the sizes static: a direct call costs what it
costs inside ``jit`` after the first call; calling them inside an outer ``jit`` works. The config's
numbers are compile-time constants unless a :class:`~jaxgrpo.kernels.config.GRPOHyper` (``hyper=``) passes
them as traced ``f32[]`` arrays (schedules, ``vmap``-ped grids: one program for every value).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels.advantages import group_advantages
from jaxgrpo.kernels.config import GRPOConfig, GRPOHyper
from jaxgrpo.kernels.importance import BAND_CORRECTIONS, importance_weights
from jaxgrpo.kernels.kl import frpo_advantages, kl_penalty
from jaxgrpo.kernels.losses import LossTerms, policy_loss_terms
from jaxgrpo.kernels.process_sets import group_size_bound, process_set_sizes
from jaxgrpo.kernels.surrogates import NUMBERS_READ

__all__ = ["rollout_advantages", "objective_terms", "uses_entropy"]


def _check_config(config) -> GRPOConfig:
  if not isinstance(config, GRPOConfig):
    raise TypeError(f"`config` must be a jaxgrpo.GRPOConfig (e.g. jaxgrpo.preset('grpo')); got {type(config).__name__}")
  return config


def _number(config: GRPOConfig, hyper: GRPOHyper | None, name: str):
  """A number of the objective: the config's Python float (static), or ``hyper``'s array (traced)."""
  return getattr(config if hyper is None else hyper, name)


def _check_hyper(config: GRPOConfig, hyper) -> GRPOHyper | None:
  return None if hyper is None else config.check_hyper(hyper)


def _why(config: GRPOConfig, given: GRPOConfig, name: str) -> str:
  """How the term ``name`` came to be on: the config's value, or a traced ``hyper`` value over a 0."""
  if getattr(given, name) == 0:
    return f"hyper.{name} is traced, so its term is built although the config's {name} is 0"
  return f"{name}={getattr(config, name)}"


@functools.partial(jax.jit, static_argnames=("config", "num_groups", "max_group_size"))
def _rollout_advantages(
  config, rewards, tokens, mask, group_ids, old_logp, ref_logp, hyper, *, num_groups, max_group_size
):
  adv = group_advantages(
    rewards, group_ids, num_groups, scale=config.advantage_scale, ddof=config.std_ddof, eps=config.std_eps
  )
  if config.kl_placement == "future" and config.beta > 0:
    beta = _number(config, hyper, "beta")
    adv = frpo_advantages(adv, old_logp, ref_logp, mask, beta=beta, kind=config.kl_estimator)
  weights = None
  if config.process_weights:
    # a missing sample (non-finite reward) is in no process set: it must not halve its mates' weights
    sizes = process_set_sizes(tokens, mask, group_ids, valid=jnp.isfinite(rewards), max_group_size=max_group_size)
    # 1/|λ| on real tokens, 0 on padding; a negative (poisoned) size stays visible as NaN.
    weights = jnp.where(sizes > 0, 1.0 / jnp.maximum(sizes, 1), jnp.where(sizes < 0, jnp.nan, 0.0))
    weights = weights.astype(jnp.float32)
  return adv, weights


def rollout_advantages(
  config: GRPOConfig,
  rewards,
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  old_logp=None,
  ref_logp=None,
  max_group_size: int | None = None,
  hyper: GRPOHyper | None = None,
):
  """Advantages and token weights of one rollout batch.

  Args:
    config: the algorithm (static).
    rewards: ``f32[B]`` (NaN/±inf: a missing sample, advantage 0; see ``jaxgrpo.kernels.advantages``);
      tokens: ``int32[B, T]``; mask: ``bool[B, T]``; group_ids: ``int32[B]``.
    num_groups: static int, every group id in ``[0, num_groups)``.
    old_logp, ref_logp: ``f32[B, T]`` rollout and reference log-probs; required for FRPO with β>0.
    max_group_size: static bound on the group size for ``process_set_sizes``. None: derived from
      ``group_ids`` when they are concrete (the largest group rounded up to a power of two),
      ``process_set_sizes``'s default when they are traced.
    hyper: optional :class:`~jaxgrpo.kernels.config.GRPOHyper`: FRPO's β as a traced ``f32[]`` (one program
      for every value) instead of the config's static one; the config's β > 0 still switches it on.

  Returns:
    ``(advantages, token_weights)``: advantages ``f32[B]`` (GRPO family) or ``f32[B, T]`` (FRPO);
    token_weights ``f32[B, T]`` (``1/|λ|``, 0 on padding and on missing samples' rows, whose mates count
    only the rows in the sample — ``jaxgrpo.kernels.process_sets``, "Missing samples"; NaN where ``process_set_sizes`` reports an
    invalid input by a negative size, so the failure is not silently hidden) or None.
  """
  given = _check_config(config)
  hyper = _check_hyper(given, hyper)
  config = given.with_terms_of(hyper)  # a traced β builds FRPO's future-KL term, never silently dropped
  b, _ = _checks.check_tokens_mask(tokens, mask)
  _checks.check_rank(rewards, 1, "rewards", "f32[B]")
  _checks.check_float(rewards, "rewards", "f32[B]")
  _checks.check_dim(rewards, 0, b, "rewards", "one reward per row of tokens")
  _checks.check_group_ids(group_ids, b, num_groups)
  num_groups = _checks.check_python_int(num_groups, "num_groups", minimum=1, hint="static number of groups")
  if config.kl_placement == "future" and config.beta > 0:
    if old_logp is None or ref_logp is None:
      raise ValueError(
        f"preset {config.name!r} (future-KL, {_why(config, given, 'beta')}) needs `old_logp` and `ref_logp`"
      )
    _checks.check_logp(old_logp, "old_logp", (b, _checks.shape_of(tokens)[1]))
    _checks.check_logp(ref_logp, "ref_logp", (b, _checks.shape_of(tokens)[1]))
  else:
    old_logp = ref_logp = hyper = None  # unused: one compiled program whether or not they are passed
  if config.process_weights:
    if max_group_size is None:
      max_group_size = group_size_bound(group_ids)
    else:
      max_group_size = _checks.check_python_int(max_group_size, "max_group_size", minimum=1, hint="static bound")
  else:
    max_group_size = None  # unused
  return _rollout_advantages(
    config,
    rewards,
    tokens,
    mask,
    group_ids,
    old_logp,
    ref_logp,
    hyper,
    num_groups=num_groups,
    max_group_size=max_group_size,
  )


@functools.partial(jax.jit, static_argnames=("config",))
def _objective_terms(config, logp, old_logp, advantages, mask, token_weights, ref_logp, behavior_logp, entropy, hyper):
  number = functools.partial(_number, config, hyper)
  kl = None
  if config.kl_placement == "loss" and config.beta > 0:
    kl = kl_penalty(logp, ref_logp, config.kl_estimator, mask=mask)
  importance = None
  if config.importance_correction is not None:
    importance = importance_weights(
      old_logp,
      old_logp if behavior_logp is None else behavior_logp,
      mask,
      correction=config.importance_correction,
      level=config.importance_level,
      cap=number("importance_cap"),
      low=config.importance_low if config.importance_correction in BAND_CORRECTIONS else None,
    )
  loss_hyper = GRPOHyper(
    loss=config.loss,
    aggregation=config.aggregation,
    max_tokens=config.max_tokens,
    **{n: number(n) for n in NUMBERS_READ},
    beta=number("beta") if kl is not None else 0.0,
    entropy_coef=number("entropy_coef") if config.entropy_coef != 0 else 0.0,
  )  # the IS cap went into `importance` above; the loss reads the rest
  return policy_loss_terms(
    logp,
    old_logp,
    advantages,
    mask,
    loss_hyper,
    token_weights=token_weights,
    kl=kl,
    importance=importance,
    entropy=entropy,
  )


def objective_terms(
  config: GRPOConfig,
  logp,
  old_logp,
  advantages,
  mask,
  *,
  token_weights=None,
  ref_logp=None,
  behavior_logp=None,
  entropy=None,
  hyper: GRPOHyper | None = None,
) -> LossTerms:
  """The loss of one (micro-)batch under ``config`` as additive ``LossTerms``.

  The surrogate is ``config.loss`` (``jaxgrpo.kernels.surrogates``). With ``kl_placement="loss"`` and β > 0
  the per-token term is ``kl_penalty(logp, ref_logp, config.kl_estimator, mask=mask)``; FRPO's KL
  lives in the advantages (``rollout_advantages``), so its loss has no KL term. With
  ``importance_correction`` the policy term is weighted by
  ``importance_weights(old_logp, behavior_logp, mask, ...)``; with ``entropy_coef != 0`` the bonus
  ``−entropy_coef·entropy`` joins every token term.

  Args:
    config: the algorithm (static).
    logp: ``f32[B, T]`` current policy (differentiable); old_logp: ``f32[B, T]`` rollout policy.
    advantages: ``f32[B]`` or ``f32[B, T]``, token_weights: ``f32[B, T]`` or None — from
      :func:`rollout_advantages` (rows matching this micro-batch).
    mask: ``bool[B, T]``.
    ref_logp: ``f32[B, T]``, required when β>0 and ``kl_placement="loss"`` (ignored otherwise).
    behavior_logp: ``f32[B, T]`` the behaviour policy's log-probs, read when
      ``config.importance_correction`` is set (None: the rollout's own, every weight 1; ignored
      otherwise). The train step passes this keyword only when the config asks for it.
    entropy: ``f32[B, T]`` the policy entropy with its gradient, required when
      ``config.entropy_coef != 0`` (ignored otherwise). The train step passes this keyword only when
      the config asks for it, so a custom ``objective_fn`` with the pinned signature
      ``(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None)`` keeps
      working for every config that does not use these two fields.
    hyper: optional :class:`~jaxgrpo.kernels.config.GRPOHyper`: the numbers (β, ε, the dual clip's c, τ±, the
      importance cap, the entropy coefficient) as traced ``f32[]`` arrays — one compiled program for
      every value (a schedule, a ``vmap``-ped grid) — instead of the config's static floats. The
      config keeps the structure (its β > 0 switches the KL term on, its ``entropy_coef != 0`` the
      bonus, its ``dual_clip`` the dual clip), except that a *traced* β or entropy coefficient builds
      its term even over a config's 0 (it is never silently dropped; ``ref_logp`` / ``entropy`` are
      then required, ValueError naming them). The train step passes it only when it has one.
  """
  given = _check_config(config)
  hyper = _check_hyper(given, hyper)
  config = given.with_terms_of(hyper)  # a traced β / entropy coefficient builds its term, never silently dropped
  _checks.check_logp(logp, "logp")
  shape = _checks.shape_of(logp)
  if config.kl_placement == "loss" and config.beta > 0:
    if ref_logp is None:
      raise ValueError(f"preset {config.name!r} ({_why(config, given, 'beta')}, KL in the loss) needs `ref_logp`")
    _checks.check_logp(ref_logp, "ref_logp", shape)
  else:
    ref_logp = None  # unused: one compiled program whether or not it is passed
  if config.importance_correction is not None and behavior_logp is not None:
    _checks.check_logp(behavior_logp, "behavior_logp", shape)
  else:
    behavior_logp = None
  if config.entropy_coef != 0:
    if entropy is None:
      raise ValueError(
        f"preset {config.name!r} ({_why(config, given, 'entropy_coef')}) needs `entropy` f32[B, T] with its gradient "
        "(jaxgrpo.models.log_probs.completion_log_probs(..., with_entropy=True, entropy_grad=True))"
      )
    _checks.check_logp(entropy, "entropy", shape)
  else:
    entropy = None
  # The remaining arguments are checked (at trace time) by policy_loss_terms inside the jitted call.
  return _objective_terms(
    config, logp, old_logp, advantages, mask, token_weights, ref_logp, behavior_logp, entropy, hyper
  )


def uses_entropy(objective_fn):
  """Mark a custom ``objective_fn`` as taking the policy entropy: the train step then computes it (with
  its gradient, one extra pass over each logits chunk) and passes ``entropy=`` ``f32[R, T]`` for every
  config, ``entropy_coef`` 0 included. Sets ``objective_fn.uses_entropy = True`` and returns it (a
  decorator); any callable with that attribute works the same way."""
  objective_fn.uses_entropy = True
  return objective_fn
