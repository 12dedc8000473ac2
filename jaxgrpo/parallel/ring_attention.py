"""Ring attention: causal self-attention over a sequence sharded along a ``context`` mesh axis.

Liu, Zaharia and Abbeel (2023), "Ring Attention with Blockwise Transformers for Near-Infinite Context". Each of the
``n`` devices of the axis holds a chunk of ``C = S / n`` consecutive tokens of q, k, v and the segment ids. In
``n`` steps each device attends its query chunk to the key/value chunk it holds
(:func:`jaxgrpo.kernels.attention.blockwise_attention_with_lse`, with the chunk's global offset in the causal
mask), merges the partial result into its running one by the log-sum-exp, and passes the key/value chunk on to
the next device (``jax.lax.ppermute``, a ring). Merging two partials ``(o_a, ℓ_a)``, ``(o_b, ℓ_b)`` of disjoint key
sets::

    ℓ = log(e^ℓ_a + e^ℓ_b),   o = o_a·e^(ℓ_a − ℓ) + o_b·e^(ℓ_b − ℓ)

(rows that have seen no key yet have ``ℓ = −∞`` and ``o = 0``; they stay so without NaN). Chunks entirely after
the query chunk cost nothing: the blockwise kernel's loops skip every block of them.

Gradients: reverse-mode autodiff through the ring (the blockwise kernel's VJP takes the cotangent of the
log-sum-exp; ``ppermute``'s transpose is the reverse ring). It keeps each step's key/value chunk for the backward
pass, so a device holds the whole sequence's k and v (``[B, S, N, K]``, not the ``[B, N, G, S, S]`` scores) in the
backward pass; a hand-written ring backward that passes dk, dv around instead is not done.

In the model (:func:`context_attention`): under a context mesh (``jax.set_mesh``) with a ``context`` axis > 1, the
ring runs over it with the batch and head dims kept on the mesh axes their logical rules give them (``batch`` over
``data × fsdp``, ``heads`` / ``kv_heads`` over ``tensor``), so composing with fsdp, tensor and data moves no
activation: each device runs the ring over its own rows and heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgrpo.kernels.attention import blockwise_attention_with_lse
from jaxgrpo.parallel.attention import default_blocks
from jaxgrpo.parallel.sharding import CONTEXT_AXIS, DEFAULT_RULES, context_size, logical_to_spec

__all__ = ["context_attention", "merge_partials", "ring_attention", "ring_attention_shard"]


def merge_partials(out_a, lse_a, out_b, lse_b):
  """The attention over the union of two disjoint key sets from each one's ``out [B, S, H, K]`` and ``lse
  [B, S, H]`` (float32; ``−∞`` where a row saw no key). Finite values and gradients on such rows."""
  m = jnp.maximum(lse_a, lse_b)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  wa, wb = jnp.exp(lse_a - m_safe), jnp.exp(lse_b - m_safe)  # exp(−∞) = 0
  z = wa + wb
  seen = z > 0
  z_safe = jnp.where(seen, z, 1.0)
  lse = jnp.where(seen, m_safe + jnp.log(z_safe), -jnp.inf)
  out = (out_a.astype(jnp.float32) * (wa / z_safe)[..., None]) + (out_b.astype(jnp.float32) * (wb / z_safe)[..., None])
  return out, lse


def ring_attention_shard(
  q,
  k,
  v,
  segment_ids,
  *,
  axis_name: str,
  causal=True,
  scale=None,
  block_q=None,
  block_kv=None,
  dot_dtype=None,
  kv_end=None,
):
  """The body inside ``jax.shard_map``: this device's chunk ``q [B, C, H, K]``, ``k, v [B, C, N, K]``,
  ``segment_ids int[B, C]`` (chunk r holds global rows ``[r·C, (r+1)·C)``); returns its ``[B, C, H, K]``
  output rows (q's dtype). ``dot_dtype``: the blockwise kernel's product operand dtype (float32 on XLA:CPU for
  bf16 inputs). ``kv_end int[B, C]`` (optional): a prefix tree's mask in *global* positions (key j is seen by the
  query rows ``[j, kv_end[j])``, ``jaxgrpo.step.prefix_tree``); it travels the ring with its key chunk and is
  shifted to the chunk's own coordinates (``kv_end − source·C``) where the kernel compares it."""
  n = jax.lax.axis_size(axis_name)
  r = jax.lax.axis_index(axis_name)
  C = q.shape[1]
  bq, bk = default_blocks()
  kw = dict(causal=causal, scale=scale, block_q=block_q or bq, block_kv=block_kv or bk, q_segment_ids=segment_ids)
  kw["dot_dtype"] = dot_dtype
  ring = [(i, (i + 1) % n) for i in range(n)]
  out = lse = None
  chunk = (k, v, segment_ids) if kv_end is None else (k, v, segment_ids, jnp.asarray(kv_end, jnp.int32))
  for t in range(n):
    source = (r - t) % n  # whose chunk this device holds after t passes
    kc, vc, sc, *ec = chunk
    if ec:
      kw["kv_end"] = ec[0] - source * C
    o, l = blockwise_attention_with_lse(q, kc, vc, kv_segment_ids=sc, q_offset=(r - source) * C, **kw)
    out, lse = (o.astype(jnp.float32), l) if out is None else merge_partials(out, lse, o, l)
    if t + 1 < n:
      chunk = tuple(jax.lax.ppermute(x, axis_name, ring) for x in chunk)
  return out.astype(q.dtype)


def ring_attention(q, k, v, segment_ids, mesh, *, axis: str = "context", causal=True, scale=None, **blocks):
  """Causal self-attention within segments (as :func:`jaxgrpo.parallel.attention.attention`) of ``q [B, S, H, K]``,
  ``k, v [B, S, N, K]``, ``segment_ids int[B, S]`` with the sequence dim split over the mesh axis ``axis``
  (``S`` divisible by its size); other dims replicated. Returns ``[B, S, H, K]`` sharded the same way."""
  if axis not in mesh.shape:
    raise ValueError(
      f"ring_attention: `axis` {axis!r} is not an axis of the mesh {dict(mesh.shape)}; name the context axis"
    )
  n = mesh.shape[axis]
  if q.shape[1] % n:
    raise ValueError(
      f"ring_attention: the sequence length {q.shape[1]} must be divisible by the {axis!r} axis size {n}"
    )
  spec = P(None, axis)
  body = lambda q, k, v, s: ring_attention_shard(q, k, v, s, axis_name=axis, causal=causal, scale=scale, **blocks)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)(q, k, v, segment_ids)


def context_attention(
  q, k, v, segment_ids, *, rules=None, scale=None, dot_dtype=None, block_q=None, block_kv=None, kv_end=None
):
  """Ring attention over the ``context`` axis of the context mesh (``jax.set_mesh``), for the model: ``q [B, S,
  H, K]``, ``k, v [B, S, N, K]``, ``segment_ids int[B, S]`` (global shapes; ``S`` divisible by the context size).
  The batch dim stays on the mesh axes of ``rules["batch"]``, the head dims on those of ``rules["heads"]`` /
  ``rules["kv_heads"]`` (default :data:`~jaxgrpo.parallel.sharding.DEFAULT_RULES`), as the model's activation
  constraints put them. Returns ``[B, S, H, K]`` in q's dtype, zeros on padding rows (segment 0). ``kv_end int[B,
  S]``: a prefix tree's mask (:func:`ring_attention_shard`), split like the segment ids."""
  mesh = jax.sharding.get_abstract_mesh()
  n = context_size(mesh)
  if n < 2:
    raise ValueError(f"context_attention needs a context mesh with a '{CONTEXT_AXIS}' axis > 1; got {mesh}")
  if q.shape[1] % n:
    pad = -q.shape[1] % n
    raise ValueError(
      f"context attention: the sequence length {q.shape[1]} is not divisible by the context axis size {n}: pad it "
      f"by {pad} positions"
    )
  rules = dict(DEFAULT_RULES if rules is None else rules, activation_length=CONTEXT_AXIS)
  q_spec = logical_to_spec(("batch", "activation_length", "heads", None), mesh, rules, q.shape, "attention queries")
  kv_spec = logical_to_spec(("batch", "activation_length", "kv_heads", None), mesh, rules, k.shape, "attention keys")
  seg_spec = logical_to_spec(("batch", "activation_length"), mesh, rules, segment_ids.shape, "segment ids")
  body = lambda q, k, v, s, *e: ring_attention_shard(
    q, k, v, s, axis_name=CONTEXT_AXIS, scale=scale, block_q=block_q, block_kv=block_kv, dot_dtype=dot_dtype,
    kv_end=e[0] if e else None,
  )  # fmt: skip
  args = (q, k, v, jnp.asarray(segment_ids, jnp.int32))
  args += () if kv_end is None else (jnp.asarray(kv_end, jnp.int32),)
  specs = (q_spec, kv_spec, kv_spec, seg_spec, seg_spec)[: len(args)]
  ring = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
  return ring(*args)
