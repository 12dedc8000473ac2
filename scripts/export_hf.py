#!/usr/bin/env python
"""Export a training checkpoint's policy as a Hugging Face directory (config.json, model.safetensors,
tokenizer files) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    python scripts/export_hf.py runs/demo runs/demo/hf                  # latest complete checkpoint
    python scripts/export_hf.py runs/demo/checkpoints runs/demo/hf --step 40
    python scripts/export_hf.py runs/demo/checkpoints/40 runs/demo/hf   # a step directory

Only the parameters are read (no optimizer state); the model is rebuilt from the config saved in the
checkpoint (``jaxgrpo.run.builders.load_policy``). The checkpoint's files are verified against its
manifest first. A LoRA/QLoRA checkpoint (adapters only) is restored onto its rebuilt base model
(refused if the base weights differ from the ones it was trained on), merged into OUT, and its
adapters are also written as a PEFT adapter directory (``--peft-out``, default ``OUT-peft``) that
``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the transformers base model, named in its
``base_model_name_or_path``: ``model.path``, or for the synthetic model ``OUT-base``, the base written
there. The synthetic base is read from the run's ``checkpoints/base`` (no warm-up re-run) when the run
stored it.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("checkpoint", help="run directory (OUT), its checkpoints/ directory, or one step directory")
  p.add_argument("out", help="directory to write the Hugging Face model to")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
  p.add_argument("--peft-out", default=None, help="LoRA checkpoints: the PEFT adapter directory (default: OUT-peft)")
  return p


if __name__ == "__main__":
  _parser().parse_args()  # --help and a bad flag answer here, before jax and the library are imported


from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: jaxgrpo needs no torch

from jaxgrpo.run.builders import export_hf  # noqa: E402
from jaxgrpo.services.checkpoint import CheckpointError  # noqa: E402


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    written = export_hf(args.checkpoint, args.out, step=args.step, peft_dir=args.peft_out)
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print("wrote " + " and ".join(written))
  return 0


if __name__ == "__main__":
  sys.exit(main())
