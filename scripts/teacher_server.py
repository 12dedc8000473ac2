#!/usr/bin/env python
"""Serve a distillation teacher over HTTP, so that a run on another machine uses it as
``objective.distill.teacher: http://HOST:PORT`` (docs/distillation.md, "A teacher on another machine").

    python scripts/teacher_server.py --teacher runs/teacher --host 0.0.0.0 --port 8470
    python scripts/teacher_server.py --teacher synthetic:128x4 --seed 1 --port 0   # a free port, printed

``--teacher``: an HF model directory, a run directory or checkpoint of this library, or
``synthetic:<hidden>x<layers>`` (initialised from ``--seed``; a run's in-process synthetic teacher uses
``run.seed + 1``, so ``--seed 1`` serves the teacher a ``run.seed: 0`` run would build). The teacher sits on
every device of this host (``--mesh``, default all on ``fsdp``) and scores with the library's chunked float32
teacher pass (``jaxgrpo.run.teacher_remote``); only the top-k leave it. Once listening it prints one line,
``serving <teacher> on http://HOST:PORT (vocab V, tokenizer sha256:...)``, and serves until SIGINT/SIGTERM.

Exit status: 0 stopped by a signal; 2 bad input (a teacher that does not load, a port in use: one ``error:`` line).
"""

from __future__ import annotations

import argparse
import signal
import sys


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--teacher", required=True, help="HF model dir, run dir/checkpoint, or synthetic:<hidden>x<layers>")
  ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
  ap.add_argument("--port", type=int, default=8470, help="the port (0: a free one, printed)")
  ap.add_argument("--seed", type=int, default=1, help="a synthetic teacher's initialisation seed")
  ap.add_argument("--dtype", default="float32", help="compute dtype of a synthetic or HF teacher")
  ap.add_argument("--param-dtype", default="float32", help="parameter dtype of a synthetic or HF teacher")
  ap.add_argument("--chunk-size", type=int, default=256, help="positions per chunk of the float32 logits")
  ap.add_argument("--mesh", default=None, help="mesh spec of this host's devices, e.g. fsdp=-1 (default)")
  return ap


if __name__ == "__main__":
  _parser().parse_args()  # --help and a bad flag answer here, before jax and the library are imported


from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()

from jaxgrpo.run.teacher_remote import TeacherScorer, make_server  # noqa: E402


def _stop(*_):
  raise KeyboardInterrupt


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    scorer = TeacherScorer(
      args.teacher,
      seed=args.seed,
      dtype=args.dtype,
      param_dtype=args.param_dtype,
      chunk_size=args.chunk_size,
      mesh=args.mesh,
    )
    server = make_server(scorer, args.host, args.port)
  except (ValueError, OSError) as e:
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  host, port = server.server_address[:2]
  signal.signal(signal.SIGTERM, _stop)
  print(
    f"serving {args.teacher} on http://{host}:{port} (vocab {scorer.vocab_size}, tokenizer {scorer.fingerprint})",
    flush=True,
  )
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
