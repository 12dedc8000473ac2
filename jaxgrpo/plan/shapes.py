"""Model shapes by name: the published ``config.json`` values of the Qwen3 family, read through the same
``jaxgrpo.models.config_from_hf`` as a real checkpoint's ``config.json``."""

from __future__ import annotations

import os

from jaxgrpo.models import config_from_hf

__all__ = ["NAMED_SHAPES", "model_config"]

_QWEN3 = dict(
  model_type="qwen3",
  vocab_size=151936,
  head_dim=128,
  max_position_embeddings=40960,
  rope_theta=1000000.0,
  rms_norm_eps=1e-6,
  hidden_act="silu",
  bos_token_id=151643,
  eos_token_id=151645,
)


def _qwen3(hidden, layers, heads, kv, inter, tied, **extra) -> dict:
  return dict(
    _QWEN3,
    hidden_size=hidden,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    intermediate_size=inter,
    tie_word_embeddings=tied,
    **extra,
  )


#: name -> the ``config.json`` fields of the Hugging Face checkpoint ``Qwen/<Name>`` that set the shape
NAMED_SHAPES = {
  "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, True),
  "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 6144, True),
  "qwen3-4b": _qwen3(2560, 36, 32, 8, 9728, True),
  "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, False),
  "qwen3-14b": _qwen3(5120, 40, 40, 8, 17408, False),
  "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600, False),
  "qwen3-30b-a3b": _qwen3(
    2048,
    48,
    32,
    4,
    6144,
    False,
    model_type="qwen3_moe",
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
  ),
}


def model_config(model: str):
  """The ``jaxgrpo.models`` config of ``model``: a name of :data:`NAMED_SHAPES` (case-insensitive; ``Qwen/Qwen3-8B``
  is ``qwen3-8b``), a ``config.json`` path or a model directory holding one. ValueError in one line otherwise."""
  key = model.lower().rpartition("/")[2] if model.lower().startswith("qwen/") else model.lower()
  if key in NAMED_SHAPES:
    return config_from_hf(dict(NAMED_SHAPES[key]))
  if os.path.exists(model):
    try:
      return config_from_hf(model)
    except (OSError, ValueError, KeyError) as e:
      raise ValueError(f"--model {model!r}: cannot read a model config from it: {e}") from None
  raise ValueError(
    f"--model {model!r}: neither a named shape ({', '.join(NAMED_SHAPES)}) nor a config.json path or model directory"
  )
