"""The building blocks every family composes: annotated parameters, the projection (``dense``, ``project``,
``LoRA``, ``QuantizedWeight``), norms, and the trace-time switches of a model (activation sharding, forward-mode
autodiff, the layer index of a scanned stack). Attention and the KV cache are ``jaxgrpo.models.attention``; what
the target platform decides (bf16 products on the CPU, the cache's dtype) is ``jaxgrpo.models.backend``.

Axis vocabulary: B batch, S new tokens, T cache slots / keys, D model width, H query heads,
N key/value heads, G = H/N query heads per kv head, K head dim, F MLP width, V vocab (and, in
``jaxgrpo.models.moe``, E experts with the logical axis "expert", Fe expert width "expert_mlp").

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds one logical axis name
per dim (see ``LOGICAL_AXES``); ``eager_sharding=False`` so no mesh is needed at construction.

Every projection goes through ``project``: the base weight (a plain ``nnx.Param`` or a
``QuantizedWeight``, dequantised on the fly), its optional bias, and its optional ``LoRA`` adapter.
Modules with projections list them in ``PROJECTIONS`` (name → number of contracted dims) and hold
the adapter of projection ``p`` in the attribute ``p_lora`` (None until
``jaxgrpo.models.lora.apply_lora`` sets it).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models import quant
from jaxgrpo.models.backend import f32_operands_on_cpu, mixed_einsum, mixed_on_cpu, native_bf16_dots, scoped
from jaxgrpo.parallel.sharding import constrain

__all__ = [
  "LOGICAL_AXES",
  "MLP_AXES",
  "TABLE_AXES",
  "param",
  "RMSNorm",
  "LayerNorm",
  "dense",
  "activation_rules",
  "shard_activation",
  "forward_mode_autodiff",
  "forward_mode_active",
  "current_layer_index",
  "layer_index",
  "project",
  "LoRA",
  "QuantParam",
  "QuantizedWeight",
]

LOGICAL_AXES = ("vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "expert", "expert_mlp")
MLP_AXES = ("batch", "activation_length", "mlp")  # the MLP hidden activation [B, S, F]
# An embedding table as it is read by the token gather: rows keep the vocab sharding, D is gathered
# (FSDP all-gathers weights before use). Gathering from a D-sharded table made XLA replicate the
# gather's result and cotangent ("involuntary full rematerialization") on an fsdp × tensor mesh.
TABLE_AXES = ("vocab", None)
_ACTIVATION_RULES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
  "jaxgrpo_activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(rules: Mapping[str, Any] | None) -> Iterator[None]:
  """Inside the block, :func:`shard_activation` uses ``rules`` (None: ``DEFAULT_RULES``).

  ``CausalLM.__call__`` enters it with its model's ``sharding_rules`` for the duration of its own
  trace, so the layers need no extra argument. The rules reach ``jax.jit``'s cache key through the
  model (a static attribute of its graphdef), never through this context alone.
  """
  with scoped(_ACTIVATION_RULES, rules):
    yield


_FORWARD_MODE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxgrpo_forward_mode", default=False)
_LAYER_INDEX: contextvars.ContextVar[jax.Array | int | None] = contextvars.ContextVar(
  "jaxgrpo_layer_index", default=None
)


@contextlib.contextmanager
def layer_index(i: jax.Array | int) -> Iterator[None]:
  """Inside the block, the layer being traced is ``i``: an int32 scalar, traced, in a scanned stack; a Python
  int in the loop. A stacked ``LoRA`` (``layer_stride > 0``) draws its dropout stream from it, a MoE layer
  finds its sparse-layer index (its replayed experts) from it. Entered by ``CausalLM`` around each layer's
  trace (the loop and the scanned stack, ``scan_layers=True``)."""
  with scoped(_LAYER_INDEX, i):
    yield


def current_layer_index() -> jax.Array | int | None:
  """The index of the layer being traced (:func:`layer_index`): a Python int in the loop, a traced int32 scalar
  in a scanned stack, None outside a model's layer stack."""
  return _LAYER_INDEX.get()


@contextlib.contextmanager
def forward_mode_autodiff(enabled: bool = True) -> Iterator[None]:
  """Inside the block, models traced use formulations that every JAX transformation differentiates,
  forward mode included (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``, ``jax.hessian``).

  By default three hand-written reverse-mode gradients (``jax.custom_vjp``: the attention softmax,
  SwiGLU, the LM head's log-prob kernel ``jaxgrpo.models.log_probs.head_log_probs``) save training
  memory, and JAX cannot apply forward-mode autodiff to a ``custom_vjp`` function. Here the same
  forward values come from ``jax.nn.softmax``, ``jax.nn.silu(g) * u`` and the head under
  ``jax.checkpoint``, differentiated by plain autodiff in either mode (reverse mode then holds more
  temporary memory: the ``autodiff`` rows of ``scripts/bench_head.py``). Read when the model is
  *traced*: enter it inside the function you transform or ``jit`` (``log_probs(..., forward_mode=True)``
  does), not around calls of an already compiled function.
  """
  with scoped(_FORWARD_MODE, bool(enabled)):
    yield


def forward_mode_active() -> bool:
  """Whether :func:`forward_mode_autodiff` is in effect (at trace time)."""
  return _FORWARD_MODE.get()


def current_activation_rules() -> Mapping[str, Any] | None:
  """The rules :func:`shard_activation` applies now (those of :func:`activation_rules`; None: the defaults)."""
  return _ACTIVATION_RULES.get()


def shard_activation(x: jax.Array, axes: tuple[str | None, ...], name: str) -> jax.Array:
  """``jaxgrpo.parallel.sharding.constrain(x, axes, rules, name)`` with the rules of the model being traced
  (:func:`activation_rules`): a no-op without a context mesh. ``x [*dims]`` with one logical name
  (or None) per dim in ``axes``; returns ``x`` (same shape and dtype), constrained."""
  return constrain(x, axes, _ACTIVATION_RULES.get(), name)


def dense(
  x: jax.Array, w: jax.Array, *, contract: int = 1, transpose_w: bool = False, preferred_element_type=None
) -> jax.Array:
  """``x [..., *C] · w [*C, *O] → [..., *O]`` (``transpose_w``: ``w [*O, *C]``) as one 2-D matmul.

  The leading (token) dims of ``x`` and the last ``contract`` dims are each flattened to one, so
  the matmul is ``[T, prod C] · [prod C, prod O]``. Why not ``einsum("bsd,df->bsf")``: the weight
  gradient of that einsum contracts *two* dims (b, s), and XLA:CPU then materialises a transposed
  copy of the activation gradient before the dot (a strided loop fused with the elementwise
  backward). With one contracting dim the dot takes its operands as they are (measured:
  ``scripts/bench_projections.py``, BENCHMARKS.md).
  """
  if not isinstance(contract, int) or isinstance(contract, bool) or not 1 <= contract <= min(x.ndim, w.ndim):
    raise ValueError(
      f"dense: contract must be an int in [1, min(x.ndim, w.ndim)] = [1, {min(x.ndim, w.ndim)}]; "
      f"got {contract!r} for x {x.shape}, w {w.shape}"
    )
  lead = x.shape[: x.ndim - contract]
  c = x.shape[x.ndim - contract :]
  if transpose_w:
    out, wc = w.shape[: w.ndim - contract], w.shape[w.ndim - contract :]
  else:
    wc, out = w.shape[:contract], w.shape[contract:]
  if tuple(wc) != tuple(c):
    raise ValueError(f"dense: x's last {contract} dims {c} do not match w's contracted dims {wc}")
  x2 = x.reshape(math.prod(lead), math.prod(c))
  if preferred_element_type in (None, jnp.float32) and not _FORWARD_MODE.get() and mixed_on_cpu(x2, w):
    # bf16 on XLA:CPU: accumulated in float32 (and rounded back to bf16 unless float32 was asked); the products
    # with bf16 operands where they are fast (cpu_bf16_dots), else in float32
    w2 = w.reshape(math.prod(out), math.prod(c)) if transpose_w else w.reshape(math.prod(c), math.prod(out))
    spec = "tc,oc->to" if transpose_w else "tc,co->to"
    if native_bf16_dots():
      y = mixed_einsum(spec, x2, w2)
    else:
      y = jnp.einsum(spec, x2.astype(jnp.float32), w2.astype(jnp.float32))
    return y.astype(preferred_element_type or x.dtype).reshape(*lead, *out)
  x2, w = f32_operands_on_cpu(x2, w, preferred_element_type=preferred_element_type)
  if transpose_w:
    y = jnp.einsum(
      "tc,oc->to", x2, w.reshape(math.prod(out), math.prod(c)), preferred_element_type=preferred_element_type
    )
  else:
    y = jnp.dot(x2, w.reshape(math.prod(c), math.prod(out)), preferred_element_type=preferred_element_type)
  return y.reshape(*lead, *out)


def param(
  key: jax.Array | None,
  shape: tuple[int, ...],
  axes: tuple[str | None, ...],
  dtype,
  init: str = "normal",
  stddev: float = 0.02,
) -> nnx.Param:
  """An ``nnx.Param`` of ``shape``/``dtype`` annotated with logical ``axes`` (one name per dim).

  init: "normal" (N(0, stddev²)), "zeros" or "ones".
  """
  if len(axes) != len(shape):
    raise ValueError(f"axes {axes} must name every dim of shape {shape}")
  for a in axes:
    if a is not None and a not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {a!r}; expected one of {LOGICAL_AXES}")
  if init == "normal":
    value = (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    raise ValueError(f"init must be 'normal', 'zeros' or 'ones', got {init!r}")
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class QuantParam(nnx.Param):
  """Storage of a quantised, frozen base weight (codes or scales; see ``QuantizedWeight``).

  A ``nnx.Param`` subclass so that sharding (``out_sharding``) and checkpoint code treat it like any
  parameter; filter it out (or select only ``nnx.LoRAParam``) when taking gradients.
  """


class QuantizedWeight(nnx.Module):
  """A projection weight ``w [*C, *O]`` stored quantised (``jaxgrpo.models.quant``), dequantised per call.

  ``codes``/``scales`` are ``QuantParam`` with the weight's logical axes (the grouped dim keeps its
  name; int8/fp8 scales have None on the contracted dims). Static: ``kind``, ``contract``,
  ``group_size``, ``shape`` (the logical weight shape), ``axes`` (its logical axes), ``batch`` (leading
  dims quantised independently, e.g. 1 for a mixture of experts' ``[E, D, F]``: the weight is
  ``[*batch, *C, *O]``; per-channel kinds only).
  """

  def __init__(
    self,
    codes: jax.Array,
    scales: jax.Array,
    *,
    kind: str,
    contract: int,
    group_size: int,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    batch: int = 0,
  ):
    if batch and kind not in quant.PER_CHANNEL_KINDS:
      raise ValueError(
        f"a batched (batch={batch}) quantised weight must be one of {quant.PER_CHANNEL_KINDS}; got {kind!r}"
      )
    lead = tuple(shape[:batch])
    codes_shape, scales_shape = quant.quantized_shapes(
      shape[batch:], kind=kind, contract=contract, group_size=group_size
    )
    codes_shape, scales_shape = lead + codes_shape, lead + scales_shape
    if tuple(codes.shape) != codes_shape or tuple(scales.shape) != scales_shape:
      raise ValueError(
        f"{kind} weight {shape}: codes {codes.shape} / scales {scales.shape}, expected {codes_shape} / {scales_shape}"
      )
    k = batch + contract
    per_channel = kind in quant.PER_CHANNEL_KINDS
    scale_axes = tuple(axes[:batch]) + (None,) * contract + tuple(axes[k:]) if per_channel else tuple(axes)
    self.codes = QuantParam(codes, out_sharding=tuple(axes), eager_sharding=False)
    self.scales = QuantParam(scales, out_sharding=scale_axes, eager_sharding=False)
    self.kind, self.contract, self.group_size = kind, contract, group_size
    self.shape, self.axes = tuple(shape), tuple(axes)
    if batch:  # set only when used: the graph of every other quantised weight stays as it was
      self.batch = batch

  def dequantize(self, dtype) -> jax.Array:
    """``ŵ [*batch, *C, *O]`` in ``dtype``."""
    if getattr(self, "batch", 0):  # per channel: the scales broadcast over the batch dims as they are
      return (self.codes[...].astype(jnp.float32) * self.scales[...]).astype(dtype)
    return quant.dequantize(
      self.codes[...], self.scales[...], kind=self.kind, contract=self.contract, group_size=self.group_size, dtype=dtype
    )


class LoRA(nnx.Module):
  """Low-rank adapter of one projection ``w [*C, *O]`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

  ``Δy = scale · (dropout(x) · A) · B`` with ``A [*C, r]`` (the weight's contracted axes, then
  None) and ``B [r, *O]`` (None, then the weight's output axes), both ``nnx.LoRAParam``, so
  ``nnx.split(model, nnx.LoRAParam, ...)`` separates adapters from base weights and the adapters
  shard like the weight they adapt. The merged weight is ``w + scale · A·B``.

  Dropout (rate ``dropout``, inverted: kept inputs are divided by ``1 - dropout``) applies to the
  adapter's input only, and only when a ``dropout_key`` is given; its mask is drawn from
  ``fold_in(key, stream)``, ``stream`` being this adapter's index in the model, so every adapter has
  its own mask and a given key always gives the same masks. ``dropout_key`` is one typed key (one
  mask for the whole input), a key per batch row (``key[B]``: row b's mask comes from
  ``fold_in(key[b], stream)`` alone, so it does not depend on how rows are split into micro-batches
  or over devices) or a key per token (``key[B, S]``: token (b, s)'s mask over its features comes from
  ``fold_in(key[b, s], stream)`` alone, so it does not depend on where the token sits: packed rows,
  ``jaxgrpo.models.log_probs.token_dropout_keys``).
  ``enabled`` (static) False: the adapter is skipped (``Δy = 0``), see ``lora.reference_model``.

  In a scanned layer stack (``scan_layers=True``) one ``LoRA`` holds the adapters of every layer
  (``A [L, *C, r]``, ``B [L, r, *O]``) and is applied to one layer's slice at a time; its stream in
  layer ``l`` is ``stream + l · layer_stride`` (``layer_stride`` static, the number of adapters per
  layer; 0 outside a scanned stack), so the masks equal the loop model's.
  """

  def __init__(self, a: jax.Array, b: jax.Array, *, a_axes, b_axes, scale: float, dropout: float, stream: int):
    if a.shape[-1] != b.shape[0]:
      raise ValueError(f"LoRA: A {a.shape} and B {b.shape} disagree on the rank")
    self.a = nnx.LoRAParam(a, out_sharding=tuple(a_axes), eager_sharding=False)
    self.b = nnx.LoRAParam(b, out_sharding=tuple(b_axes), eager_sharding=False)
    self.scale, self.dropout, self.stream = float(scale), float(dropout), int(stream)
    self.enabled = True
    self.layer_stride = 0

  @property
  def rank(self) -> int:
    return self.b.shape[0]

  def __call__(self, x: jax.Array, *, dtype, dropout_key: jax.Array | None = None) -> jax.Array:
    """``x [..., *C] → Δy [..., *O]`` in ``dtype``."""
    if self.dropout > 0 and dropout_key is not None:
      p_keep = 1.0 - self.dropout
      stream = self.stream
      if self.layer_stride:  # a scanned stack: this layer's stream
        layer = _LAYER_INDEX.get()
        if layer is None:
          raise ValueError("a stacked LoRA (layer_stride > 0) is applied outside a scanned layer stack")
        stream = stream + layer * self.layer_stride
      if dropout_key.ndim == 0:
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, stream), p_keep, x.shape)
      else:  # one key per row of x [B, ...], or per token [B, S, ...]
        one = lambda k: jax.random.bernoulli(jax.random.fold_in(k, stream), p_keep, x.shape[dropout_key.ndim :])
        keep = jax.vmap(one)(dropout_key) if dropout_key.ndim == 1 else jax.vmap(jax.vmap(one))(dropout_key)
      x = jnp.where(keep, x / p_keep, jnp.zeros((), x.dtype)).astype(x.dtype)
    h = dense(x, self.a[...].astype(dtype), contract=self.a.ndim - 1)  # [..., r]
    return dense(h, self.b[...].astype(dtype)) * jnp.asarray(self.scale, dtype)


def project(
  x: jax.Array,
  w,
  bias,
  adapter: LoRA | None,
  *,
  dtype,
  contract: int = 1,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """One projection: ``y = x·w (+ bias) (+ adapter(x))`` in ``dtype``, as ``dense`` 2-D matmuls.

  Args:
    x: ``[..., *C]`` activations.
    w: the weight ``[*C, *O]``: an ``nnx.Param`` or a ``QuantizedWeight`` (dequantised here).
    bias: ``nnx.Param [*O]`` or None.
    adapter: a ``LoRA`` or None; skipped when ``adapter.enabled`` is False.
    contract: number of contracted dims ``len(C)``.
    dropout_key: the adapter-dropout key (None: no dropout).

  Returns:
    ``[..., *O]`` in ``dtype``. With no adapter this is exactly the plain projection (same ops).
  """
  weight = w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w[...].astype(dtype)
  y = dense(x, weight, contract=contract)
  if bias is not None:
    y = y + bias[...].astype(dtype)
  if adapter is not None and adapter.enabled:
    y = y + adapter(x, dtype=dtype, dropout_key=dropout_key)
  return y


class RMSNorm(nnx.Module):
  """``y = x / sqrt(mean(x², -1) + eps) * scale``, computed in float32, returned in ``dtype``.

  x: [..., size] (any float dtype) → y: dtype[..., size]; scale: [size] (axis "norm"), initialised
  to ones (HF Llama/Qwen convention, no ``1 +``).
  """

  def __init__(self, size: int, *, eps: float, dtype, param_dtype):
    self.scale = param(None, (size,), ("norm",), param_dtype, init="ones")
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nnx.Module):
  """``y = (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis, in float32.

  x: [..., size] → y: dtype[..., size]; scale (ones) and bias (zeros): [size] (axis "norm").
  """

  def __init__(self, size: int, *, eps: float, dtype, param_dtype):
    self.scale = param(None, (size,), ("norm",), param_dtype, init="ones")
    self.bias = param(None, (size,), ("norm",), param_dtype, init="zeros")
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)
