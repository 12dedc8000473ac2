"""Save a benchmark model once as a Hugging Face directory (run in the TRL venv: needs torch).

    .peers/trl/bin/python scripts/peers/make_model.py .peers/model                    # --size 20m
    .peers/trl/bin/python scripts/peers/make_model.py .peers/model-150m --size 150m

A random Qwen3-architecture model with tied embeddings in fp32, of the shape `common.WORKLOADS`
gives the size:

- ``20m``: vocab 32000, hidden 384, 4 layers, 8 heads / 4 kv heads, head_dim 32, intermediate 1536:
  20,549,248 parameters;
- ``150m``: vocab 32000, hidden 1024, 8 layers, 16 heads / 8 kv heads, head_dim 128, intermediate
  3072 (Qwen3-0.6B's layer shape, 8 of its 28 layers): 158,616,576 parameters;

saved with `save_pretrained`, plus a word-level tokenizer whose token i is the word ``t<i>`` (so a prompt of
random ids is the text "t17 t2093 ..." and tokenizes back to exactly those ids in every framework).
Token 0 is the pad token; token 1 is EOS. Every peer (jaxgrpo's `load_hf`, Tunix's Qwen3
safetensors loader, transformers) loads these same weights.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--size", choices=sorted(common.WORKLOADS), default="20m", help="the workload whose model to build")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  shape = common.get_workload(args.size).model
  torch.manual_seed(args.seed)
  cfg = transformers.Qwen3Config(
    vocab_size=shape.vocab,
    hidden_size=shape.hidden,
    num_hidden_layers=shape.layers,
    num_attention_heads=shape.heads,
    num_key_value_heads=shape.kv_heads,
    head_dim=shape.head_dim,
    intermediate_size=shape.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
    torch_dtype="float32",
  )
  model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
  n = sum(p.numel() for p in model.parameters())
  if n != shape.n_params:  # the FLOP and parameter counts of `common` must describe the saved model
    raise RuntimeError(f"built {n} parameters, common.ModelShape.n_params says {shape.n_params}")
  model.save_pretrained(args.out, safe_serialization=True)

  tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab)}, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0", padding_side="left"
  )
  fast.save_pretrained(args.out)
  print(f"saved {n:,}-parameter ({args.size}) Qwen3 + word-level tokenizer to {args.out}")


if __name__ == "__main__":
  main()
