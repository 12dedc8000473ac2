"""Layers shared by every family: annotated parameters, norms, RoPE, the KV cache and attention.

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

One job at ~600 lines: the building blocks every family shares (parameters, projection, norms,
RoPE, cache, attention); each is small and the families compose them.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import math
import platform
import sys
from typing import Any, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models import quant
from jaxgrpo.parallel.sharding import constrain
from jaxgrpo.parallel.target import current_platform

__all__ = [
  "LOGICAL_AXES",
  "param",
  "RMSNorm",
  "LayerNorm",
  "KVCache",
  "init_kv_cache",
  "repeat_cache",
  "take_cache_rows",
  "put_cache_rows",
  "apply_rope",
  "Attention",
  "dense",
  "activation_rules",
  "shard_activation",
  "forward_mode_autodiff",
  "forward_mode_active",
  "layer_index",
  "project",
  "LoRA",
  "QuantParam",
  "QuantizedWeight",
]

LOGICAL_AXES = ("vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "expert", "expert_mlp")
_NEG_INF = -1e30  # finite so that fully masked (padding) query rows give no NaN
_SMALL_QUERY_ROWS = 8  # S·G at most this: attention by multiply-and-reduce instead of a batched dot
QUERY_AXES = ("batch", "activation_length", "heads", "head_dim")  # q and the attention output [B, S, H, K]
KV_AXES = ("batch", "activation_length", "kv_heads", "head_dim")  # k, v of the new tokens [B, S, N, K]
MLP_AXES = ("batch", "activation_length", "mlp")  # the MLP hidden activation [B, S, F]
# An embedding table as it is read by the token gather: rows keep the vocab sharding, D is gathered
# (FSDP all-gathers weights before use). Gathering from a D-sharded table made XLA replicate the
# gather's result and cotangent ("involuntary full rematerialization") on an fsdp × tensor mesh.
TABLE_AXES = ("vocab", None)
_ACTIVATION_RULES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
  "jaxgrpo_activation_rules", default=None
)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
  """``var`` set to ``value`` inside the block, restored after (the body of every trace-time switch here)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


@contextlib.contextmanager
def activation_rules(rules: Mapping[str, Any] | None) -> Iterator[None]:
  """Inside the block, :func:`shard_activation` uses ``rules`` (None: ``DEFAULT_RULES``).

  ``CausalLM.__call__`` enters it with its model's ``sharding_rules`` for the duration of its own
  trace, so the layers need no extra argument. The rules reach ``jax.jit``'s cache key through the
  model (a static attribute of its graphdef), never through this context alone.
  """
  with _scoped(_ACTIVATION_RULES, rules):
    yield


_FORWARD_MODE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxgrpo_forward_mode", default=False)
_CPU_BF16_DOTS: contextvars.ContextVar[str] = contextvars.ContextVar("jaxgrpo_cpu_bf16_dots", default="auto")
CPU_BF16_DOTS = ("auto", "native", "float32")
_CPU_KV_CACHE: contextvars.ContextVar[str] = contextvars.ContextVar("jaxgrpo_cpu_kv_cache", default="float32")
CPU_KV_CACHE = ("float32", "compute")
_LAYER_INDEX: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("jaxgrpo_layer_index", default=None)


@contextlib.contextmanager
def layer_index(i: jax.Array) -> Iterator[None]:
  """Inside the block, the layer being traced is ``i`` (an int32 scalar, traced in a scanned stack):
  a stacked ``LoRA`` (``layer_stride > 0``) draws its dropout stream from it. Entered by the scanned
  layer stack of ``CausalLM`` (``scan_layers=True``) around each layer's trace."""
  with _scoped(_LAYER_INDEX, i):
    yield


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
  with _scoped(_FORWARD_MODE, bool(enabled)):
    yield


@contextlib.contextmanager
def cpu_bf16_dots(mode: str) -> Iterator[None]:
  """How the bfloat16 products of :func:`dense` run on XLA:CPU while models are traced inside the block:

  - ``"native"``: bf16 operands, float32 accumulation (:func:`_mixed_einsum`, forward and backward);
  - ``"float32"``: the operands cast to float32 first, the product in float32, the result rounded back to the
    activation dtype (the same exact products and float32 accumulation, another summation order);
  - ``"auto"`` (the default): ``"native"`` where the process may use Intel AMX (:func:`amx_granted`), else
    ``"float32"``. Measured on the 20m GRPO iteration (``scripts/bench_precision.py``, BENCHMARKS.md "Mixed
    precision without AMX"): native bf16 is 1.50x faster than float32 with AMX and 1.47x slower without it
    (the same Intel Xeon refused AMX by ``scripts/no_amx.py``: avx512_bf16 only).

  Accelerators are not affected (their bf16 matmul is native). Read at trace time, like
  :func:`forward_mode_autodiff`."""
  if mode not in CPU_BF16_DOTS:
    raise ValueError(f"cpu_bf16_dots: mode must be one of {CPU_BF16_DOTS}; got {mode!r}")
  with _scoped(_CPU_BF16_DOTS, mode):
    yield


@contextlib.contextmanager
def cpu_kv_cache(mode: str) -> Iterator[None]:
  """The dtype of a bf16 model's KV cache on XLA:CPU for the programs traced inside the block
  (:func:`kv_cache_dtype`): ``"float32"`` (the default: the same bf16-rounded values in float32, the faster decode)
  or ``"compute"`` (bf16: half the cache's bytes, where memory matters more than decode speed; the 20m rollout ran
  1.7x slower that way with AMX, 1.3x without). Other dtypes and backends are not affected. Read at trace time."""
  if mode not in CPU_KV_CACHE:
    raise ValueError(f"cpu_kv_cache: mode must be one of {CPU_KV_CACHE}; got {mode!r}")
  with _scoped(_CPU_KV_CACHE, mode):
    yield


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # Linux x86-64 (asm/prctl.h)


def amx_request() -> int:
  """Linux's AMX permission request in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which
  XLA:CPU's kernels make themselves before using AMX): 0 when granted, else its errno (EPERM in a process refused it
  by ``scripts/no_amx.py``; EINVAL or another value on a CPU or kernel without AMX); ENOSYS off Linux x86-64."""
  if sys.platform != "linux" or platform.machine() != "x86_64":
    return errno.ENOSYS
  libc = ctypes.CDLL(None, use_errno=True)
  return 0 if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0 else ctypes.get_errno()


@functools.cache
def amx_granted() -> bool:
  """Whether this process may use Intel AMX (:func:`amx_request` succeeds); asked once per process."""
  return amx_request() == 0


def _native_bf16_dots() -> bool:
  mode = _CPU_BF16_DOTS.get()
  return amx_granted() if mode == "auto" else mode == "native"


def kv_cache_dtype(dtype):
  """The KV cache's dtype for a model computing in ``dtype``: ``dtype`` itself, except bfloat16 for a CPU target
  (:func:`jaxgrpo.parallel.target.current_platform`: the program's devices, not the host's backend), where
  the cache holds the same bf16-rounded keys and values in float32 (the same numbers, twice the bytes). The
  decoding attention reads the cache in float32 either way (a multiply-and-reduce accumulated in float32); from a
  bf16 cache XLA:CPU writes a whole float32 copy of every layer's cache at every decode step (its loop fusion
  takes the conversion with the cache update; the reduction then runs in YNNPACK, which reads float32). Measured
  on the 20m rollout (BENCHMARKS.md, "Mixed precision on the CPU"): 1.7x faster with AMX, 1.3x without it.
  Accelerators keep the compute dtype; :func:`cpu_kv_cache` ``("compute")`` keeps it on the CPU too (half the bytes).
  Read at trace time."""
  if jnp.dtype(dtype) == jnp.bfloat16 and current_platform() == "cpu" and _CPU_KV_CACHE.get() == "float32":
    return jnp.float32
  return dtype


def forward_mode_active() -> bool:
  """Whether :func:`forward_mode_autodiff` is in effect (at trace time)."""
  return _FORWARD_MODE.get()


def shard_activation(x: jax.Array, axes: tuple[str | None, ...], name: str) -> jax.Array:
  """``jaxgrpo.parallel.sharding.constrain(x, axes, rules, name)`` with the rules of the model being traced
  (:func:`activation_rules`): a no-op without a context mesh. ``x [*dims]`` with one logical name
  (or None) per dim in ``axes``; returns ``x`` (same shape and dtype), constrained."""
  return constrain(x, axes, _ACTIVATION_RULES.get(), name)


def _f32_operands_on_cpu(*xs, preferred_element_type=None):
  """XLA:CPU has no bf16 × bf16 → f32 kernel for the dot layouts its YNNPACK fusion declines
  ("Unsupported element type for DotThunk", see :func:`_mixed_on_cpu`): for the dots ``dense`` does
  not route to :func:`_mixed_einsum` (attention, the MoE dispatch, mixed operand dtypes), operands
  asked to accumulate in float32 are upcast first. Exact (a product of two bf16 numbers is exact in
  float32) and for a CPU target only (:func:`jaxgrpo.parallel.target.current_platform`); accelerators keep the
  low-precision matmul."""
  if preferred_element_type == jnp.float32 and current_platform() == "cpu" and any(x.dtype != jnp.float32 for x in xs):
    return tuple(x.astype(jnp.float32) for x in xs)
  return xs


def _mixed_on_cpu(*xs) -> bool:
  """Whether the 2-D dot of ``dense`` runs as :func:`_mixed_einsum` (bf16 operands, float32
  accumulation): on XLA:CPU, every operand bfloat16, outside :func:`forward_mode_autodiff` (a
  ``custom_vjp`` has no forward mode) and outside ``jax.shard_map`` regions where an operand varies
  over a mesh axis (the hand-written backward does not sum weight gradients over them).

  Chosen by the target platform (:func:`jaxgrpo.parallel.target.current_platform`), dtype and layout; whether the products then take bf16 or float32 operands by
  :func:`cpu_bf16_dots` (AMX or not). XLA:CPU (jax 0.10.2) hands a bf16 × bf16 →
  f32 dot to its YNNPACK fusion, which picks the CPU's bf16 kernel at run time; a dot YNNPACK declines
  falls to XLA's own DotThunk, which has no bf16 × bf16 → f32 kernel ("Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32", raised when the program runs). The 2-D products of ``dense``
  and their backward products run (``tests/test_mixed_precision.py``); the batched attention einsums
  over a KV cache laid out ``[B, N, K, T]`` do not, so attention and the MoE dispatch keep
  :func:`_f32_operands_on_cpu` (docs/models.md, "Mixed precision on the CPU")."""
  if current_platform() != "cpu" or _FORWARD_MODE.get():
    return False
  if not all(x.dtype == jnp.bfloat16 for x in xs):
    return False
  return not any(_varying(x) for x in xs)


def _varying(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside)."""
  t = jax.typeof(x)
  manual = getattr(t, "manual_axis_type", None)
  return frozenset(manual.varying) if manual is not None else frozenset(getattr(t, "vma", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """``einsum(spec, a, b)`` of bf16 operands accumulated in float32 (returns float32), with a backward
  whose products also take bf16 operands: the cotangent is rounded to bf16 first, as the cotangent of
  a bf16 activation is in any bf16 training (JAX's own transpose would multiply the float32 cotangent
  by the bf16 operand, a mixed-dtype dot XLA:CPU runs slower than float32). ``spec`` ``"A,B->C"``
  with every index of A and of B in one of the other two terms (a plain contraction)."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _mixed_einsum_fwd(spec, a, b):
  return _mixed_einsum(spec, a, b), (a, b)


def _mixed_einsum_bwd(spec, res, g):
  a, b = res
  ins, out = spec.split("->")
  sa, sb = ins.split(",")
  g = g.astype(a.dtype)
  da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32)
  db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32)
  return da.astype(a.dtype), db.astype(b.dtype)


_mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)


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
  if preferred_element_type in (None, jnp.float32) and _mixed_on_cpu(x2, w):
    # bf16 on XLA:CPU: accumulated in float32 (and rounded back to bf16 unless float32 was asked); the products
    # with bf16 operands where they are fast (cpu_bf16_dots), else in float32
    w2 = w.reshape(math.prod(out), math.prod(c)) if transpose_w else w.reshape(math.prod(c), math.prod(out))
    spec = "tc,oc->to" if transpose_w else "tc,co->to"
    if _native_bf16_dots():
      y = _mixed_einsum(spec, x2, w2)
    else:
      y = jnp.einsum(spec, x2.astype(jnp.float32), w2.astype(jnp.float32))
    return y.astype(preferred_element_type or x.dtype).reshape(*lead, *out)
  x2, w = _f32_operands_on_cpu(x2, w, preferred_element_type=preferred_element_type)
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
  name; int8 scales have None on the contracted dims). Static: ``kind``, ``contract``,
  ``group_size``, ``shape`` (the logical weight shape), ``axes`` (its logical axes).
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
  ):
    codes_shape, scales_shape = quant.quantized_shapes(shape, kind=kind, contract=contract, group_size=group_size)
    if tuple(codes.shape) != codes_shape or tuple(scales.shape) != scales_shape:
      raise ValueError(
        f"{kind} weight {shape}: codes {codes.shape} / scales {scales.shape}, expected {codes_shape} / {scales_shape}"
      )
    scale_axes = (None,) * contract + tuple(axes[contract:]) if kind == "int8" else tuple(axes)
    self.codes = QuantParam(codes, out_sharding=tuple(axes), eager_sharding=False)
    self.scales = QuantParam(scales, out_sharding=scale_axes, eager_sharding=False)
    self.kind, self.contract, self.group_size = kind, contract, group_size
    self.shape, self.axes = tuple(shape), tuple(axes)

  def dequantize(self, dtype) -> jax.Array:
    """``ŵ [*C, *O]`` in ``dtype``."""
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
  mask for the whole input) or a key per batch row (``key[B]``: row b's mask comes from
  ``fold_in(key[b], stream)`` alone, so it does not depend on how rows are split into micro-batches
  or over devices).
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
      else:  # one key per row of x [B, ...]
        row = lambda k: jax.random.bernoulli(jax.random.fold_in(k, stream), p_keep, x.shape[1:])
        keep = jax.vmap(row)(dropout_key)
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


class KVCache(NamedTuple):
  """Static-shape decoding cache (a pytree).

  k: tuple over layers of [B, N, K, T] keys, v: tuple over layers of [B, N, T, K] values (compute
  dtype), T = max_len slots; for a scanned layer stack (``scan_layers=True``) one stacked array
  each, k [L, B, N, K, T] and v [L, B, N, T, K]. Keys are stored transposed because that is the operand layout XLA's
  dot wants for ``q·kᵀ`` (and values for ``p·v``): with [B, T, N, K] it copied (transposed) the
  whole cache of every layer at every decode step, ~20% of the sampler's time on CPU.
  valid: bool[B, T], True on slots holding a real (non-padding) token.
  index: int32 scalar, the next slot to write (same for every row; left-padding keeps rows aligned), or
    ``int32[B]``, each row's own next slot (a *per-row* cache, ``init_kv_cache(..., per_row=True)``): the S
    new tokens of row b go to slots ``[index[b], index[b] + S)`` (writes past ``max_len`` are dropped) and
    ``index[b]`` advances by the row's number of real tokens, so a call's ``attention_mask`` must be
    right-padded (real tokens first) and each row's real tokens fill its slots without holes. That lets
    rows of different lengths append tokens to one cache of a fixed size (the multi-turn sampler keeps one
    across turns: ``jaxgrpo.rollout.conversation.ConversationSampler``).
  """

  k: tuple[jax.Array, ...] | jax.Array
  v: tuple[jax.Array, ...] | jax.Array
  valid: jax.Array
  index: jax.Array

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]


def init_kv_cache(
  num_layers: int,
  batch_size: int,
  max_len: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  stacked: bool = False,
  per_row: bool = False,
) -> KVCache:
  """Empty cache: zeros, no valid slot, index 0; ``stacked``: one [L, ...] array for k and for v;
  ``per_row``: ``index`` is ``int32[batch_size]`` (each row appends at its own slot, see ``KVCache``)."""
  for name, value in (("batch_size", batch_size), ("max_len", max_len)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  k_shape = (batch_size, num_kv_heads, head_dim, max_len)
  v_shape = (batch_size, num_kv_heads, max_len, head_dim)
  index = jnp.zeros((batch_size,) if per_row else (), jnp.int32)
  if stacked:
    return KVCache(
      k=jnp.zeros((num_layers,) + k_shape, dtype),
      v=jnp.zeros((num_layers,) + v_shape, dtype),
      valid=jnp.zeros((batch_size, max_len), bool),
      index=index,
    )
  return KVCache(
    k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
    v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)),
    valid=jnp.zeros((batch_size, max_len), bool),
    index=index,
  )


def _map_rows(fn, cache: KVCache, *others: KVCache) -> KVCache:
  """``fn(x, *others' x, axis)`` on every array of the cache(s), ``axis`` its batch axis (1 for a stacked
  [L, B, ...] k/v, else 0)."""
  kv_axis = 0 if isinstance(cache.k, tuple) else 1
  if kv_axis == 0:
    k = tuple(fn(*xs, 0) for xs in zip(cache.k, *(o.k for o in others)))
    v = tuple(fn(*xs, 0) for xs in zip(cache.v, *(o.v for o in others)))
  else:
    k, v = fn(cache.k, *(o.k for o in others), 1), fn(cache.v, *(o.v for o in others), 1)
  valid = fn(cache.valid, *(o.valid for o in others), 0)
  index = fn(cache.index, *(o.index for o in others), 0) if cache.index.ndim else cache.index
  return KVCache(k=k, v=v, valid=valid, index=index)


def take_cache_rows(cache: KVCache, rows: jax.Array) -> KVCache:
  """The cache of rows ``rows int32[R]`` (``x[rows]`` on the batch axis); an index out of ``[0, B)`` gives an
  empty row (zeros, no valid slot, index 0): a padding row. With :func:`put_cache_rows`, a decode over the R
  rows of a larger cache that are still running."""
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis, mode="fill", fill_value=0), cache)


def put_cache_rows(cache: KVCache, rows: jax.Array, sub: KVCache) -> KVCache:
  """``cache`` with its rows ``rows int32[R]`` replaced by ``sub``'s R rows (indices out of ``[0, B)``, the
  padding rows of :func:`take_cache_rows`, are dropped; ``rows`` must not repeat an index in range)."""

  def put(x, y, axis):
    at = x.at[rows] if axis == 0 else x.at[:, rows]
    return at.set(y, mode="drop")

  return _map_rows(put, cache, sub)


def repeat_cache(cache: KVCache, n: int) -> KVCache:
  """Repeat every batch row ``n`` times consecutively (``jnp.repeat(x, n, axis=0)``): [B,...] → [B·n,...].

  Used to share one prompt prefill across G samples of a group.
  """
  if not isinstance(n, int) or n <= 0:
    raise ValueError(f"n must be a positive int, got {n!r}")
  rep = lambda x: jnp.repeat(x, n, axis=0)
  index = rep(cache.index) if cache.index.ndim else cache.index  # a per-row index is repeated with its rows
  if not isinstance(cache.k, tuple):  # stacked [L, B, ...]
    rep_l = lambda x: jnp.repeat(x, n, axis=1)
    return KVCache(k=rep_l(cache.k), v=rep_l(cache.v), valid=rep(cache.valid), index=index)
  return KVCache(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)), valid=rep(cache.valid), index=index)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, HF "rotate_half" layout: pairs are (x[..., i], x[..., i + K/2]).

  x: [B, S, H, K]; positions: int32 [B, S]; inv_freq: f32 [K/2].
  ``y = x·cos(θ) + rotate_half(x)·sin(θ)``, θ = position · inv_freq, computed in float32.
  """
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, K/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@jax.custom_vjp
def _attention_softmax(scores: jax.Array) -> jax.Array:
  """``jax.nn.softmax(scores, axis=-1)`` (the same forward pass), whose backward pass keeps only the
  probabilities ``p``: ``∂L/∂scores = p · (g − Σ_k p_k g_k)`` for the cotangent ``g`` (autodiff of
  ``jax.nn.softmax`` keeps more of the ``[B, N, G, S, T]`` intermediates: the compiled train step holds
  ~16% less temporary memory and reads/writes ~5% fewer bytes with this rule)."""
  return jax.nn.softmax(scores, axis=-1)


def _attention_softmax_fwd(scores):
  p = jax.nn.softmax(scores, axis=-1)
  return p, p


def _attention_softmax_bwd(p, g):
  return (p * (g - jnp.sum(p * g, axis=-1, keepdims=True)),)


_attention_softmax.defvjp(_attention_softmax_fwd, _attention_softmax_bwd)


class Attention(nnx.Module):
  """Multi-head / grouped-query self-attention, shared by every family.

  Weights: q [D,H,K] ("embed","heads","head_dim"); k, v [D,N,K] ("embed","kv_heads","head_dim");
  o [H,K,D] ("heads","head_dim","embed"); optional biases [H,K] / [N,K] / [D]; optional per-head
  RMSNorm on q and k over K (Qwen3); optional RoPE (``inv_freq`` given).

  ``softmax(q·kᵀ/√K + mask)`` with scores and softmax in float32; masked entries get -1e30.
  With a context mesh, q and the attention output are constrained to ``QUERY_AXES``, k and v to
  ``KV_AXES`` (:func:`shard_activation`). Adapters: ``q_lora``, ``k_lora``, ``v_lora``, ``o_lora``
  (``LoRA`` or None).
  """

  PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2}  # name -> contracted dims

  def __init__(
    self,
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm_eps: float | None,
    inv_freq,
    dtype,
    param_dtype,
    rngs: nnx.Rngs,
  ):
    D, H, N, K = hidden_size, num_heads, num_kv_heads, head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = H, N, K
    self.dtype = dtype
    self.q = param(rngs.params(), (D, H, K), ("embed", "heads", "head_dim"), param_dtype)
    self.k = param(rngs.params(), (D, N, K), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.v = param(rngs.params(), (D, N, K), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.o = param(rngs.params(), (H, K, D), ("heads", "head_dim", "embed"), param_dtype)
    if qkv_bias:
      self.q_bias = param(None, (H, K), ("heads", "head_dim"), param_dtype, init="zeros")
      self.k_bias = param(None, (N, K), ("kv_heads", "head_dim"), param_dtype, init="zeros")
      self.v_bias = param(None, (N, K), ("kv_heads", "head_dim"), param_dtype, init="zeros")
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    self.o_bias = param(None, (D,), ("embed",), param_dtype, init="zeros") if o_bias else None
    if qk_norm_eps is not None:
      self.q_norm = RMSNorm(K, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = RMSNorm(K, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
    else:
      self.q_norm = self.k_norm = None
    self.inv_freq = None if inv_freq is None else tuple(float(f) for f in inv_freq)
    self.q_lora = self.k_lora = self.v_lora = self.o_lora = nnx.data(None)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None,
    cache_valid: jax.Array | None,
    cache_index: jax.Array | None,
    dropout_key: jax.Array | None = None,
  ):
    """x: [B,S,D]; positions int32 [B,S]; segment_ids int32 [B,S] (0 = padding, k >= 1 = segment k;
    a plain padded row is its mask as 0/1); dropout_key: adapter dropout (``LoRA``).

    Without cache (``cache_kv`` None): causal attention within each segment, query i attends key j
    iff ``segment_ids[i] == segment_ids[j] > 0`` and j <= i. ``segment_ids`` is not used with a
    cache (``CausalLM`` rejects packed rows there). With cache: k/v of the new tokens are written at slots
    ``[cache_index, cache_index+S)`` of ``cache_kv`` (keys [B,N,K,T], values [B,N,T,K]) and query i
    attends to the slots j <= cache_index+i with ``cache_valid[:, j]`` (already updated with this step's mask).
    A per-row ``cache_index`` (``int32[B]``, see ``KVCache``): row b's tokens go to its slots
    ``[cache_index[b], cache_index[b]+S)`` (a scatter; slots past the cache are dropped) and attend likewise.
    Returns (y [B,S,D], new (k, v) or None).
    """
    B, S, _ = x.shape
    H, N, K = self.num_heads, self.num_kv_heads, self.head_dim
    kw = dict(dtype=self.dtype, dropout_key=dropout_key)
    q = project(x, self.q, self.q_bias, self.q_lora, **kw)  # [B,S,H,K]
    k = project(x, self.k, self.k_bias, self.k_lora, **kw)  # [B,S,N,K]
    v = project(x, self.v, self.v_bias, self.v_lora, **kw)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.inv_freq is not None:
      inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q = shard_activation(q, QUERY_AXES, "attention queries")
    k, v = shard_activation(k, KV_AXES, "attention keys"), shard_activation(v, KV_AXES, "attention values")
    G = H // N
    # Decoding (a few query rows per kv head): the B·N tiny matmuls are slow as a batched dot on
    # CPU (BENCHMARKS.md, scripts/bench_projections.py); a broadcast multiply-and-reduce over the
    # cache's [B,N,K,T] keys / [B,N,T,K] values is one vectorised loop, accumulated in float32.
    small = cache_kv is not None and S * G <= _SMALL_QUERY_ROWS
    if cache_kv is None:
      keys, values = k, v  # [B,S,N,K]
      q_slot = k_slot = jnp.arange(S)
      seg_k = segment_ids[:, None, :]  # [B,1,S]
      key_ok = (seg_k == segment_ids[:, :, None]) & (seg_k > 0)  # [B,S,S]: same non-padding segment
      new_kv = None
    else:
      ck, cv = cache_kv
      if cache_index.ndim == 0:
        zero = jnp.zeros((), jnp.int32)
        keys = jax.lax.dynamic_update_slice(
          ck, jnp.transpose(k, (0, 2, 3, 1)).astype(ck.dtype), (zero, zero, zero, cache_index)
        )  # [B,N,K,T]
        values = jax.lax.dynamic_update_slice(
          cv, jnp.transpose(v, (0, 2, 1, 3)).astype(cv.dtype), (zero, zero, cache_index, zero)
        )  # [B,N,T,K]
        q_slot = (cache_index + jnp.arange(S))[None]  # [1,S]
      else:  # per-row slots [B,S]: advanced indices on the batch and slot axes put [B,S] first
        q_slot = cache_index[:, None] + jnp.arange(S)[None]
        rows = jnp.arange(B)[:, None]
        keys = ck.at[rows, :, :, q_slot].set(k.astype(ck.dtype), mode="drop")  # [B,N,K,T]
        values = cv.at[rows, :, q_slot, :].set(v.astype(cv.dtype), mode="drop")  # [B,N,T,K]
      new_kv = (keys, values)
      k_slot = jnp.arange(values.shape[2])
      key_ok = cache_valid[:, None, :]  # [B,1,T]
      if not small:  # prefill: once per generate call; [B,T,N,K] as in the uncached path
        keys, values = jnp.transpose(keys, (0, 3, 1, 2)), jnp.transpose(values, (0, 2, 1, 3))
    if cache_kv is None:
      mask = (k_slot[None, :] <= q_slot[:, None])[None] & key_ok  # [B,S,T]
    else:
      mask = (k_slot[None, None, :] <= q_slot[:, :, None]) & key_ok  # [B,S,T]
    q = q.reshape(B, S, N, G, K)
    f32 = lambda x: x.astype(jnp.float32)
    if small:
      qt = f32(jnp.transpose(q, (0, 2, 3, 1, 4)))  # [B,N,G,S,K]
      scores = jnp.sum(qt[..., None] * f32(keys)[:, :, None, None], axis=-2)  # [B,N,G,S,T]
    else:
      scores = jnp.einsum(
        "bsngk,btnk->bngst",
        *_f32_operands_on_cpu(q, keys.astype(self.dtype), preferred_element_type=jnp.float32),
        preferred_element_type=jnp.float32,
      )
    scores = jnp.where(mask[:, None, None], scores * (K**-0.5), _NEG_INF)
    probs = (jax.nn.softmax(scores, axis=-1) if _FORWARD_MODE.get() else _attention_softmax(scores)).astype(self.dtype)
    if small:
      out = jnp.sum(f32(probs)[..., None] * f32(values)[:, :, None, None], axis=-2).astype(self.dtype)
      out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, S, H, K)  # [B,N,G,S,K] -> [B,S,H,K]
    else:
      out = jnp.einsum("bngst,btnk->bsngk", probs, values.astype(self.dtype)).reshape(B, S, H, K)
    out = shard_activation(out, QUERY_AXES, "attention output")
    y = project(out, self.o, self.o_bias, self.o_lora, contract=2, **kw)
    return y, new_kv
