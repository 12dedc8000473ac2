"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE) and their router: dispatch, routing replay, losses.

Axis vocabulary (as in ``layers``): B batch, S tokens, D model width, E experts, k experts per token
(``num_experts_per_tok``), Fe expert width (``moe_intermediate_size``), M sparse layers, T = B·S.

**The sparse block** (:class:`MoEBlock`, HF ``Qwen3MoeSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``)::

    z = x · W_router                      f32[T, E]   (router logits, float32 accumulation)
    p = softmax(z)                         f32[T, E]
    (w, e) = top_k(p, k)                   w f32[T, k], e int32[T, k]   (replay: e given, w = p[e])
    w = w / Σ_j w_j            if norm_topk_prob
    y_t = Σ_j w_tj · SwiGLU_{e_tj}(x_t)   SwiGLU_e(x) = (silu(x·G_e) * (x·U_e)) · D_e
    y_t += sigmoid(x_t · w_sg) · SwiGLU_shared(x_t)       (Qwen2-MoE's shared expert only)

**Dispatch** (``MoEBlock.dispatch``, :func:`set_dispatch`), dropless and equal in value: the T·k
assignments sorted by expert, each expert's SwiGLU a grouped matmul over its rows — ``"tiled"``
(default for a CPU target; :func:`_tile_matmul`), ``"ragged"`` (``jax.lax.ragged_dot``; default for GPU and
TPU targets, :func:`default_dispatch` from measurements: the platform of the devices the program is compiled for)
or ``"dense"`` (every expert on every token: the reference). On a mesh the experts run in
``jax.shard_map``: E/n experts per device (``rules["expert"]``), partial outputs summed by ``psum``,
no all-to-all (the expert axis must not be a batch axis: ValueError). docs/models.md, "Mixtures
of experts".

**Routing outputs and replay** go through a :func:`routing_scope`::

    with moe.routing_scope(replay=None) as scope:   # replay: int[B, S, M, k] expert ids, or None
      hidden, _ = model(tokens, positions, ...)
    scope.routes[m]  # Route(logits f32[B, S, E], experts int32[B, S, k]) of sparse layer m
    scope.stacked()  # every sparse layer's, logits f32[B, S, M, E], experts int32[B, S, M, k]

With ``replay`` the sparse layers use exactly those experts (``w`` = the current router's
probabilities of them, so the router still learns): routing replay. Each layer returns its ``Route``
as a third output, so it crosses ``jax.checkpoint`` (remat). A sparse layer finds its index m from the
layer being traced (``layers.current_layer_index``): ``moe_layers.index(l)`` in the loop.

**Scanned layers** (``scan_layers=True``, :class:`MoEModel`): when every layer is sparse (Qwen3-MoE with
``decoder_sparse_step`` 1 and no ``mlp_only_layers``, e.g. Qwen3-30B-A3B), the L = M layers stack like a dense
model's (``models.base.stack_blocks``) and run as one ``jax.lax.scan``; the routes are the scan's stacked output
(``[M, B, S, ...]``, ``RoutingScope.scanned``) and layer l (= m) reads its replayed experts by a dynamic slice of
``replay[:, :, l]``. A config with dense layers is refused by name (the layers differ).

**Router losses** (:func:`load_balancing_loss`, :func:`router_z_loss`) and per-layer metrics
(:func:`routing_metrics`) are pure functions of the routes and a token mask.

One job at ~600 lines: the sparse MoE decoder — the block, its dispatch kernels and the router's
routes and losses are one computation, which the decoder layers and the loader call together.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxgrpo.models.backend import f32_operands_on_cpu
from jaxgrpo.models.base import RematPolicy, check_scan_layers, freeze_rules, stack_blocks
from jaxgrpo.models.config import Qwen2MoeConfig, Qwen3MoeConfig
from jaxgrpo.models.layers import QuantizedWeight, RMSNorm, current_layer_index, dense, param
from jaxgrpo.models.llama import LlamaBlock, LlamaModel, SwiGLU, swiglu
from jaxgrpo.parallel.target import current_platform

__all__ = [
  "DISPATCH",
  "MoEBlock",
  "MoEDecoderBlock",
  "MoEModel",
  "Route",
  "RoutingScope",
  "is_moe",
  "load_balancing_loss",
  "num_moe_layers",
  "replay_dtype",
  "router_z_loss",
  "routing_metrics",
  "routing_sums",
  "routing_scope",
  "set_dispatch",
  "default_dispatch",
]

DISPATCH = ("tiled", "ragged", "dense")
MoEConfig = Qwen3MoeConfig | Qwen2MoeConfig
#: the default dispatch per backend, from measurements (BENCHMARKS.md, ``scripts/bench_moe.py``): on XLA:CPU
#: ``ragged_dot`` is a dense masked expansion (2.74x slower than tiled, Intel Xeon); on one H200 ``ragged_dot``
#: was 2.6x faster than tiled (3.5 vs 9.1 ms a step); on TPU it is the native grouped matmul
DEFAULT_DISPATCH = {"cpu": "tiled", "gpu": "ragged", "cuda": "ragged", "rocm": "ragged", "tpu": "ragged"}


def default_dispatch(backend: str | None = None) -> str:
  """The dispatch of a sparse layer whose ``dispatch`` is ``"auto"`` (the default) on ``backend`` (default: the
  platform of the program being traced, :func:`jaxgrpo.parallel.target.current_platform`): :data:`DEFAULT_DISPATCH`,
  ``"tiled"`` for a backend not in it (the one that never expands densely)."""
  return DEFAULT_DISPATCH.get(current_platform() if backend is None else backend, "tiled")


class Route(NamedTuple):
  """One sparse layer's routing of one forward: ``logits f32[B, S, E]`` (router logits, before the
  softmax) and ``experts int32[B, S, k]`` (the experts used, top-k or replayed)."""

  logits: jax.Array
  experts: jax.Array


@dataclasses.dataclass
class RoutingScope:
  """What a :func:`routing_scope` gives the sparse layers (``replay``) and collects from them
  (``routes``: sparse-layer index m → :class:`Route`, filled by one forward)."""

  replay: jax.Array | None
  routes: dict[int, Route] = dataclasses.field(default_factory=dict)
  #: a scanned stack's routes as the scan stacked them: ``logits f32[M, B, S, E]``, ``experts int32[M, B, S, k]``
  scanned: Route | None = None

  def stacked(self) -> Route:
    """The routes of every sparse layer stacked on axis 2: ``logits f32[B, S, M, E]``,
    ``experts int32[B, S, M, k]`` (the replay layout). ValueError when no forward ran in the scope."""
    if self.scanned is not None:
      return Route(*(jnp.moveaxis(a, 0, 2) for a in self.scanned))
    if not self.routes:
      raise ValueError("routing_scope: no MoE forward ran inside the scope (no routes recorded)")
    ms = sorted(self.routes)
    return Route(
      logits=jnp.stack([self.routes[m].logits for m in ms], axis=2),
      experts=jnp.stack([self.routes[m].experts for m in ms], axis=2),
    )


_SCOPE: contextvars.ContextVar[RoutingScope | None] = contextvars.ContextVar("jaxgrpo_routing_scope", default=None)


@contextlib.contextmanager
def routing_scope(replay: jax.Array | None = None) -> Iterator[RoutingScope]:
  """Collect the routes of the MoE forward run inside the block, and optionally replay experts.

  Args:
    replay: None (route by top-k), or ``int[B, S, M, k]`` expert ids for every token of the forward's
      ``[B, S]`` tokens and every sparse layer m (the layout of :meth:`RoutingScope.stacked` and of
      ``Rollout.routing``); any integer dtype. Shapes are checked when the forward is traced.
  """
  if replay is not None and (replay.ndim != 4 or not jnp.issubdtype(replay.dtype, jnp.integer)):
    raise ValueError(f"replay must be an integer array [B, S, M, k]; got {replay.dtype}{tuple(replay.shape)}")
  scope = RoutingScope(replay=replay)
  token = _SCOPE.set(scope)
  try:
    yield scope
  finally:
    _SCOPE.reset(token)


def replay_dtype(num_experts: int):
  """The compact storage dtype of recorded expert ids: uint8 for E <= 256, int16 up to 32768, else int32."""
  return jnp.uint8 if num_experts <= 256 else jnp.int16 if num_experts <= 32768 else jnp.int32


# ----------------------------------------------------------------------------------------------
# Expert computation: grouped (ragged) and one-hot (dense).


def _ragged_experts(x, experts, weights, gate, up, down, *, first=0, dtype):
  """``Σ_j w_tj · SwiGLU_{e_tj}(x_t)`` over the experts ``[first, first + E_local)`` held in ``gate,
  up [E_local, D, Fe]``, ``down [E_local, Fe, D]``; assignments to other experts contribute 0.

  x ``[T, D]``, experts int32 ``[T, k]``, weights f32 ``[T, k]`` → f32 ``[T, D]``. The T·k assignments
  are sorted by (local) expert id, assignments to non-local experts last; ``ragged_dot`` multiplies
  each expert's contiguous rows by its weights.
  """
  t, k = experts.shape
  n_local = gate.shape[0]
  local = experts.reshape(-1) - first  # [T·k]
  in_range = (local >= 0) & (local < n_local)
  key = jnp.where(in_range, local, n_local)
  order = jnp.argsort(key, stable=True)  # [T·k]: assignments grouped by expert
  sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)  # [E_local]
  rows = order // k  # the token of each sorted assignment
  valid = in_range[order][:, None]  # [T·k, 1]: rows of a local expert (the others lie past every group)
  # ragged_dot leaves rows past the last group unspecified, in its output and in its lhs cotangent:
  # mask both (the where's transpose zeroes their cotangent before it reaches x)
  xs = jnp.where(valid, jnp.take(x, rows, axis=0), 0).astype(dtype)  # [T·k, D]
  ops = lambda a, w: f32_operands_on_cpu(a, w.astype(dtype), preferred_element_type=jnp.float32)
  g = jax.lax.ragged_dot(*ops(xs, gate), sizes, preferred_element_type=jnp.float32).astype(dtype)
  u = jax.lax.ragged_dot(*ops(xs, up), sizes, preferred_element_type=jnp.float32).astype(dtype)
  h = swiglu(g, u)  # [T·k, Fe]
  y = jax.lax.ragged_dot(*ops(h, down), sizes, preferred_element_type=jnp.float32)  # f32 [T·k, D]
  w = jnp.where(in_range, weights.reshape(-1), 0.0)[order]  # 0 for other experts' rows
  y = jnp.where(valid, y * w[:, None], 0.0)
  out = jnp.take(y, jnp.argsort(order), axis=0)  # back to assignment order [T·k, D]
  return jnp.sum(out.reshape(t, k, -1), axis=1)


TILE = 64  # rows per tile of the tiled dispatch


@jax.custom_vjp
def _tile_matmul(xt: jax.Array, w: jax.Array, tile_expert: jax.Array) -> jax.Array:
  """``out[t] = xt[t] · w[tile_expert[t]]``: xt ``[n, m, Din]``, w ``[E, Din, Dout]``, tile_expert
  int32 ``[n]`` → f32 ``[n, m, Dout]``; one ``[m, Din]·[Din, Dout]`` matmul per tile in a ``lax.map``
  (no ``[n, Din, Dout]`` gather of weights). Backward (hand-written, so the weight gradient is
  accumulated in place, one expert slice per tile)::

      ∂xt[t] = ct[t] · w[e_t]ᵀ,     ∂w[e] = Σ_{t: e_t = e} xt[t]ᵀ · ct[t]
  """
  return jax.lax.map(lambda a: _mm(a[0], w[a[1]]), (xt, tile_expert))


def _mm(a, b):
  return jnp.dot(*f32_operands_on_cpu(a, b, preferred_element_type=jnp.float32), preferred_element_type=jnp.float32)


def _varying_axes(a) -> frozenset:
  """The manual mesh axes ``a`` varies over inside ``jax.shard_map`` (empty outside)."""
  t = jax.typeof(a)
  manual = getattr(t, "manual_axis_type", None)
  return frozenset(manual.varying) if manual is not None else frozenset(getattr(t, "vma", ()))


def _tile_matmul_fwd(xt, w, tile_expert):
  return _tile_matmul(xt, w, tile_expert), (xt, w, tile_expert)


def _tile_matmul_bwd(res, ct):
  xt, w, tile_expert = res
  dx = jax.lax.map(lambda a: _mm(a[0], w[a[1]].T), (ct, tile_expert))

  def add(dw, a):
    x_t, ct_t, e = a
    part = jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + _mm(x_t.T, ct_t)
    return jax.lax.dynamic_update_index_in_dim(dw, part, e, axis=0), None

  init = jnp.zeros(w.shape, jnp.float32)
  # inside shard_map the carry must vary over the mesh axes its per-tile contributions vary over
  vma = tuple(sorted(set().union(*(_varying_axes(a) for a in (xt, ct, w, tile_expert)))))
  if vma:
    init = jax.lax.pcast(init, vma, to="varying")
  dw, _ = jax.lax.scan(add, init, (xt, ct.astype(jnp.float32), tile_expert))
  return _sum_to(dx, xt).astype(xt.dtype), _sum_to(dw, w).astype(w.dtype), None


def _sum_to(ct, primal):
  """Inside ``jax.shard_map``: ``ct`` summed over the mesh axes it varies over and ``primal`` does not
  (the transpose of the implicit broadcast of ``primal`` to them, e.g. a weight's gradient summed over
  the batch shards); ``ct`` itself elsewhere."""
  extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def _tiled_experts(x, experts, weights, gate, up, down, *, first=0, dtype, tile=TILE):
  """The dropless grouped computation of :func:`_ragged_experts` without ``ragged_dot`` (which XLA:CPU
  and XLA:GPU without the Pallas lowering expand to a dense masked ``[E, T·k, D]`` product): the
  assignments sorted by expert are laid out so each expert's rows start a new tile of ``tile`` rows
  (at most ``ceil(T·k/tile) + E`` tiles, padding rows zero), and each tile is one matmul with its
  expert's weights (:func:`_tile_matmul`). Work: ``3·D·Fe`` per assignment plus the padding."""
  t, k = experts.shape
  n_local = gate.shape[0]
  n = t * k
  local = experts.reshape(-1) - first
  in_range = (local >= 0) & (local < n_local)
  key = jnp.where(in_range, local, n_local)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)  # [E_local]
  starts = jnp.cumsum(sizes) - sizes  # first sorted row of each expert
  tiles = (sizes + tile - 1) // tile  # tiles per expert
  tile_starts = jnp.cumsum(tiles) - tiles  # first tile of each expert
  n_tiles = -(-n // tile) + n_local  # static bound
  sorted_key = key[order]
  ok = sorted_key < n_local
  e_row = jnp.minimum(sorted_key, n_local - 1)
  pos = tile_starts[e_row] * tile + jnp.arange(n) - starts[e_row]  # padded row of each sorted row
  pos = jnp.where(ok, pos, n_tiles * tile)  # other experts' rows: dropped by the scatter (out of range)
  tile_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(tiles), jnp.arange(n_tiles), side="right"), 0, n_local - 1)
  rows = order // k
  xs = jnp.take(x, rows, axis=0).astype(dtype)
  xp = jnp.zeros((n_tiles * tile, x.shape[-1]), dtype).at[pos].set(xs, mode="drop").reshape(n_tiles, tile, -1)
  tm = lambda a, w: _tile_matmul(a, w.astype(dtype), tile_expert.astype(jnp.int32))
  g, u = tm(xp, gate).astype(dtype), tm(xp, up).astype(dtype)
  h = swiglu(g, u)  # [n_tiles, tile, Fe]
  yp = tm(h, down).reshape(n_tiles * tile, -1)  # f32
  y = jnp.take(yp, jnp.minimum(pos, n_tiles * tile - 1), axis=0)  # [T·k, D] in sorted order
  w = jnp.where(in_range, weights.reshape(-1), 0.0)[order]
  y = jnp.where(ok[:, None], y * w[:, None], 0.0)
  out = jnp.take(y, jnp.argsort(order), axis=0)
  return jnp.sum(out.reshape(t, k, -1), axis=1)


def _dense_experts(x, experts, weights, gate, up, down, *, first=0, dtype):
  """The one-hot baseline of :func:`_ragged_experts`: every local expert on every token, combined by
  the ``[T, E_local]`` matrix of routing weights (zero off the chosen experts)."""
  n_local = gate.shape[0]
  combine = jnp.sum(jax.nn.one_hot(experts - first, n_local, dtype=jnp.float32) * weights[..., None], axis=1)
  xd = x.astype(dtype)
  g = jnp.einsum("td,edf->etf", *f32_operands_on_cpu(xd, gate.astype(dtype), preferred_element_type=jnp.float32))
  u = jnp.einsum("td,edf->etf", *f32_operands_on_cpu(xd, up.astype(dtype), preferred_element_type=jnp.float32))
  h = swiglu(g.astype(dtype), u.astype(dtype))  # [E, T, Fe]
  y = jnp.einsum("etf,efd->etd", *f32_operands_on_cpu(h, down.astype(dtype), preferred_element_type=jnp.float32))
  return jnp.einsum("etd,te->td", y.astype(jnp.float32), combine)


_EXPERT_FNS = {"tiled": _tiled_experts, "ragged": _ragged_experts, "dense": _dense_experts}


def _mesh_axes(rule, mesh) -> tuple[str, ...]:
  axes = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def _run_experts(fn, x, experts, weights, gate, up, down, *, dtype, rules):
  """``fn`` without a context mesh; with one, inside ``jax.shard_map``: batch rows over
  ``rules["batch"]``, experts over ``rules["expert"]`` (partial outputs ``psum``-ed over it).

  x ``[B, S, D]``, experts/weights ``[B, S, k]`` → f32 ``[B, S, D]``.
  """
  b, s, d = x.shape
  flat = lambda a: a.reshape(-1, a.shape[-1])
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(flat(x), flat(experts), flat(weights), gate, up, down, dtype=dtype).reshape(b, s, d)
  batch_axes = _mesh_axes(rules.get("batch"), mesh)
  expert_axes = _mesh_axes(rules.get("expert"), mesh)
  both = sorted(set(batch_axes) & set(expert_axes))
  if both:
    raise ValueError(
      f"MoE: mesh axes {both} shard both the batch and the experts (rules['batch']={rules.get('batch')!r}, "
      f"rules['expert']={rules.get('expert')!r}); map 'expert' to axes the batch is not split over (e.g. 'tensor')"
    )
  n_ep = math.prod(mesh.shape[a] for a in expert_axes)
  if gate.shape[0] % n_ep:
    raise ValueError(f"MoE: {gate.shape[0]} experts are not divisible by the expert mesh axes {expert_axes} ({n_ep})")
  n_local = gate.shape[0] // n_ep
  bspec = PartitionSpec(batch_axes or None, None, None)
  wspec = PartitionSpec(expert_axes or None, None, None)

  def local(x, experts, weights, gate, up, down):
    bl = x.shape[0]
    first = 0
    if expert_axes:
      first = jax.lax.axis_index(expert_axes) * n_local
      # Tokens and weights are the same on every device of the expert axes, but each device gathers
      # its own rows of them: cast them to varying, so that their cotangents are summed over those axes
      # (the transpose of the cast is a psum). Without it, jax 0.10 gave the cotangent of a gather with
      # device-dependent indices one device's partial sum (tests/test_moe_sharded.py caught it).
      x = jax.lax.pcast(x, expert_axes, to="varying")
      weights = jax.lax.pcast(weights, expert_axes, to="varying")
    y = fn(flat(x), flat(experts), flat(weights), gate, up, down, first=first, dtype=dtype)
    if expert_axes:
      y = jax.lax.psum(y, expert_axes)
    return y.reshape(bl, s, d)

  return jax.shard_map(local, in_specs=(bspec,) * 3 + (wspec,) * 3, out_specs=bspec, check_vma=True)(
    x, experts, weights, gate, up, down
  )


# ----------------------------------------------------------------------------------------------
# Modules.


class MoEBlock(nnx.Module):
  """The sparse MLP of one layer (module docstring for the formulas).

  Parameters: ``router [D, E]`` ("embed", None); ``gate``, ``up [E, D, Fe]`` ("expert", "embed",
  "expert_mlp"); ``down [E, Fe, D]`` ("expert", "expert_mlp", "embed"); Qwen2-MoE: ``shared`` (a
  ``SwiGLU`` of width ``shared_expert_intermediate_size``, adapters allowed) and ``shared_gate [D, 1]``
  ("embed", None). Static: ``dispatch`` ("tiled", "ragged" or "dense", module docstring; "auto", the default:
  :func:`default_dispatch` of the platform the program is traced for), ``top_k``, ``norm_topk_prob``,
  ``rules`` (the model's rules table, for the mesh layout of the dispatch). In the sampler's quantised copy
  (``models.lora.rollout_weights``) ``gate``/``up``/``down`` are ``QuantizedWeight`` s (``batch=1``, one scale per
  expert and output channel), dequantised per call. The routed experts take
  no LoRA adapter (``jaxgrpo.models.lora`` lists only attention and dense/shared MLP projections).
  """

  def __init__(self, cfg: MoEConfig, *, dtype, param_dtype, rngs: nnx.Rngs, rules=None):
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.dtype = dtype
    self.top_k, self.norm_topk_prob, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, E
    self.dispatch = "auto"
    self.rules = freeze_rules(rules)
    self.router = param(rngs.params(), (D, E), ("embed", None), param_dtype)
    self.gate = param(rngs.params(), (E, D, F), ("expert", "embed", "expert_mlp"), param_dtype)
    self.up = param(rngs.params(), (E, D, F), ("expert", "embed", "expert_mlp"), param_dtype)
    self.down = param(rngs.params(), (E, F, D), ("expert", "expert_mlp", "embed"), param_dtype)
    if cfg.shared_expert_intermediate_size:
      shared_cfg = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
      self.shared = SwiGLU(shared_cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.shared_gate = param(rngs.params(), (D, 1), ("embed", None), param_dtype)
    else:
      self.shared = self.shared_gate = None

  def route(self, x: jax.Array, replay: jax.Array | None = None):
    """x ``[B, S, D]`` → (logits f32 ``[B, S, E]``, experts int32 ``[B, S, k]``, weights f32 ``[B, S, k]``)."""
    logits = dense(x, self.router[...].astype(self.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if replay is None:
      weights, experts = jax.lax.top_k(probs, self.top_k)
    else:
      if replay.shape != x.shape[:2] + (self.top_k,):
        raise ValueError(
          f"replayed experts have shape {replay.shape}, expected [B, S, k] = {x.shape[:2] + (self.top_k,)}"
        )
      experts = replay.astype(jnp.int32)
      weights = jnp.take_along_axis(probs, experts, axis=-1)
    if self.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, experts.astype(jnp.int32), weights

  def __call__(self, x: jax.Array, dropout_key=None, replay: jax.Array | None = None):
    """x ``[B, S, D]`` → (y ``[B, S, D]`` in the compute dtype, :class:`Route`)."""
    dispatch = default_dispatch() if self.dispatch == "auto" else self.dispatch
    if dispatch not in _EXPERT_FNS:
      raise ValueError(f"MoEBlock.dispatch must be one of {DISPATCH} or 'auto'; got {self.dispatch!r}")
    logits, experts, weights = self.route(x, replay)
    # HF casts the routing weights to the hidden dtype before weighting the experts' outputs
    weights = weights.astype(self.dtype).astype(jnp.float32)
    y = _run_experts(
      _EXPERT_FNS[dispatch],
      x,
      experts,
      weights,
      *(_expert_weight(w, self.dtype) for w in (self.gate, self.up, self.down)),
      dtype=self.dtype,
      rules=dict(self.rules),
    )
    if self.shared is not None:
      gate = dense(x, self.shared_gate[...].astype(self.dtype), preferred_element_type=jnp.float32)
      y = y + jax.nn.sigmoid(gate) * self.shared(x, dropout_key).astype(jnp.float32)
    return y.astype(self.dtype), Route(logits, experts)


def _expert_weight(w, dtype) -> jax.Array:
  """An expert stack ``[E, ...]``: the parameter's value, or a quantised rollout copy's ``ŵ`` in ``dtype``
  (``QuantizedWeight`` with ``batch=1``: ``models.lora.rollout_weights``)."""
  return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w[...]


class MoEDecoderBlock(LlamaBlock):
  """A Qwen-MoE decoder layer: ``x += attn(rms_1(x))``; ``x += mlp(rms_2(x))`` with ``mlp`` a
  :class:`MoEBlock` (``sparse``: layer ``layer`` is in ``cfg.moe_layers``) or the dense ``SwiGLU``.

  A sparse layer returns ``(x, kv, Route)``: the third output is the layer's routing, handed by
  ``CausalLM.__call__`` to ``MoEModel._side_output`` (a scanned stack's, stacked, to
  ``MoEModel._stacked_side_output``); it reads its replayed experts ``replay[:, :, m]`` from the active
  :func:`routing_scope`, m found from the layer being traced (``layers.current_layer_index``). Its static
  attributes (``sparse``, ``moe_layers``) are the same for every sparse layer, so sparse layers stack.
  """

  def __init__(self, cfg: MoEConfig, layer: int, *, dtype, param_dtype, rngs, rules=None):
    self._init_attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.moe_layers = tuple(cfg.moe_layers)
    self.sparse = layer in self.moe_layers
    if self.sparse:
      self.mlp = MoEBlock(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, rules=rules)
    else:
      self.mlp = SwiGLU(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, positions, segment_ids, kv, valid, index, dropout_key=None):
    x, kv = self._attend(x, positions, segment_ids, kv, valid, index, dropout_key)
    h = self.post_attention_norm(x)
    if not self.sparse:
      return x + self.mlp(h, dropout_key), kv
    y, route = self.mlp(h, dropout_key, self._replay(x.shape[:2]))
    return x + y, kv, route

  def _replay(self, rows: tuple[int, int]) -> jax.Array | None:
    """This layer's replayed experts ``int[B, S, k]`` from the active :func:`routing_scope` (None without one)."""
    scope = _SCOPE.get()
    if scope is None or scope.replay is None:
      return None
    r, m_total = scope.replay, len(self.moe_layers)
    if r.shape[:2] != tuple(rows) or r.shape[2] < m_total or r.shape[3] != self.mlp.top_k:
      raise ValueError(
        f"routing_scope replay has shape {tuple(r.shape)}; this forward needs [B, S, M, k] with "
        f"[B, S] = {tuple(rows)}, M >= {m_total}, k = {self.mlp.top_k}"
      )
    layer = current_layer_index()
    if layer is None:
      raise ValueError(
        "routing_scope replay: a MoEDecoderBlock called outside its model's layer stack does not know its "
        "sparse-layer index; call the model (or enter jaxgrpo.models.layers.layer_index(l) around the layer)"
      )
    if isinstance(layer, int):  # the loop: a static slice
      return r[:, :, self.moe_layers.index(layer)]
    return jax.lax.dynamic_index_in_dim(r, layer, axis=2, keepdims=False)  # a scanned stack: every layer sparse


class MoEModel(LlamaModel):
  """Qwen3-MoE / Qwen2-MoE causal LM. Same call contract as every ``CausalLM`` (``CausalLM.__call__``);
  routing outputs and replay through :func:`routing_scope`.

  Parameters: as ``LlamaModel`` (embed_tokens, layers, final_norm, lm_head), each layer a
  :class:`MoEDecoderBlock`. ``moe_layers``: the indices of the sparse layers (M of them).
  ``scan_layers=True``: the layers stacked and run as one scan (module docstring, "Scanned layers"); only
  when every layer is sparse (ValueError naming the dense layers otherwise).
  """

  def __init__(
    self,
    config: MoEConfig,
    *,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    remat: RematPolicy | str | bool = False,
    rules: Mapping[str, Any] | None = None,
    scan_layers: bool = False,
  ):
    if not isinstance(config, (Qwen3MoeConfig, Qwen2MoeConfig)):
      raise TypeError(f"config must be a Qwen3MoeConfig or Qwen2MoeConfig, got {type(config).__name__}")
    dense_layers = [i for i in range(config.num_layers) if i not in config.moe_layers]
    if check_scan_layers(scan_layers) and dense_layers:
      raise ValueError(SCAN_LAYERS_MOE_ERROR.format(type(config).__name__, dense_layers))
    self.config = config
    self.scan_layers = scan_layers
    self.dtype = dtype
    self.remat, self.sharding_rules = RematPolicy.parse(remat), freeze_rules(rules)
    V, D = config.vocab_size, config.hidden_size
    self.embed_tokens = param(rngs.params(), (V, D), ("vocab", "embed"), param_dtype)
    self.moe_layers = config.moe_layers
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, rules=rules)
    blocks = [MoEDecoderBlock(config, i, **kw) for i in range(config.num_layers)]
    self.layers = stack_blocks(blocks) if scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(D, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.lm_head = None if config.tie_word_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), param_dtype)

  def _side_output(self, layer: int, route: Route) -> None:
    scope = _SCOPE.get()
    if scope is not None:
      scope.routes[self.moe_layers.index(layer)] = route

  def _stacked_side_output(self, route: Route) -> None:
    """A scanned stack's routes ``[M, B, S, ...]`` (every layer sparse: layer l is sparse layer l)."""
    scope = _SCOPE.get()
    if scope is not None:
      scope.scanned = route
      scope.routes.update({m: Route(route.logits[m], route.experts[m]) for m in range(route.experts.shape[0])})


SCAN_LAYERS_MOE_ERROR = (
  "scan_layers=True needs every layer of a MoE model sparse ({}): layers {} are dense (mlp_only_layers / "
  "decoder_sparse_step), so the layers differ and do not stack; use scan_layers=False"
)


def is_moe(model) -> bool:
  """Whether ``model`` is a mixture of experts with at least one sparse layer: it lists them in ``moe_layers``
  (any family's model that does, not only :class:`MoEModel` and its subclasses)."""
  return num_moe_layers(model) > 0


def num_moe_layers(model) -> int:
  """M, the number of sparse layers (0 for a dense model)."""
  return len(getattr(model, "moe_layers", ()))


def set_dispatch(model, dispatch: str) -> None:
  """Set every sparse layer's expert computation: ``"tiled"``, ``"ragged"`` (grouped matmuls) or
  ``"dense"`` (the one-hot baseline); see the module docstring; or ``"auto"`` (a new layer's: :func:`default_dispatch`
  of the platform the program is traced for). A static attribute: a jitted function retraces."""
  if dispatch not in DISPATCH + ("auto",):
    raise ValueError(f"dispatch must be one of {DISPATCH} or 'auto'; got {dispatch!r}")
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MoEBlock):
      module.dispatch = dispatch


# ----------------------------------------------------------------------------------------------
# Router losses and metrics (pure functions of stacked routes [B, S, M, ...] and a token mask [B, S]).


def _masked_mean(x, mask, axis):
  m = mask.astype(jnp.float32)
  return jnp.sum(x * m, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)


def load_balancing_loss(route: Route, mask: jax.Array, num_experts: int) -> jax.Array:
  """HF's ``load_balancing_loss_func`` (Switch Transformer eq. 4-6), over every sparse layer at once.

  With ``P_e`` the mean router probability of expert e and ``f_e`` the mean number of times e is in a
  token's top k, both over the real tokens (``mask``) of every layer::

      aux = E · Σ_e f_e · P_e          (k·1 for perfectly uniform routing, E·k·1 for full collapse)

  Args:
    route: stacked routes, ``logits f32[B, S, M, E]``, ``experts int[B, S, M, k]``.
    mask: ``bool[B, S]`` real tokens.
  Returns:
    ``f32[]``.
  """
  probs = jax.nn.softmax(route.logits.astype(jnp.float32), axis=-1)  # [B, S, M, E]
  counts = jnp.sum(jax.nn.one_hot(route.experts, num_experts, dtype=jnp.float32), axis=-2)  # [B, S, M, E]
  m = jnp.broadcast_to(mask[:, :, None, None], counts.shape[:3] + (1,))
  f = _masked_mean(counts, m, axis=(0, 1, 2))  # [E]
  p = _masked_mean(probs, m, axis=(0, 1, 2))  # [E]
  return num_experts * jnp.sum(f * p)


def router_z_loss(route: Route, mask: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss: the mean over real tokens and sparse layers of ``logsumexp(z)²``; f32[]."""
  lse = jax.nn.logsumexp(route.logits.astype(jnp.float32), axis=-1)  # [B, S, M]
  return _masked_mean(jnp.square(lse), jnp.broadcast_to(mask[:, :, None], lse.shape), axis=(0, 1, 2))


def routing_sums(route: Route, mask: jax.Array, num_experts: int) -> dict[str, jax.Array]:
  """Additive statistics of one forward (sum them over micro-batches, then :func:`routing_metrics`):
  ``load f32[M, E]`` (assignments per expert), ``router_entropy f32[M]`` (Σ over tokens of the
  router's entropy ``-Σ_e p_e log p_e``), ``tokens f32[]`` (real tokens)."""
  m = mask.astype(jnp.float32)
  onehot = jax.nn.one_hot(route.experts, num_experts, dtype=jnp.float32)  # [B, S, M, k, E]
  load = jnp.einsum("bsmke,bs->me", onehot, m)
  logp = jax.nn.log_softmax(route.logits.astype(jnp.float32), axis=-1)
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [B, S, M]
  return {"load": load, "router_entropy": jnp.einsum("bsm,bs->m", ent, m), "tokens": jnp.sum(m)}


def routing_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Per sparse layer m, from :func:`routing_sums`: ``moe/m/load_min``, ``moe/m/load_max`` (the
  smallest / largest expert share of the layer's token assignments, uniform = 1/E),
  ``moe/m/load_entropy`` (entropy of those shares, uniform = log E) and ``moe/m/router_entropy`` (the
  router's mean entropy per token); and ``moe/aux_loss`` / ``moe/z_loss`` when ``sums`` holds their
  token-weighted sums (``aux_loss``, ``z_loss``: the train step adds them)."""
  load = sums["load"]
  share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)  # [M, E]
  ent = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)), 0.0), axis=-1)
  router = sums["router_entropy"] / jnp.maximum(sums["tokens"], 1.0)
  out = {}
  for m in range(load.shape[0]):
    out[f"moe/{m}/load_min"] = jnp.min(share[m])
    out[f"moe/{m}/load_max"] = jnp.max(share[m])
    out[f"moe/{m}/load_entropy"] = ent[m]
    out[f"moe/{m}/router_entropy"] = router[m]
  for name in ("aux_loss", "z_loss"):
    if name in sums:
      out[f"moe/{name}"] = sums[name] / jnp.maximum(sums["tokens"], 1.0)
  return out
