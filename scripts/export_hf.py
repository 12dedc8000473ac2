#!/usr/bin/env python
"""Export a training checkpoint's policy as a Hugging Face directory (config.json, model.safetensors,
tokenizer files) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    python scripts/export_hf.py runs/demo runs/demo/hf                  # latest complete checkpoint
    python scripts/export_hf.py runs/demo/checkpoints runs/demo/hf --step 40
    python scripts/export_hf.py runs/demo/checkpoints/40 runs/demo/hf   # a step directory

Only the parameters are read (no optimizer state); the model is rebuilt from the config saved in the
checkpoint (``jaxgrpo.builders.load_policy``). The checkpoint's files are verified against its
manifest first.
"""

from __future__ import annotations

import argparse
import sys

from jaxgrpo.builders import export_hf
from jaxgrpo.checkpoint import CheckpointError


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("checkpoint", help="run directory (OUT), its checkpoints/ directory, or one step directory")
  p.add_argument("out", help="directory to write the Hugging Face model to")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
  args = p.parse_args(argv)
  try:
    out = export_hf(args.checkpoint, args.out, step=args.step)
  except CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
