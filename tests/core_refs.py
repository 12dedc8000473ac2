"""Brute-force NumPy references for the core kernels (independent of jaxgrpo's implementation)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st


def valid_prefix(mask):
  return np.cumprod(mask.astype(int), axis=1).astype(bool)


def process_sets(tokens, mask, group_ids):
  """list of lists: sets[i][t] = list of j in λ(i,t) (empty on padding)."""
  b, t = tokens.shape
  v = valid_prefix(mask)
  out = []
  for i in range(b):
    row = []
    for s in range(t):
      if not v[i, s]:
        row.append([])
        continue
      row.append(
        [
          j
          for j in range(b)
          if group_ids[j] == group_ids[i] and v[j, s] and np.array_equal(tokens[j, : s + 1], tokens[i, : s + 1])
        ]
      )
    out.append(row)
  return out


def sizes(tokens, mask, group_ids):
  return np.array([[len(s) for s in row] for row in process_sets(tokens, mask, group_ids)], np.int32)


def group_stats(rewards, group_ids, ddof=0, eps=1e-6, scale="group"):
  """(mean_i, denom_i) per trajectory, by explicit loops in float64, over the finite rewards only
  (a non-finite reward is a missing sample: it is in no statistic)."""
  rewards = np.asarray(rewards, np.float64)
  valid = np.isfinite(rewards)
  b = len(rewards)
  mean = np.zeros(b)
  denom = np.ones(b)
  for i in range(b):
    members = rewards[(group_ids == group_ids[i]) & valid]
    mean[i] = members.mean() if len(members) else 0.0
    if scale == "group":
      pool = members
    elif scale == "batch":
      pool = rewards[valid]
    else:
      continue
    n = len(pool)
    var = ((pool - pool.mean()) ** 2).sum() / (n - ddof) if n - ddof > 0 else 0.0
    denom[i] = np.sqrt(var) + eps
    if denom[i] == 0:
      denom[i] = 1.0
  return mean, denom


def group_advantages(rewards, group_ids, ddof=0, eps=1e-6, scale="group"):
  """GRPO advantages (r - mean) / denom, 0 for missing (non-finite) rewards."""
  rewards = np.asarray(rewards, np.float64)
  mean, denom = group_stats(rewards, group_ids, ddof=ddof, eps=eps, scale=scale)
  valid = np.isfinite(rewards)
  return np.where(valid, (np.where(valid, rewards, 0.0) - mean) / denom, 0.0)


def rloo_advantages(rewards, group_ids):
  """r_i - mean of the other finite rewards of the group; 0 when missing or without others."""
  rewards = np.asarray(rewards, np.float64)
  valid = np.isfinite(rewards)
  out = np.zeros(len(rewards))
  for i in range(len(rewards)):
    others = [rewards[j] for j in range(len(rewards)) if group_ids[j] == group_ids[i] and j != i and valid[j]]
    if valid[i] and others:
      out[i] = rewards[i] - np.mean(others)
  return out


def exp_tangent(x, c):
  """float64 exp(x) for x <= c; beyond c the tangent line of exp at c, e^c + e^c (x - c)."""
  x = np.asarray(x, np.float64)
  with np.errstate(over="ignore"):
    return np.where(x <= c, np.exp(np.minimum(x, c)), math.exp(c) + math.exp(c) * (x - c))


def kl(lp, rlp, kind, max_delta=20.0):
  """Per-token KL estimators in float64; every exponential continued by its tangent past e^max_delta."""
  d = np.asarray(lp, np.float64) - np.asarray(rlp, np.float64)
  u, v = exp_tangent(-d, max_delta), exp_tangent(d, max_delta)
  return {"k1": d, "k2": d**2 / 2, "k3": u + d - 1, "forward_k3": v - d - 1}[kind]


def _future_kl_terms(lp, rlp, mask, kind, max_delta):
  """FRPO's reg(i,t) as its terms (float64), from the f-divergence form of FRPO Thm 4.1:
  reg(t) = own(t) + Σ_{j>t, m_j} later(j), own = f(u_t) - f'(u_t) u_t, later = f(u_j), u = exp(-δ)
  continued by its tangent past e^max_delta (``exp_tangent``). Returns ``(own, later)``, each f64[B, T]."""
  d = np.asarray(lp, np.float64) - np.asarray(rlp, np.float64)
  u = exp_tangent(-d, max_delta)
  if kind == "k1":  # f = -log u: f(u) - f'(u) u = δ + 1, constants dropped
    return d, d
  if kind == "k3":  # f = -log u + u - 1: f(u) - f'(u) u = δ
    return d, u + d - 1
  return 1 - u, -d * u - u + 1  # f = u log u - u + 1 (u log u = -δ u): f(u) - f'(u) u = 1 - u


def _future_sum(own, later, mask):
  """out[i, s] = own[i, s] + Σ_{j>s, mask[i, j]} later[i, j] on real tokens, 0 elsewhere, by explicit loops."""
  b, t = own.shape
  out = np.zeros((b, t))
  for i in range(b):
    for s in range(t):
      if mask[i, s]:
        out[i, s] = own[i, s] + sum(later[i, j] for j in range(s + 1, t) if mask[i, j])
  return out


def future_kl(lp, rlp, mask, kind, max_delta=20.0):
  """FRPO's reg(i,t) by explicit loops (float64): :func:`_future_kl_terms` summed over the mask."""
  return _future_sum(*_future_kl_terms(lp, rlp, mask, kind, max_delta), mask)


def future_kl_magnitude(lp, rlp, mask, kind, max_delta=20.0):
  """Σ of |terms| that :func:`future_kl` adds at each (i, t) (float64): the scale of a float32 kernel's
  rounding error. Terms of opposite signs can cancel to a result far smaller than they are (own ≈ -9.4e6
  and later ≈ +9.4e6 give -2.8e4), and float32 keeps about 2**-24 of each term, not of the result."""
  own, later = _future_kl_terms(lp, rlp, mask, kind, max_delta)
  return _future_sum(np.abs(own), np.abs(later), mask)


def assert_close_to_sum(got, want, magnitude, rtol, atol, what=""):
  """``|got - want| <= atol + rtol · magnitude`` elementwise: a tolerance relative to the magnitudes
  summed (e.g. :func:`future_kl_magnitude`), not to the (possibly cancelled) result."""
  got, want, magnitude = (np.asarray(x, np.float64) for x in (got, want, magnitude))
  err = np.abs(got - want)
  bound = atol + rtol * magnitude
  if not np.all(err <= bound):
    k = np.unravel_index(np.argmax(err - bound), err.shape)
    raise AssertionError(
      f"{what}: {np.sum(err > bound)} of {err.size} values off; worst at {k}: got {got[k]!r}, want {want[k]!r}, "
      f"|error| {err[k]:.4g} > {bound[k]:.4g} = atol + rtol·Σ|terms| (Σ|terms| = {magnitude[k]:.4g})"
    )


def process_rewards(rewards, tokens, mask, group_ids):
  sets = process_sets(tokens, mask, group_ids)
  return np.array([[rewards[s].mean() if s else 0.0 for s in row] for row in sets])


@st.composite
def groups(draw, max_b=10, max_t=7, vocab=3, max_groups=4):
  """Random completions with shared prefixes, duplicates, unequal/singleton groups, padding."""
  b = draw(st.integers(1, max_b))
  t = draw(st.integers(1, max_t))
  n_groups = draw(st.integers(1, max_groups))
  group_ids = np.array(draw(st.lists(st.integers(0, n_groups - 1), min_size=b, max_size=b)), np.int32)
  tokens = np.zeros((b, t), np.int32)
  lengths = np.zeros(b, int)
  for i in range(b):
    row = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=t, max_size=t)))
    # branch off an earlier trajectory at a random point: long shared prefixes
    if i and draw(st.booleans()):
      parent = draw(st.integers(0, i - 1))
      cut = draw(st.integers(0, t))
      row[:cut] = tokens[parent, :cut]
    tokens[i] = row
    lengths[i] = draw(st.integers(0, t))
    if i and draw(st.integers(0, 5)) == 0:  # exact duplicate
      tokens[i], lengths[i] = tokens[i - 1], lengths[i - 1]
  mask = np.arange(t)[None, :] < lengths[:, None]
  rewards = np.array(draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]), min_size=b, max_size=b)), np.float32)
  # pad to one fixed shape (empty rows in an extra group, masked columns) so jitted kernels compile
  # once per test; the padding is itself an edge case (all-padding rows, an empty group).
  pad_b, pad_t = max_b - b, max_t - t
  tokens = np.pad(tokens, ((0, pad_b), (0, pad_t)), constant_values=vocab)
  mask = np.pad(mask, ((0, pad_b), (0, pad_t)))
  group_ids = np.concatenate([group_ids, np.full(pad_b, max_groups, np.int32)])
  rewards = np.concatenate([rewards, np.zeros(pad_b, np.float32)])
  return tokens, mask, group_ids, rewards, max_groups + 1


def from_strings(seqs, group_ids=None):
  """tokens/mask from strings of letters (the SPEC's worked examples)."""
  t = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), t), np.int32)
  mask = np.zeros((len(seqs), t), bool)
  for i, s in enumerate(seqs):
    tokens[i, : len(s)] = [ord(c) for c in s]
    mask[i, : len(s)] = True
  gid = np.zeros(len(seqs), np.int32) if group_ids is None else np.asarray(group_ids, np.int32)
  return tokens, mask, gid


# ----------------------------------------------------------------------------- surrogates, IS, the loss
# Written from the papers' formulas (float64, explicit per-row loops, hand-derived gradients); nothing
# here calls jaxgrpo.

MAX_LOG = 20.0


def _clamp(x):
  """(value, derivative) of clip(x, ±MAX_LOG)."""
  return np.clip(x, -MAX_LOG, MAX_LOG), (np.abs(x) < MAX_LOG).astype(np.float64)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def surrogate(loss, logp, old, adv, mask, *, eps_low, eps_high, dual_clip=None, tau_pos=1.0, tau_neg=1.05):
  """Per-token term p f64[B, T] (0 on padding) and its Jacobian J[i, t, u] = ∂p(i,t)/∂logp(i,u)
  (rows do not interact) for one of the six surrogates (see jaxgrpo.kernels.surrogates' table)."""
  logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
  mask = np.asarray(mask, bool)
  b, t = logp.shape
  adv = np.asarray(adv, np.float64)
  a_tok = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t))
  p = np.zeros((b, t))
  jac = np.zeros((b, t, t))
  for i in range(b):
    real = np.flatnonzero(mask[i])
    n = len(real)
    if n == 0:
      continue
    lr = logp[i, real] - old[i, real]
    if loss in ("gspo", "gspo_token"):
      ms, dms = _clamp(lr.mean())
      s = np.exp(ms)
      for u in real:
        a = adv[i] if loss == "gspo" else a_tok[i, u]
        clipped = np.clip(s, 1 - eps_low, 1 + eps_high)
        p[i, u] = -min(s * a, clipped * a)
        active = s * a <= clipped * a  # the unclipped term is the min (ties inside the range)
        if not active:
          continue
        if loss == "gspo":  # ∂(-A s)/∂logp_v = -A s · dms / n for every real v of the row
          jac[i, u, real] = -a * s * dms / n
        else:  # GSPO-token: the gradient s·∇logp on the token itself
          jac[i, u, u] = -a * s
    elif loss == "gmpo":
      a = adv[i]
      c = np.where(a > 0, np.minimum(lr, eps_high), np.where(a < 0, np.maximum(lr, -eps_low), 0.0))
      dc = np.where(a > 0, lr < eps_high, np.where(a < 0, lr > -eps_low, False)).astype(np.float64)
      ms, dms = _clamp(c.mean())
      s = np.exp(ms)
      p[i, real] = -a * s
      for u in real:
        jac[i, u, real] = -a * s * dms * dc / n
    else:
      lrc, dlr = _clamp(lr)
      rho = np.exp(lrc)
      a = a_tok[i, real]
      for k, u in enumerate(real):
        if loss == "ppo":
          clipped = np.clip(rho[k], 1 - eps_low, 1 + eps_high)
          s = min(rho[k] * a[k], clipped * a[k])
          grad = rho[k] * a[k] * dlr[k] if rho[k] * a[k] <= clipped * a[k] else 0.0
          if dual_clip is not None and a[k] < 0 and s < dual_clip * a[k]:
            s, grad = dual_clip * a[k], 0.0
          p[i, u], jac[i, u, u] = -s, -grad
        elif loss == "cispo":
          w = np.clip(rho[k], 1 - eps_low, 1 + eps_high)
          p[i, u], jac[i, u, u] = -w * a[k] * logp[i, u], -w * a[k]
        elif loss == "sapo":
          tau = tau_pos if a[k] > 0 else tau_neg
          sig = _sigmoid(tau * (rho[k] - 1))
          p[i, u] = -sig * 4 / tau * a[k]
          jac[i, u, u] = -a[k] * 4 * sig * (1 - sig) * rho[k] * dlr[k]
        else:
          raise ValueError(loss)
  return p, jac


def importance(old, behavior, mask, correction, level, cap, low=0.5):
  """(weights, ratio, capped, k3) f64[B, T] of TIS/MIS/IcePop/sequence masking (jaxgrpo.kernels.importance's
  table), by loops. IcePop (Ring-1T, arXiv:2510.18855): M(k) = k on [low, cap], else 0. Sequence masking: the
  row's geometric-mean ratio exp(mean_t log r_t) outside [low, cap] masks the whole row, weight 1 otherwise."""
  old, behavior = np.asarray(old, np.float64), np.asarray(behavior, np.float64)
  mask = np.asarray(mask, bool)
  b, t = old.shape
  w, r, cp, k3 = (np.zeros((b, t)) for _ in range(4))
  for i in range(b):
    d = np.where(mask[i], old[i] - behavior[i], 0.0)
    real = np.flatnonzero(mask[i])
    for u in real:
      if correction == "seq_mask":
        lr = d.sum() / len(real)
      else:
        lr = d.sum() if level == "sequence" else d[u]
      ratio = np.exp(np.clip(lr, -MAX_LOG, MAX_LOG))
      r[i, u] = ratio
      outside = ratio > cap or (correction in ("icepop", "seq_mask") and ratio < low)
      cp[i, u] = outside
      if correction == "tis":
        w[i, u] = min(ratio, cap)
      elif correction == "seq_mask":
        w[i, u] = 0.0 if outside else 1.0
      else:
        w[i, u] = 0.0 if outside else ratio
      k3[i, u] = np.exp(np.clip(d[u], -MAX_LOG, MAX_LOG)) - d[u] - 1
  return w, r, cp.astype(bool), k3


def aggregation_coefficients(mask, aggregation, max_tokens=None):
  """c[i, t] with loss = Σ c·l over real tokens, for each aggregation mode."""
  mask = np.asarray(mask, bool)
  b, t = mask.shape
  n = mask.sum(1)
  if aggregation == "token-mean":
    total = mask.sum()
    return np.where(mask, 1.0 / total, 0.0) if total else np.zeros((b, t))
  if aggregation == "seq-mean-token-mean":
    rows = (n > 0).sum()
    return np.where(mask, 1.0 / np.maximum(n, 1)[:, None] / max(rows, 1), 0.0)
  return np.where(mask, 1.0 / (b * (max_tokens or t)), 0.0)


def loss_and_grads(
  loss,
  logp,
  old,
  adv,
  mask,
  *,
  aggregation,
  eps_low=0.2,
  eps_high=0.2,
  dual_clip=None,
  tau_pos=1.0,
  tau_neg=1.05,
  token_weights=None,
  is_weights=None,
  ref=None,
  beta=0.0,
  entropy=None,
  entropy_coef=0.0,
  max_tokens=None,
):
  """l(i,t) = w·(v·p + β·k3(logp, ref) − c·H), aggregated: (loss, ∂loss/∂logp, ∂loss/∂entropy)."""
  logp = np.asarray(logp, np.float64)
  mask = np.asarray(mask, bool)
  b, t = logp.shape
  p, jac = surrogate(
    loss,
    logp,
    old,
    adv,
    mask,
    eps_low=eps_low,
    eps_high=eps_high,
    dual_clip=dual_clip,
    tau_pos=tau_pos,
    tau_neg=tau_neg,
  )
  w = np.ones((b, t)) if token_weights is None else np.asarray(token_weights, np.float64)
  v = np.ones((b, t)) if is_weights is None else np.asarray(is_weights, np.float64)
  c = aggregation_coefficients(mask, aggregation, max_tokens) * w  # [B, T], 0 on padding
  per = v * p
  dper = np.zeros((b, t))
  if beta:
    d = logp - np.asarray(ref, np.float64)
    per = per + beta * kl(logp, ref, "k3")  # exp(-δ) continued by its tangent past e^20
    dper = beta * (1 - np.exp(np.minimum(-d, 20.0)))
  if entropy_coef:
    per = per - entropy_coef * np.asarray(entropy, np.float64)
  value = float(np.sum(np.where(mask, c * per, 0.0)))
  grad = np.einsum("it,itu->iu", c * v, jac) + c * dper
  grad_h = -entropy_coef * c if entropy_coef else np.zeros((b, t))
  return value, np.where(mask, grad, 0.0), np.where(mask, grad_h, 0.0)
