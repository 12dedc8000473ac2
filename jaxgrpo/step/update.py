"""The optimizer side of the train step: gradient accumulation over micro-batches, the update, the passes.

- :func:`token_scale` — ``2^-e ≈ 1/tokens`` of a mini-batch, the scale of the summed numerators;
- :func:`accumulate_grads` — ``lax.scan`` over one mini-batch's K micro-batches of ``scale·∇numerator_k`` (and the
  terms, entropy, tokens, routing sums);
- :func:`apply_update` — the one division ``∇L = Σ_k ∇numerator_k / Σ_k denominator_k`` (the gradient of the
  mini-batch's loss, the denominator having no gradient), clipping by global norm, the optax update;
- :func:`update_metrics` — one update's metrics (the router strategy adds a mixture of experts' routing metrics);
- :func:`update` — one optimizer update on one mini-batch (the body of the scan over mini-batches);
- :func:`train_epochs` — μ passes over the batch, each a scan of :func:`update` over its M mini-batches, with the
  pass's own row fields (LoRA dropout keys, ``jaxgrpo.step.terms.pass_fields``) added to the rows.

The micro-batch's gradient enters as ``grad_fn = jax.grad(loss, has_aux=True)`` of a loss ``loss(params, mb,
scale) -> (scale·numerator f32[], (LossTerms, entropy_sum f32[], routing_sums))`` —
``jaxgrpo.step.terms.micro_terms`` in the step, a hand-written one in a test — so each piece runs alone.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxgrpo.kernels.losses import LossTerms, combine_terms, finalize_terms
from jaxgrpo.step.terms import StepSpec, contiguous_split, split_micro

__all__ = ["accumulate_grads", "apply_update", "token_scale", "train_epochs", "update", "update_metrics"]


def _zero_terms(example: LossTerms) -> LossTerms:
  big = jnp.float32(jnp.finfo(jnp.float32).max)
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
  extrema = {k: (-big if k.endswith("_max") else big) for k in example.extrema}
  return LossTerms(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros(example.sums), extrema)


def reduce_updates(metrics):
  """Metrics stacked over the μ·M updates -> one value each (max of maxima, min of minima, else mean)."""
  out = {}
  for k, v in metrics.items():
    v = v.reshape(-1)
    out[k] = jnp.max(v) if k.endswith("_max") else jnp.min(v) if k.endswith("_min") else jnp.mean(v)
  return out


def _safe_div(num, den):
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _finalize(terms: LossTerms) -> dict:
  """Metrics of the accumulated terms: :func:`~jaxgrpo.kernels.losses.finalize_terms`' when the objective
  returned the sums of ``policy_loss_terms``; otherwise ``loss`` plus the objective's own sums
  (``objective/<name>``, summed over the batch) and extrema."""
  try:
    return finalize_terms(terms)[1]
  except KeyError:  # a custom objective with its own metric sums (the contract allows any dicts)
    metrics = {"loss": _safe_div(terms.numerator, terms.denominator)}
    metrics.update({f"objective/{k}": v for k, v in terms.sums.items()})
    metrics.update({f"objective/{k}": v for k, v in terms.extrema.items()})
    return metrics


def token_scale(mini: dict) -> jax.Array:
  """``2^-e ≈ 1/(real tokens of the mini-batch)`` (``f32[]``; ``mini["loss_mask"]`` ``bool[K, R, T]``): keeps the
  accumulated gradients at the scale of a token mean (low-precision parameters) and cancels in the one
  division; a power of two, so scaling rounds nothing."""
  _, e = jnp.frexp(jnp.maximum(jnp.sum(mini["loss_mask"]).astype(jnp.float32), 1.0))
  return jnp.ldexp(jnp.float32(1.0), -e)


def _add_micro_batch(grad_fn: Callable, params, scale, param_sh, acc, mb):
  """One step of :func:`accumulate_grads`' scan: ``acc`` plus micro-batch ``mb``'s ``scale·∇numerator``
  (float32, kept sharded like the parameters), terms, entropy sum, loss tokens and routing sums."""
  grads, terms, ent, tokens, routes = acc
  g_k, (terms_k, ent_k, routes_k) = grad_fn(params, mb, scale)  # scale · ∇numerator_k
  grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grads, g_k)
  grads = jax.lax.with_sharding_constraint(grads, param_sh)
  tokens = tokens + jnp.sum(mb["loss_mask"]).astype(jnp.float32)
  routes = jax.tree.map(jnp.add, routes, routes_k)
  return (grads, combine_terms(terms, terms_k), ent + ent_k, tokens, routes), None


def accumulate_grads(spec: StepSpec, grad_fn: Callable, shapes, params, mini: dict, scale):
  """The sums over one mini-batch's K micro-batches (``lax.scan``).

  Args:
    spec: the step (reads ``spec.param_sh``, the parameters' shardings, kept by the summed gradients).
    grad_fn: ``jax.grad(loss, has_aux=True)`` of a micro-batch loss ``loss(params, mb, scale) -> (scale·numerator,
      (LossTerms, entropy_sum, routing_sums))`` (:func:`jaxgrpo.step.terms.micro_terms`).
    shapes: ``jax.eval_shape`` of the loss's aux on one micro-batch (the accumulators' shapes).
    params: the trained variables; mini: the mini-batch's rows, ``[K, R, ...]`` each; scale: ``f32[]``
      (:func:`token_scale`).

  Returns:
    ``(Σ_k scale·∇numerator_k, Σ_k LossTerms, Σ entropy f32[], Σ real tokens f32[], Σ routing sums)``: the
    gradients float32 like ``params``; the terms combined by :func:`~jaxgrpo.kernels.losses.combine_terms`.
    :func:`apply_update` divides once by ``scale·Σ_k denominator_k``.
  """
  terms_shape, _, routes_shape = shapes
  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  zero_grads = jax.lax.with_sharding_constraint(zero_grads, spec.param_sh)
  zero = jnp.zeros((), jnp.float32)
  zero_routes = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), routes_shape)
  init = (zero_grads, _zero_terms(terms_shape), zero, zero, zero_routes)
  add = functools.partial(_add_micro_batch, grad_fn, params, scale, spec.param_sh)
  return jax.lax.scan(add, init, mini)[0]


def apply_update(spec: StepSpec, params, opt_state, grads, terms: LossTerms, scale):
  """Divide once (``∇L = Σ_k ∇numerator_k / Σ_k denominator_k``: ``grads`` are :func:`accumulate_grads`'
  ``Σ_k scale·∇numerator_k``; 0 when the denominators sum to 0), clip by global norm
  (``spec.tc.max_grad_norm``; None: no clipping), cast to the parameters' dtypes and apply ``spec.optimizer``.

  Returns ``(params, opt_state, grad_norm f32[])``, the norm before clipping."""
  tc = spec.tc
  inv_den = _safe_div(1.0, scale * terms.denominator)  # divide once: Σ_k ∇numerator_k / Σ_k denominator_k
  grads = jax.tree.map(lambda x: x * inv_den, grads)
  grad_norm = optax.tree.norm(grads)
  if tc.max_grad_norm is not None:
    scale = jnp.where(grad_norm > tc.max_grad_norm, tc.max_grad_norm / jnp.maximum(grad_norm, 1e-30), 1.0)
    grads = jax.tree.map(lambda x: x * scale, grads)
  grads = jax.tree.map(lambda x, p: x.astype(p.dtype), grads, params)
  updates, opt_state = spec.optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, grad_norm


def update_metrics(router, terms: LossTerms, ent, tokens, grad_norm, routes) -> dict:
  """One update's metrics (``f32[]`` each): :func:`_finalize` of the terms, ``entropy`` (mean over the loss
  tokens), ``grad_norm``, and ``router.metrics(routes)`` (``jaxgrpo.step.terms.RouterLosses``: a mixture of
  experts' per-layer expert load and router entropy; nothing for a dense model)."""
  metrics = _finalize(terms)
  metrics["entropy"] = _safe_div(ent, tokens)
  metrics["grad_norm"] = grad_norm
  metrics.update(router.metrics(routes))
  return metrics


def update(spec: StepSpec, grad_fn: Callable, shapes, carry, mini: dict):
  """One optimizer update on the mini-batch ``mini`` (``[K, R, ...]``) from ``carry = (params, opt_state)``:
  :func:`token_scale`, :func:`accumulate_grads`, :func:`apply_update`; ``((params, opt_state), metrics)``
  (:func:`update_metrics`)."""
  params, opt_state = carry
  scale = token_scale(mini)
  grads, terms, ent, tokens, routes = accumulate_grads(spec, grad_fn, shapes, params, mini, scale)
  params, opt_state, grad_norm = apply_update(spec, params, opt_state, grads, terms, scale)
  return (params, opt_state), update_metrics(spec.router, terms, ent, tokens, grad_norm, routes)


def _epoch(spec: StepSpec, step: Callable, rows: dict, carry, fields: dict):
  """One pass over the batch: ``lax.scan`` of ``step`` (:func:`update`) over the M mini-batches of ``rows``
  (``[M, K, R, ...]``) with this pass's row fields (``[B, ...]`` each, split like the rows) added."""
  mm, kk = spec.tc.mini_batches, spec.tc.micro_batches
  kw = dict(blocks=spec.blocks, contiguous=contiguous_split(spec.tc))
  fields = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(split_micro(x, mm, kk, **kw), spec.rows_sh), fields)
  return jax.lax.scan(step, carry, {**rows, **fields})


def train_epochs(spec: StepSpec, grad_fn: Callable, shapes, params, opt_state, rows: dict, per_pass: dict, passes: int):
  """μ = ``passes`` passes over ``rows`` (``[M, K, R, ...]``), M updates each: ``((params, opt_state), metrics
  [μ, M])``. ``per_pass``: the row fields that differ between passes, ``[μ, B, ...]`` each
  (``jaxgrpo.step.terms.pass_fields``: every row's LoRA dropout key per pass, or ``{}``)."""
  step = functools.partial(update, spec, grad_fn, shapes)
  epoch = functools.partial(_epoch, spec, step, rows)
  return jax.lax.scan(epoch, (params, opt_state), per_pass, length=passes)
