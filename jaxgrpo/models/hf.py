"""Hugging Face checkpoints: ``load_hf`` / ``save_hf`` / ``load_tokenizer``, and the name maps.

Each family has a table (its registry entry's ``hf_names``, ``jaxgrpo.models.registry``; the built-in ones are
``gpt2_entries``, ``llama_entries``, ``moe_entries``) of ``Entry(path, hf_name, hf_shape, to_ours, to_hf)``: ``path`` is the
parameter's path in the NNX state, ``to_ours`` turns the HF tensor into our layout using only
NumPy *views* (reshape of a contiguous array, transpose, slicing), so that a memory-mapped
safetensors tensor is never copied whole: each device shard is cut out of the view by
``jax.make_array_from_callback``. Several entries may share one HF tensor (GPT-2's fused
``c_attn``); ``to_hf`` gives each entry's HF-layout piece and pieces of one tensor are
concatenated along the last axis in table order. A MoE expert weight ``[E, ...]`` is one
``StackedEntry``: its E per-expert HF tensors (``...mlp.experts.{e}.gate_proj.weight``), each
turned into our layout by ``to_ours`` and stacked on a new leading axis (a device shard reads only
its own experts' slices). For a scanned layer stack (``scan_layers=True``) the per-layer entries of
one parameter become one ``LayerEntry`` (the parameter ``[L, *ours]``, layer l from layer l's
entry; a scanned MoE's experts ``[L, E, *ours]`` from L ``StackedEntry`` s of E tensors each); the HF files
stay per layer.

Safetensors files are memory-mapped with ``numpy.memmap`` after parsing the (documented, JSON)
file header ourselves: ``safetensors.safe_open`` copies each tensor it returns, whereas a memmap
view lets a shard read only its own pages.

One job at ~600 lines: translating between Hugging Face checkpoints and our parameters — the
name tables, the memory-mapped reader and the writer are the two directions of one mapping.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxgrpo import _checks
from jaxgrpo.models.attention import check_implementation
from jaxgrpo.models.base import RematPolicy, check_scan_layers
from jaxgrpo.models.build import build_model
from jaxgrpo.models.config import GPT2Config, LlamaConfig, ModelConfig, config_from_hf
from jaxgrpo.models.registry import family_of
from jaxgrpo.parallel.sharding import (  # the one rules table lives in jaxgrpo.parallel.sharding
  DEFAULT_RULES,
  logical_to_spec,
)

__all__ = [
  "DEFAULT_RULES",
  "load_hf",
  "save_hf",
  "load_tokenizer",
  "logical_to_spec",
  "hf_entries",
  "stack_layer_entries",
  "gpt2_entries",
  "llama_entries",
  "moe_entries",
]

logger = logging.getLogger(__name__)

# Non-parameter buffers some checkpoints carry; never reported as unused.
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class Entry(NamedTuple):
  path: tuple
  hf_name: str
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


class StackedEntry(NamedTuple):
  """One parameter ``[E, *ours]`` from E HF tensors ``hf_names[e]`` of shape ``hf_shape`` each:
  ``ours[e] = to_ours(tensor_e)``, ``tensor_e = to_hf(ours[e])``. ``hf_name``: the names' pattern
  (``{}`` for the expert index), for messages."""

  path: tuple
  hf_name: str
  hf_names: tuple[str, ...]
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


class LayerEntry(NamedTuple):
  """One stacked parameter ``[L, *ours]`` of a scanned layer stack: ``layers[l]`` is layer l's
  ``Entry`` (its ``path`` ``("layers", l, *rest)``), or its ``StackedEntry`` (MoE experts: the parameter is
  ``[L, E, *ours]``); ``path`` is ``("layers", *rest)``."""

  path: tuple
  layers: tuple[Entry | StackedEntry, ...]

  @property
  def hf_name(self) -> str:
    return self.layers[0].hf_name


def stack_layer_entries(entries: list, num_layers: int) -> list:
  """The name map of a scanned stack (``scan_layers=True``): the entries ``("layers", l, *rest)``
  of ``l = 0..L-1`` merged into one ``LayerEntry`` per ``rest`` (in the order of first appearance,
  so the pieces of a fused HF tensor keep their order); other entries unchanged. A layer's ``StackedEntry``
  (MoE experts ``[E, *ours]``) becomes one layer of a ``LayerEntry`` (the parameter ``[L, E, *ours]``).
  """
  out, groups = [], {}
  for e in entries:
    if e.path[0] != "layers":
      out.append(e)
      continue
    rest = e.path[2:]
    if rest not in groups:
      groups[rest] = [None] * num_layers
      out.append(("layers",) + rest)  # a placeholder, filled below
    groups[rest][e.path[1]] = e
  return [LayerEntry(x, tuple(groups[x[1:]])) if type(x) is tuple else x for x in out]


def _same():
  return lambda a: a, lambda a: a


def _transpose():
  return lambda a: a.T, lambda a: a.T


def _in_proj(n, k):
  """HF Linear [n·k, D] → ours [D, n, k]."""
  return (
    lambda a: a.reshape(n, k, a.shape[-1]).transpose(2, 0, 1),
    lambda a: a.transpose(1, 2, 0).reshape(n * k, a.shape[0]),
  )


def _out_proj(h, k):
  """HF Linear [D, h·k] → ours [h, k, D]."""
  return (
    lambda a: a.reshape(a.shape[0], h, k).transpose(1, 2, 0),
    lambda a: a.transpose(2, 0, 1).reshape(a.shape[2], h * k),
  )


def _bias_heads(n, k):
  return lambda a: a.reshape(n, k), lambda a: a.reshape(n * k)


def gpt2_entries(cfg: GPT2Config) -> list[Entry]:
  """GPT-2's name map (``transformer.*``; the fused ``c_attn`` split into q, k, v)."""
  D, H, K, F, V, P = (
    cfg.hidden_size,
    cfg.num_heads,
    cfg.head_dim,
    cfg.intermediate_size,
    cfg.vocab_size,
    cfg.max_position_embeddings,
  )
  out = [
    Entry(("embed_tokens",), "transformer.wte.weight", (V, D), *_same()),
    Entry(("wpe",), "transformer.wpe.weight", (P, D), *_same()),
    Entry(("final_norm", "scale"), "transformer.ln_f.weight", (D,), *_same()),
    Entry(("final_norm", "bias"), "transformer.ln_f.bias", (D,), *_same()),
  ]
  for i in range(cfg.num_layers):
    p = f"transformer.h.{i}."
    L = ("layers", i)
    for j, name in enumerate(("q", "k", "v")):
      # Conv1D weight is [in, out] = [D, 3D]; columns j·D..(j+1)·D belong to q/k/v.
      out.append(
        Entry(
          L + ("attn", name),
          p + "attn.c_attn.weight",
          (D, 3 * D),
          lambda a, j=j: a.reshape(D, 3, H, K)[:, j],
          lambda a: a.reshape(D, H * K),
        )
      )
      out.append(
        Entry(
          L + ("attn", name + "_bias"),
          p + "attn.c_attn.bias",
          (3 * D,),
          lambda a, j=j: a.reshape(3, H, K)[j],
          lambda a: a.reshape(H * K),
        )
      )
    out += [
      Entry(
        L + ("attn", "o"), p + "attn.c_proj.weight", (D, D), lambda a: a.reshape(H, K, D), lambda a: a.reshape(H * K, D)
      ),
      Entry(L + ("attn", "o_bias"), p + "attn.c_proj.bias", (D,), *_same()),
      Entry(L + ("ln_1", "scale"), p + "ln_1.weight", (D,), *_same()),
      Entry(L + ("ln_1", "bias"), p + "ln_1.bias", (D,), *_same()),
      Entry(L + ("ln_2", "scale"), p + "ln_2.weight", (D,), *_same()),
      Entry(L + ("ln_2", "bias"), p + "ln_2.bias", (D,), *_same()),
      Entry(L + ("mlp", "fc"), p + "mlp.c_fc.weight", (D, F), *_same()),
      Entry(L + ("mlp", "fc_bias"), p + "mlp.c_fc.bias", (F,), *_same()),
      Entry(L + ("mlp", "proj"), p + "mlp.c_proj.weight", (F, D), *_same()),
      Entry(L + ("mlp", "proj_bias"), p + "mlp.c_proj.bias", (D,), *_same()),
    ]
  if not cfg.tie_word_embeddings:
    out.append(Entry(("lm_head",), "lm_head.weight", (V, D), *_transpose()))
  return out


def llama_entries(cfg: LlamaConfig) -> list[Entry]:
  """The Llama / Qwen2 / Qwen3 name map (``model.*``; biases, q/k norms and the head as the flags say)."""
  D, H, N, K, F, V = (
    cfg.hidden_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.intermediate_size,
    cfg.vocab_size,
  )
  out = [
    Entry(("embed_tokens",), "model.embed_tokens.weight", (V, D), *_same()),
    Entry(("final_norm", "scale"), "model.norm.weight", (D,), *_same()),
  ]
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    L = ("layers", i)
    out += [
      Entry(L + ("input_norm", "scale"), p + "input_layernorm.weight", (D,), *_same()),
      Entry(L + ("post_attention_norm", "scale"), p + "post_attention_layernorm.weight", (D,), *_same()),
      Entry(L + ("attn", "q"), p + "self_attn.q_proj.weight", (H * K, D), *_in_proj(H, K)),
      Entry(L + ("attn", "k"), p + "self_attn.k_proj.weight", (N * K, D), *_in_proj(N, K)),
      Entry(L + ("attn", "v"), p + "self_attn.v_proj.weight", (N * K, D), *_in_proj(N, K)),
      Entry(L + ("attn", "o"), p + "self_attn.o_proj.weight", (D, H * K), *_out_proj(H, K)),
      Entry(L + ("mlp", "gate"), p + "mlp.gate_proj.weight", (F, D), *_transpose()),
      Entry(L + ("mlp", "up"), p + "mlp.up_proj.weight", (F, D), *_transpose()),
      Entry(L + ("mlp", "down"), p + "mlp.down_proj.weight", (D, F), *_transpose()),
    ]
    if cfg.qkv_bias:
      out += [
        Entry(L + ("attn", "q_bias"), p + "self_attn.q_proj.bias", (H * K,), *_bias_heads(H, K)),
        Entry(L + ("attn", "k_bias"), p + "self_attn.k_proj.bias", (N * K,), *_bias_heads(N, K)),
        Entry(L + ("attn", "v_bias"), p + "self_attn.v_proj.bias", (N * K,), *_bias_heads(N, K)),
      ]
    if cfg.o_bias:
      out.append(Entry(L + ("attn", "o_bias"), p + "self_attn.o_proj.bias", (D,), *_same()))
    if cfg.mlp_bias:
      out += [
        Entry(L + ("mlp", "gate_bias"), p + "mlp.gate_proj.bias", (F,), *_same()),
        Entry(L + ("mlp", "up_bias"), p + "mlp.up_proj.bias", (F,), *_same()),
        Entry(L + ("mlp", "down_bias"), p + "mlp.down_proj.bias", (D,), *_same()),
      ]
    if cfg.qk_norm:
      out += [
        Entry(L + ("attn", "q_norm", "scale"), p + "self_attn.q_norm.weight", (K,), *_same()),
        Entry(L + ("attn", "k_norm", "scale"), p + "self_attn.k_norm.weight", (K,), *_same()),
      ]
  if not cfg.tie_word_embeddings:
    out.append(Entry(("lm_head",), "lm_head.weight", (V, D), *_transpose()))
  return out


def moe_entries(cfg) -> list:
  """Qwen3-MoE / Qwen2-MoE: the Llama-family map, with each sparse layer's dense MLP replaced by the
  router (``mlp.gate.weight [E, D]``), the stacked experts (``mlp.experts.{e}.{gate,up,down}_proj``)
  and, for Qwen2-MoE, the shared expert and its gate (``mlp.shared_expert*``)."""
  D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  sparse = set(cfg.moe_layers)
  out = [e for e in llama_entries(cfg) if not (e.path[0] == "layers" and e.path[1] in sparse and e.path[2] == "mlp")]
  for i in sorted(sparse):
    p = f"model.layers.{i}.mlp."
    L = ("layers", i, "mlp")
    out.append(Entry(L + ("router",), p + "gate.weight", (E, D), *_transpose()))
    for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
      pattern = p + "experts.{}." + name + "_proj.weight"
      names = tuple(pattern.format(e) for e in range(E))
      out.append(StackedEntry(L + (name,), pattern, names, shape, *_transpose()))
    if cfg.shared_expert_intermediate_size:
      S = cfg.shared_expert_intermediate_size
      out += [
        Entry(L + ("shared", "gate"), p + "shared_expert.gate_proj.weight", (S, D), *_transpose()),
        Entry(L + ("shared", "up"), p + "shared_expert.up_proj.weight", (S, D), *_transpose()),
        Entry(L + ("shared", "down"), p + "shared_expert.down_proj.weight", (D, S), *_transpose()),
        Entry(L + ("shared_gate",), p + "shared_expert_gate.weight", (1, D), *_transpose()),
      ]
  return out


def hf_entries(cfg: ModelConfig) -> list[Entry]:
  """The name map of ``cfg``'s family (its ``Family.hf_names``, ``jaxgrpo.models.registry``): one ``Entry`` (or
  ``StackedEntry``) per parameter of ``build_model(cfg)``."""
  return family_of(cfg).hf_names(cfg)


# ----------------------------------------------------------------------------------------------
# Safetensors, memory-mapped.

_ST_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def _mmap_safetensors(path: str) -> dict[str, np.ndarray]:
  """name → read-only NumPy view of the memory-mapped file (no tensor data is read here).

  Raises:
    ValueError: naming the file (and the tensor) for a file that is not a complete safetensors
      file: shorter than its header, a header that is not a JSON object, an unsupported dtype, a
      tensor whose byte range does not match its shape or runs past the end of the file (truncated).
  """
  size = os.path.getsize(path)
  bad = lambda what: ValueError(f"{path} is not a valid safetensors file: {what}")
  if size < 8:
    raise bad(f"{size} bytes, shorter than the 8-byte header length (empty or truncated)")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
      raise bad(
        f"the header claims {n} bytes, the file has {size - 8} after the length (truncated, or not safetensors)"
      )
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    raise bad(f"its {n}-byte header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise bad(f"its header is a JSON {type(header).__name__}, not an object")
  base, data_bytes = 8 + n, size - 8 - n
  specs = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"tensor {name!r} in {path}"
    try:
      dtype_name, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
    except (TypeError, KeyError, ValueError) as e:
      raise ValueError(f"{where}: malformed header entry {info!r} ({type(e).__name__}: {e})") from None
    if dtype_name not in _ST_DTYPES:
      raise ValueError(f"{where} has unsupported dtype {dtype_name}")
    dtype = np.dtype(_ST_DTYPES[dtype_name])
    want = math.prod(shape) * dtype.itemsize
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
      raise ValueError(f"{where}: invalid data_offsets {[start, end]}")
    if end > data_bytes:
      raise ValueError(
        f"{where}: its bytes [{start}, {end}) run past the end of the data ({data_bytes} bytes): the file is truncated"
      )
    if end - start != want:
      raise ValueError(f"{where}: {end - start} bytes for shape {tuple(shape)} of {dtype_name} ({want} expected)")
    specs[name] = (start, end, dtype, shape)
  data = np.memmap(path, dtype=np.uint8, mode="r")
  return {name: data[base + s : base + e].view(dt).reshape(sh) for name, (s, e, dt, sh) in specs.items()}


def read_checkpoint(directory: str) -> dict[str, np.ndarray]:
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e!r}") from None
    missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
    if missing:
      raise ValueError(f"{index} lists shards that are not in {directory}: {missing}")
  elif os.path.exists(os.path.join(directory, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise ValueError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
  tensors = {}
  for name in files:
    tensors.update(_mmap_safetensors(os.path.join(directory, name)))
  return tensors


def resolve_path(path: str | os.PathLike) -> str:
  path = os.fspath(path)
  if os.path.isdir(path):
    return path
  if os.path.exists(path):
    raise ValueError(f"path {path!r} must be a model directory, not a file")
  if _checks.names_local_path(path):  # `runs/rm` with a local `runs`, `./x`, `/x`: never a hub id
    raise ValueError(
      f"{path!r} is not a local directory: no such path (a path, not a hub id owner/name: not looked up; a path "
      "that starts with /, ./, ../ or ~, has several '/', or whose first part is a local directory is local)"
    )
  try:
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
  except Exception as e:  # noqa: BLE001 - re-raised with the reason
    reason = " ".join(str(e).split())  # one line
    raise ValueError(
      f"{path!r} is not a local directory (none under {os.getcwd()}) and could not be fetched from the hub as a "
      f"hub id: {reason}"
    ) from e


def load_hf(
  path: str | os.PathLike,
  *,
  dtype=jnp.float32,
  param_dtype=jnp.float32,
  mesh: Mesh | None = None,
  rules: Mapping[str, str | None] | None = None,
  remat: RematPolicy | str | bool = False,
  scan_layers: bool = False,
  attention: str = "auto",
):
  """Load a HF causal-LM directory (or hub id, when reachable) into a ``jaxgrpo.models`` model.

  Reads ``config.json`` (family from ``model_type``) and ``model.safetensors`` or the shards listed
  in ``model.safetensors.index.json``, memory-mapped. With ``mesh``, each parameter is created
  directly as a global array with ``NamedSharding(mesh, logical_to_spec(axes, mesh, rules))``
  via ``jax.make_array_from_callback``: each device reads only its own shard from the mapped file.
  Without a mesh, parameters go to the default device.

  Args:
    path: local model directory or hub id.
    dtype: compute dtype. param_dtype: storage dtype (tensors are cast shard by shard).
    mesh: optional ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto`` (ValueError otherwise).
    rules: logical axis → mesh axis (default ``DEFAULT_RULES``): the parameters' placement, and the
      model's activation constraints under a context mesh (``model.sharding_rules``).
    remat: the per-layer activation-checkpointing policy: a ``RematPolicy`` or its name (``"none"``,
      ``"full"``, ``"dots"``, ``"dots_no_batch"``; ``True``/``False`` = full/none); see ``build_model``.
    scan_layers: load into the stacked layout (``build_model(scan_layers=True)``): each stacked
      parameter is assembled shard by shard from the per-layer HF tensors (no per-layer copy).
    attention: the attention implementation (``"auto"``, ``"dense"``, ``"blockwise"``, ``"splash"``, ``"cudnn"``);
      see ``build_model``.

  Returns:
    The model (its config on ``model.config``).

  Raises:
    ValueError: unknown model_type, missing tensor, or tensor of the wrong shape (named, with the
      expected and found shapes).
  """
  remat = RematPolicy.parse(remat)  # a bad name fails before the checkpoint is read
  check_scan_layers(scan_layers)
  check_implementation(attention, "attention")
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
    if explicit:
      raise ValueError(
        f"mesh axes {explicit} are not AxisType.Auto; the models rely on the compiler to "
        "propagate shardings: build the mesh with axis_types=(AxisType.Auto,) * ndim "
        "(jax.make_mesh defaults to Explicit)"
      )
  directory = resolve_path(path)
  cfg = config_from_hf(directory)
  rules = DEFAULT_RULES if rules is None else dict(rules)
  abstract = nnx.eval_shape(  # the model refuses what it cannot build (dense MoE layers scanned) before any read
    lambda: build_model(
      cfg,
      rngs=nnx.Rngs(0),
      dtype=dtype,
      param_dtype=param_dtype,
      remat=remat,
      rules=rules,
      scan_layers=scan_layers,
      attention=attention,
    )  # fmt: skip
  )
  tensors = read_checkpoint(directory)
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  entries = hf_entries(cfg)
  if scan_layers:
    entries = stack_layer_entries(entries, cfg.num_layers)
  missing_params = set(flat) - {e.path for e in entries}
  if missing_params:  # a bug in the name map, not in the checkpoint
    raise AssertionError(f"name map does not cover parameters {sorted(missing_params)}")
  default_device = jax.local_devices()[0]  # this process's (with several, jax.devices()[0] is process 0's)
  np_dtype = np.dtype(param_dtype)
  for e in entries:
    if isinstance(e, StackedEntry):
      _load_stacked(e, tensors, flat[e.path], directory, mesh, rules, default_device, np_dtype)
      continue
    if isinstance(e, LayerEntry):
      load_layers(e, tensors, flat[e.path], directory, mesh, rules, default_device, np_dtype)
      continue
    view = tensor_view(e, tensors, directory)
    var = flat[e.path]
    if view.shape != tuple(var.shape):
      raise AssertionError(f"name map gives {view.shape} for {e.path}, model has {var.shape}")
    if mesh is None:
      sharding = jax.sharding.SingleDeviceSharding(default_device)
    else:
      axes = var.get_metadata("out_sharding")
      sharding = NamedSharding(mesh, logical_to_spec(axes, mesh, rules, view.shape, e.hf_name))
    np_dtype = np.dtype(param_dtype)
    array = jax.make_array_from_callback(
      view.shape, sharding, lambda idx, view=view, np_dtype=np_dtype: np.array(view[idx], dtype=np_dtype, order="C")
    )
    var.set_value(array)
  entries = [x for e in entries for x in (e.layers if isinstance(e, LayerEntry) else (e,))]
  used = {e.hf_name for e in entries} | {e.hf_name[len("transformer.") :] for e in entries}
  used |= {n for e in entries if isinstance(e, StackedEntry) for n in e.hf_names}
  if cfg.tie_word_embeddings:
    used.add("lm_head.weight")  # a tied checkpoint may still store the (identical) head; HF ignores it too
  unused = sorted(n for n in tensors if n not in used and not n.endswith(_BUFFER_SUFFIXES))
  if unused:
    logger.warning(
      "load_hf(%s): %d checkpoint tensors are not used by the %s model: %s",
      directory,
      len(unused),
      cfg.model_type,
      unused[:8],
    )
  return nnx.merge(graphdef, state)


def tensor_view(e: Entry, tensors, directory) -> np.ndarray:
  """``e.to_ours`` of its HF tensor (a view), after checking that it is present with its shape."""
  name = e.hf_name
  if name not in tensors and name.startswith("transformer.") and name[len("transformer.") :] in tensors:
    name = name[len("transformer.") :]  # original OpenAI-GPT-2 checkpoints have no prefix
  if name not in tensors:
    raise ValueError(f"tensor {e.hf_name!r} is missing from the checkpoint in {directory}")
  found = tuple(tensors[name].shape)
  if found != tuple(e.hf_shape):
    raise ValueError(f"tensor {e.hf_name!r} has shape {found}, expected {tuple(e.hf_shape)}")
  return e.to_ours(tensors[name])


def load_layers(e: LayerEntry, tensors, var, directory, mesh, rules, default_device, np_dtype) -> None:
  """Set ``var`` (``[L, *ours]``; MoE experts ``[L, E, *ours]``) from the per-layer tensors of ``e``; each shard
  stacks its slices."""
  views = [
    _stacked_views(x, tensors, directory) if isinstance(x, StackedEntry) else tensor_view(x, tensors, directory)
    for x in e.layers
  ]
  _set_stack(e, views, var, mesh, rules, default_device, np_dtype)


def _stacked_views(e: StackedEntry, tensors, directory) -> list[np.ndarray]:
  """The E views ``to_ours(tensor_e)`` of ``e``, after checking each tensor is present with its shape."""
  views = []
  for name in e.hf_names:
    if name not in tensors:
      raise ValueError(f"tensor {name!r} is missing from the checkpoint in {directory}")
    found = tuple(tensors[name].shape)
    if found != tuple(e.hf_shape):
      raise ValueError(f"tensor {name!r} has shape {found}, expected {tuple(e.hf_shape)}")
    views.append(e.to_ours(tensors[name]))
  return views


def _load_stacked(e: StackedEntry, tensors, var, directory, mesh, rules, default_device, np_dtype) -> None:
  """Set ``var`` (``[E, *ours]``) from the E tensors of ``e``; each shard stacks its experts' slices."""
  _set_stack(e, _stacked_views(e, tensors, directory), var, mesh, rules, default_device, np_dtype)


def _nested_shape(views) -> tuple[int, ...]:
  """The shape of ``views`` (an array, or a list of equally nested lists of arrays) stacked."""
  return (len(views),) + _nested_shape(views[0]) if isinstance(views, list) else tuple(views.shape)


def _read(views, idx: tuple, np_dtype) -> np.ndarray:
  """``stack(views)[idx]`` (``idx`` a tuple of slices, one per axis) read from the views alone."""
  if not isinstance(views, list):
    return np.array(views[idx], dtype=np_dtype)
  return np.stack([_read(views[i], idx[1:], np_dtype) for i in range(len(views))[idx[0]]])


def _set_stack(e, views, var, mesh, rules, default_device, np_dtype) -> None:
  """Set ``var`` (``[N, *ours]``, or ``[N, M, *ours]`` for a list of lists) to the arrays ``views`` stacked,
  built shard by shard (each shard reads only its own slices of the memory-mapped tensors)."""
  shape = _nested_shape(views)
  if shape != tuple(var.shape):
    raise AssertionError(f"name map gives {shape} for {e.path}, model has {var.shape}")
  if mesh is None:
    sharding = jax.sharding.SingleDeviceSharding(default_device)
  else:
    sharding = NamedSharding(mesh, logical_to_spec(var.get_metadata("out_sharding"), mesh, rules, shape, e.hf_name))
  var.set_value(jax.make_array_from_callback(shape, sharding, lambda idx: _read(views, tuple(idx), np_dtype)))


def save_hf(model, path: str | os.PathLike) -> None:
  """Write ``model`` as a HF checkpoint: ``config.json`` + ``model.safetensors`` (parameter dtype).

  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it with no missing or
  unexpected weights. Sharded arrays are gathered to the host one at a time (single-process).
  """
  from safetensors.numpy import save_file

  cfg = model.config
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  _, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  entries = hf_entries(cfg)
  if model.scan_layers:  # the HF files stay per layer
    entries = stack_layer_entries(entries, cfg.num_layers)
  extra = sorted(set(flat) - {e.path for e in entries}, key=str)
  if extra:  # LoRA adapters or quantised weights (QLoRA): HF has no tensor for them
    raise ValueError(
      f"save_hf: parameters {extra[:4]} have no Hugging Face name (adapters or quantised weights); "
      "save jaxgrpo.models.lora.merge_lora(model) instead, or the adapters with lora.save_peft"
    )
  pieces: dict[str, list[np.ndarray]] = {}
  for e in entries:
    value = np.asarray(jax.device_get(flat[e.path].get_value()))
    if isinstance(e, StackedEntry):  # one HF tensor per expert
      for name, v in zip(e.hf_names, value):
        pieces[name] = [e.to_hf(v)]
      continue
    if isinstance(e, LayerEntry):  # layer l's tensor(s) from slice [l]; a scanned MoE's experts: one per expert
      for x, v in zip(e.layers, value):
        if isinstance(x, StackedEntry):
          pieces.update({name: [x.to_hf(ve)] for name, ve in zip(x.hf_names, v)})
        else:
          pieces.setdefault(x.hf_name, []).append(x.to_hf(v))
      continue
    pieces.setdefault(e.hf_name, []).append(e.to_hf(value))
  tensors = {}
  for name, parts in pieces.items():
    t = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    tensors[name] = np.ascontiguousarray(t)
  hf_config = cfg.to_hf()
  hf_config["dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)


def load_tokenizer(path: str | os.PathLike):
  """``transformers.AutoTokenizer.from_pretrained`` on the same directory (or hub id)."""
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(resolve_path(path))
