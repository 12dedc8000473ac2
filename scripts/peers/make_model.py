"""Save the benchmark model once as a Hugging Face directory (run in the TRL venv: needs torch).

    .peers/trl/bin/python scripts/peers/make_model.py .peers/model [--small]

A random Qwen3-architecture model (vocab 32000, hidden 384, 4 layers, 8 heads / 4 kv heads,
head_dim 32, intermediate 1536, tied embeddings, fp32: 20.5M parameters), saved with
`save_pretrained`, plus a word-level tokenizer whose token i is the word ``t<i>`` (so a prompt of
random ids is the text "t17 t2093 ..." and tokenizes back to exactly those ids in every framework).
Token 0 is the pad token; token 1 is EOS. Every peer (jaxgrpo's `load_hf`, Tunix's Qwen3
safetensors loader, transformers) loads these same weights.
"""

from __future__ import annotations

import argparse


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--intermediate", type=int, default=1536)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  torch.manual_seed(args.seed)
  cfg = transformers.Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=args.intermediate,
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
  model.save_pretrained(args.out, safe_serialization=True)

  tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0", padding_side="left"
  )
  fast.save_pretrained(args.out)
  print(f"saved {n / 1e6:.2f}M-parameter Qwen3 + word-level tokenizer to {args.out}")


if __name__ == "__main__":
  main()
