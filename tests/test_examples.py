"""Every script in examples/ runs end to end at a tiny size: each one's ``main(argv)`` (what ``python
examples/NAME.py ARGS`` calls) in this process, one after the other, its printed lines checked. In-process because
each child paid ~3 CPU-s of imports and JAX start-up and compiled the tiny model's programs again."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT, load_example

RUNS = {
  "gspo.py": (["--steps", "2", "--prompts", "2", "--samples", "4"], "step   2  reward"),
  "custom_iteration.py": (["--steps", "2", "--samples", "4"], "step   2  reward"),
  "process_sets.py": (["--samples", "6"], "mean_process_set_size"),
}


@pytest.mark.slow
def test_examples_run(capsys):
  assert sorted(RUNS) == sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
  for name, (args, want) in RUNS.items():
    source = open(os.path.join(ROOT, "examples", name)).read()
    assert source.rstrip().endswith('if __name__ == "__main__":\n  main()'), name  # the script calls main()
    load_example(name.removesuffix(".py")).main(args)
    out = capsys.readouterr().out
    assert want in out, (name, out)
