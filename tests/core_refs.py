"""Brute-force NumPy references for the core kernels (independent of jaxgrpo's implementation)."""

from __future__ import annotations

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


def kl(lp, rlp, kind, max_delta=20.0):
  """Per-token KL estimators in float64; δ clamped to ±max_delta only inside the exponentials."""
  d = np.asarray(lp, np.float64) - np.asarray(rlp, np.float64)
  c = np.clip(d, -max_delta, max_delta)
  return {"k1": d, "k2": d**2 / 2, "k3": np.exp(-c) + d - 1, "forward_k3": np.exp(c) - d - 1}[kind]


def future_kl(lp, rlp, mask, kind, max_delta=20.0):
  """FRPO's reg(i,t) by explicit loops (float64), from the f-divergence form of FRPO Thm 4.1:
  reg(t) = f(u_t) - f'(u_t) u_t + Σ_{j>t, m_j} f(u_j), u = exp(-δ) with δ clamped only inside exp."""
  b, t = np.shape(lp)
  d = np.asarray(lp, np.float64) - np.asarray(rlp, np.float64)
  u = np.exp(-np.clip(d, -max_delta, max_delta))
  out = np.zeros((b, t))
  for i in range(b):
    for s in range(t):
      if not mask[i, s]:
        continue
      later = [j for j in range(s + 1, t) if mask[i, j]]
      if kind == "k1":  # f = -log u: f(u) - f'(u) u = δ + 1, constants dropped
        out[i, s] = d[i, s] + sum(d[i, j] for j in later)
      elif kind == "k3":  # f = -log u + u - 1: f(u) - f'(u) u = δ
        out[i, s] = d[i, s] + sum(u[i, j] + d[i, j] - 1 for j in later)
      else:  # f = u log u - u + 1 (u log u = -δ u): f(u) - f'(u) u = 1 - u
        out[i, s] = 1 - u[i, s] + sum(-d[i, j] * u[i, j] - u[i, j] + 1 for j in later)
  return out


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
