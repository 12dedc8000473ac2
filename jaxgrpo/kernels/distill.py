"""On-policy distillation (OPD): a teacher grades every token the student sampled.

The student samples a completion ``y`` (its own tokens, so the states are the ones it visits); a teacher
scores it. Two families of objectives, both on the student's samples:

1. **Sampled-token reverse KL as a per-token advantage** (:func:`reverse_kl_advantages`). On the sampled
   token ``y_t``, ``log π_s(y_t) − log π_t(y_t)`` is a one-sample estimate of the per-token reverse KL
   ``KL(π_s ‖ π_t)`` at that state; its negation is a dense reward. Used as the advantage of the policy
   gradient, with no reward model and no group baseline:

       A_t = −(log π_s(y_t) − log π_t(y_t))                       (optionally clipped to [−c, c])

   Sources: K. Lu and Thinking Machines Lab, "On-Policy Distillation" (2025; the per-token reverse KL of
   the sampled token as the advantage of an importance-sampled policy gradient); verl's
   ``docs/algo/opd.md``; slime's ``--use-opd`` (``Â_t = A_t − λ_opd·KL_t``); the Qwen3 technical report
   (A. Yang et al., 2025, §4.5, on-policy distillation of the small models). The student's log-probs are
   the *sampling* policy's (the rollout's ``old_logp``), computed once per rollout batch and held fixed
   across updates, like FRPO's δ (SPEC.md, "Future-KL"); the advantage carries no gradient.

2. **Full-distribution divergences over the teacher's top-k** (:func:`topk_divergence`), in the form of
   GKD (R. Agarwal, N. Vieillard, Y. Zhou, P. Stanczyk, S. Ramos, M. Geist, O. Bachem, "On-Policy
   Distillation of Language Models: Learning from Self-Generated Mistakes", ICLR 2024): at every
   position the student's next-token distribution is pulled toward the teacher's, a loss with a gradient
   through the student's logits (no policy gradient). With ``p_t`` the teacher's and ``p_s`` the
   student's distribution over the k ids:

       forward KL   KL(p_t ‖ p_s) = Σ_k p_t (log p_t − log p_s)               (mode covering)
       reverse KL   KL(p_s ‖ p_t) = Σ_k p_s (log p_s − log p_t)               (mode seeking)
       JSD(β)       β·KL(p_t ‖ m) + (1−β)·KL(p_s ‖ m),   m = β·p_t + (1−β)·p_s,   0 < β < 1

   GKD's generalized JSD with its β (the convention of GKD's Eq. and of TRL's ``generalized_jsd_loss``:
   the teacher is GKD's P, the student its Q). JSD(β) → 0 at both ends, but ``JSD(β)/β → KL(p_t ‖ p_s)``
   as β → 0 and ``JSD(β)/(1−β) → KL(p_s ‖ p_t)`` as β → 1; :func:`topk_divergence` returns those limits
   *at* β = 0 (forward KL) and β = 1 (reverse KL), as TRL does.

**The top-k and its tail.** The teacher sends only its top-k ids ``int[B, T, k]`` and their log-probs
``f32[B, T, k]`` (the rest of its distribution never leaves the device that holds it). Both distributions
are *renormalised over those k ids* — ``log p_t = teacher_logp − logsumexp_k(teacher_logp)`` and
``log p_s = z − logsumexp_k(z)`` with ``z`` the student's logits (or log-probs: the same after
renormalisation) gathered at the ids — and the tail (every other id, for both models) is dropped: the
divergence is the one between the two distributions *conditioned on the top-k set*. With k = V it is the
exact full-vocabulary divergence. A teacher log-prob of ``−inf`` (an engine that returned fewer than k
ids, padded) takes its id out of the set for both models; a position with no finite id is not distilled
(per-token loss 0, still counted by :func:`topk_distill_loss`'s denominator). The student's gradient reaches only its logits at the k ids (the tail's
logits have zero gradient). Everything is computed in float32 in log space (``logsumexp``; ``p·log p`` as
``exp(log p)·log p``, never ``log`` of a probability), so no ``log(0)`` arises and large logits stay finite.

**Masks.** ``mask bool[B, T]`` marks the completion's real tokens; ``policy_mask bool[B, T]`` (optional,
multi-turn) marks the tokens the policy wrote: observation tokens (tool results, the user's turns) are
not the student's and are not distilled. A position counts where both are true; elsewhere the advantage
and the per-token loss are 0, with finite gradients (the inputs are selected before the arithmetic).

**Mixing with RL** (:func:`combine_advantages`): ``A = a_RL + w·A_distill`` (the RL advantage broadcast
over the row's tokens), so a distillation term rides on any advantage preset (GRPO, λ-GRPO, FRPO); with
``rl_advantages=None`` it is distillation alone. The train step takes the sum as ``Batch.advantages``.

Shapes: B rows, T completion positions, k top-k ids, V the student's vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels._numerics import safe_div, select

__all__ = [
  "DIVERGENCES",
  "KINDS",
  "DistillConfig",
  "reverse_kl_advantages",
  "combine_advantages",
  "gather_topk",
  "topk_divergence",
  "topk_distill_loss",
]

#: the full-distribution forms of :func:`topk_divergence`
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
#: every form of :class:`DistillConfig`: the sampled-token advantage, then the top-k divergences
KINDS = ("sampled", *DIVERGENCES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  """A distillation term of the objective (``GRPOConfig.distill``; the run's ``objective.distill``).

  Attributes:
    teacher: what the run loads as the teacher (read by ``jaxgrpo.run``, not by the kernels): a run
      directory or checkpoint of this library (``load_policy``), a Hugging Face model directory, or
      ``synthetic:<hidden_size>x<num_layers>`` (the arithmetic task's model of that shape, seeded, for
      tests and plans) — on the train mesh; ``http://host:port``, a teacher server
      (``scripts/teacher_server.py``, ``jaxgrpo.run.teacher_remote``); or ``vllm:<one of the local forms>``,
      that model scored by vLLM's ``prompt_logprobs`` (temperature 1 only). None: the caller supplies
      ``Batch.teacher_logp`` itself.
    weight: ``w >= 0``, the weight of the term: ``A = a_RL + w·A_distill`` (:func:`combine_advantages`).
    kind: ``"sampled"`` (the sampled-token reverse KL as a per-token advantage,
      :func:`reverse_kl_advantages`) or a top-k form (``"forward_kl"``, ``"reverse_kl"``, ``"jsd"``,
      :func:`topk_divergence`).
    top_k: k, the teacher's ids per position for the top-k forms (>= 1); unused by ``"sampled"``.
    beta: the JSD's β in ``[0, 1]`` (``"jsd"`` only).
    clip: ``c > 0`` bounds the sampled-token advantage to ``[−c, c]``; None: no clip.
    min_signal: with dynamic sampling (``objective.dynamic_sampling``), a group whose rewards are all equal is still
      kept when its mean ``|log π_s(y_t) − log π_t(y_t)|`` over its distilled tokens is above this (nats per token,
      ``jaxgrpo.loop.scoring.teacher_signal``); >= 0. Unused without dynamic sampling.
  """

  teacher: str | None = None
  weight: float = 1.0
  kind: str = "sampled"
  top_k: int = 16
  beta: float = 0.5
  clip: float | None = None
  min_signal: float = 1e-3

  def __post_init__(self):
    if self.teacher is not None and not isinstance(self.teacher, str):
      raise TypeError(f"`distill.teacher` must be a path or `synthetic:<hidden>x<layers>`; got {self.teacher!r}")
    _checks.check_choice(self.kind, KINDS, "distill.kind")
    _checks.check_python_float(self.weight, "distill.weight", at_least=0.0, hint="the distillation term's weight w")
    _checks.check_python_int(self.top_k, "distill.top_k", minimum=1, hint="the teacher's ids per position")
    _checks.check_python_float(self.beta, "distill.beta", at_least=0.0, at_most=1.0, hint="the JSD's β")
    if self.clip is not None:
      _checks.check_python_float(self.clip, "distill.clip", above=0.0, hint="the advantage's bound c, or null")
    _checks.check_python_float(
      self.min_signal, "distill.min_signal", at_least=0.0, hint="nats per token; dynamic sampling's teacher threshold"
    )

  @property
  def sampled(self) -> bool:
    """Whether the term is the sampled-token advantage (one teacher log-prob per token)."""
    return self.kind == "sampled"


def _positions(mask, policy_mask, shape):
  """``mask & policy_mask`` (``bool[B, T]``) after checking both against ``shape``."""
  _checks.check_rank(mask, 2, "mask", "bool[B, T]")
  _checks.check_bool(mask, "mask", "bool[B, T]")
  if _checks.shape_of(mask) != tuple(shape):
    raise ValueError(f"`mask` must have shape {tuple(shape)} (B, T); got {_checks.shape_of(mask)}")
  if policy_mask is None:
    return mask
  _checks.check_rank(policy_mask, 2, "policy_mask", "bool[B, T]")
  _checks.check_bool(policy_mask, "policy_mask", "bool[B, T] (true on the policy's own tokens)")
  _checks.check_same_shape(policy_mask, "policy_mask", mask, "mask")
  return jnp.logical_and(mask, policy_mask)


def reverse_kl_advantages(student_logp, teacher_logp, mask, *, policy_mask=None, clip: float | None = None):
  """The sampled-token reverse KL as a per-token advantage: ``A_t = −(log π_s(y_t) − log π_t(y_t))``.

  ``A_t = clip(teacher_logp − student_logp, −c, c)`` where ``mask & policy_mask``, else 0; no gradient
  (``stop_gradient``): it is an advantage, used inside the policy-gradient surrogate like any other.
  Positive where the teacher likes the sampled token more than the student does. Its expectation over the
  student's samples is ``−KL(π_s ‖ π_t)`` at each state (the module docstring gives the sources).

  Args:
    student_logp: ``f32[B, T]`` the sampling policy's log-prob of each sampled token (the rollout's
      ``old_logp``, fixed across the updates of one batch).
    teacher_logp: ``f32[B, T]`` the teacher's log-prob of the same tokens (same prompt, same prefix).
    mask: ``bool[B, T]`` real completion tokens.
    policy_mask: optional ``bool[B, T]``: the policy's own tokens in a multi-turn trajectory
      (observation tokens get 0). None: every token in ``mask``.
    clip: optional ``c > 0``: the advantage is clipped to ``[−c, c]`` (a teacher that finds a sampled
      token nearly impossible gives ``log π_t ≈ −30`` and would dominate the batch). None: no clip.

  Returns:
    ``f32[B, T]`` advantages, 0 off the distilled positions.
  """
  _checks.check_logp_pair(student_logp, teacher_logp, mask, ("student_logp", "teacher_logp"))
  where = _positions(mask, policy_mask, _checks.shape_of(student_logp))
  if clip is not None:
    clip = _checks.check_python_float(clip, "clip", above=0.0, hint="the advantage's bound c, or None for no clip")
  return _reverse_kl_advantages(student_logp, teacher_logp, where, clip)


@functools.partial(jax.jit, static_argnames=("clip",))
def _reverse_kl_advantages(student_logp, teacher_logp, where, clip):
  adv = select(where, teacher_logp.astype(jnp.float32)) - select(where, student_logp.astype(jnp.float32))
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  return jax.lax.stop_gradient(select(where, adv))


def combine_advantages(rl_advantages, distill_advantages, weight):
  """RL advantages plus a weighted distillation advantage: ``A(i, t) = a_RL(i[, t]) + w·A_distill(i, t)``.

  ``a_RL`` is a preset's advantage (``rollout_advantages``: ``f32[B]`` for the GRPO family, broadcast over
  the row's tokens, or ``f32[B, T]`` for FRPO); ``w`` is the distillation weight (slime's
  ``--opd-kl-coef``, Tinker's ``kl_penalty_coef``). ``rl_advantages=None`` gives distillation alone,
  ``w·A_distill``. The RL part is not masked here (the loss masks every token term); the distillation
  part is 0 off its positions already (:func:`reverse_kl_advantages`).

  Args:
    rl_advantages: ``f32[B]`` or ``f32[B, T]``, or None.
    distill_advantages: ``f32[B, T]`` from :func:`reverse_kl_advantages`.
    weight: ``w`` (a Python float, or a traced ``f32[]`` for a schedule).

  Returns:
    ``f32[B, T]``, for ``Batch.advantages``.
  """
  _checks.check_logp(distill_advantages, "distill_advantages")
  shape = _checks.shape_of(distill_advantages)
  w = _checks.check_scalar(weight, "weight", hint="the distillation weight w")
  out = w * distill_advantages.astype(jnp.float32)
  if rl_advantages is None:
    return out
  _checks.check_rank(rl_advantages, (1, 2), "rl_advantages", "f32[B] or f32[B, T]")
  _checks.check_float(rl_advantages, "rl_advantages", "f32[B] or f32[B, T]")
  rl = jnp.asarray(rl_advantages, jnp.float32)
  if rl.ndim == 1:
    _checks.check_dim(rl, 0, shape[0], "rl_advantages", "one advantage per row of distill_advantages")
    rl = rl[:, None]
  else:
    _checks.check_same_shape(rl, "rl_advantages", distill_advantages, "distill_advantages")
  return rl + out


def gather_topk(student_logits, topk_ids):
  """The student's logits at the teacher's top-k ids: ``z[b, t, j] = student_logits[b, t, topk_ids[b, t, j]]``.

  Args:
    student_logits: ``f[B, T, V]`` (any float dtype; gathered as float32).
    topk_ids: ``int[B, T, k]``, every id in ``[0, V)``.

  Returns:
    ``f32[B, T, k]``, differentiable w.r.t. ``student_logits``.
  """
  _checks.check_rank(student_logits, 3, "student_logits", "f32[B, T, V]")
  _checks.check_float(student_logits, "student_logits", "f32[B, T, V]")
  _checks.check_rank(topk_ids, 3, "topk_ids", "int[B, T, k]")
  _checks.check_int(topk_ids, "topk_ids", "int[B, T, k]")
  if _checks.shape_of(topk_ids)[:2] != _checks.shape_of(student_logits)[:2]:
    raise ValueError(
      f"`topk_ids` must have the (B, T) of `student_logits` {_checks.shape_of(student_logits)[:2]}; "
      f"got {_checks.shape_of(topk_ids)}"
    )
  return jnp.take_along_axis(student_logits.astype(jnp.float32), topk_ids, axis=-1)


def _renormalise(x, in_set):
  """``x − logsumexp(x)`` over the ids in the set, 0 outside it (every row holds at least one id)."""
  lse = jax.scipy.special.logsumexp(jnp.where(in_set, x, -jnp.inf), axis=-1, keepdims=True)
  return select(in_set, x - lse)


def _kl(log_p, log_q, in_set):
  """``Σ_k p (log p − log q)`` over the ids in the set, from log-probs (``p = exp(log p)``; no log of a
  probability)."""
  return jnp.sum(select(in_set, jnp.exp(log_p) * (log_p - log_q)), axis=-1)


@functools.partial(jax.jit, static_argnames=("kind", "beta"))
def _topk_divergence(student_topk, teacher_topk_logp, where, kind, beta):
  teacher = select(where[..., None], teacher_topk_logp.astype(jnp.float32))
  in_set = teacher != -jnp.inf  # −inf: the id is not in the set (fewer than k returned); NaN stays visible
  where = jnp.logical_and(where, jnp.any(in_set, axis=-1))  # no id at all: nothing to distill there
  in_set = jnp.logical_and(in_set, where[..., None])
  keep = jnp.logical_or(in_set, ~where[..., None])  # off the distilled positions: any finite row (the zeros)
  log_s = _renormalise(select(in_set, student_topk.astype(jnp.float32)), keep)
  log_t = _renormalise(select(in_set, teacher), keep)
  if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
    per_token = _kl(log_t, log_s, in_set)
  elif kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
    per_token = _kl(log_s, log_t, in_set)
  else:  # 0 < β < 1: log m = logsumexp(log β + log p_t, log(1−β) + log p_s)
    log_m = jnp.logaddexp(jnp.log(beta) + log_t, jnp.log1p(-beta) + log_s)
    per_token = beta * _kl(log_t, log_m, in_set) + (1.0 - beta) * _kl(log_s, log_m, in_set)
  return select(where, per_token)


def topk_divergence(student_topk, teacher_topk_logp, mask, *, kind: str, beta: float = 0.5, policy_mask=None):
  """Per-token divergence between the teacher's and the student's distributions over the teacher's top-k.

  Both are renormalised over the k ids and the tail is dropped (module docstring, "The top-k and its
  tail"). ``kind``: ``"forward_kl"`` ``KL(p_t ‖ p_s)``, ``"reverse_kl"`` ``KL(p_s ‖ p_t)``, or ``"jsd"``
  GKD's ``β·KL(p_t ‖ m) + (1−β)·KL(p_s ‖ m)`` with ``m = β·p_t + (1−β)·p_s`` for 0 < β < 1, and its
  normalised limits at the ends: β = 0 gives the forward KL, β = 1 the reverse KL.

  Args:
    student_topk: ``f32[B, T, k]`` the student's logits (or log-probs) at the teacher's top-k ids, with
      their gradient (:func:`gather_topk` of the full logits).
    teacher_topk_logp: ``f32[B, T, k]`` the teacher's log-probs of its top-k ids (no gradient needed).
    mask: ``bool[B, T]``; policy_mask: optional ``bool[B, T]`` (observation tokens get 0).
    kind: one of :data:`DIVERGENCES`.
    beta: GKD's β in ``[0, 1]`` (static; read only for ``kind="jsd"``).

  Returns:
    ``f32[B, T]`` per-token losses (≥ 0), 0 off the distilled positions.
  """
  kind = _checks.check_choice(kind, DIVERGENCES, "kind")
  beta = _checks.check_python_float(beta, "beta", at_least=0.0, at_most=1.0, hint="GKD's JSD weight β")
  _checks.check_rank(student_topk, 3, "student_topk", "f32[B, T, k]")
  _checks.check_float(student_topk, "student_topk", "f32[B, T, k]")
  _checks.check_rank(teacher_topk_logp, 3, "teacher_topk_logp", "f32[B, T, k]")
  _checks.check_float(teacher_topk_logp, "teacher_topk_logp", "f32[B, T, k]")
  _checks.check_same_shape(teacher_topk_logp, "teacher_topk_logp", student_topk, "student_topk")
  where = _positions(mask, policy_mask, _checks.shape_of(student_topk)[:2])
  return _topk_divergence(student_topk, teacher_topk_logp, where, kind, beta if kind == "jsd" else 0.5)


def topk_distill_loss(student_topk, teacher_topk_logp, mask, *, kind: str, beta: float = 0.5, policy_mask=None):
  """The token mean of :func:`topk_divergence`: ``Σ l·m / Σ m`` over the distilled positions
  (``m = mask & policy_mask``); 0 (value and gradient finite) when no position is distilled.

  Args and shapes as :func:`topk_divergence`. Returns ``f32[]``.
  """
  per_token = topk_divergence(student_topk, teacher_topk_logp, mask, kind=kind, beta=beta, policy_mask=policy_mask)
  where = mask if policy_mask is None else jnp.logical_and(mask, policy_mask)
  return safe_div(jnp.sum(per_token), jnp.sum(where.astype(jnp.float32)))
