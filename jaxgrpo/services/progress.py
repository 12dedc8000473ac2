"""Step bars whose ETA excludes compilation (tqdm): the trainer's ``train`` bar
(``jaxgrpo.services.metrics.MetricsLogger``) and the scripts' bars (``jaxgrpo.tasks.script_io``).

A bar shows the postfix ``compiling`` from its creation until :func:`start_clock` restarts its clock after
the first program was compiled; elapsed time, rate and ETA then cover only the steps run since."""

from __future__ import annotations

from tqdm.auto import tqdm

__all__ = ["start_clock", "step_bar"]


def step_bar(total: int, desc: str, *, disable: bool = False, initial: int = 0, **kwargs) -> tqdm:
  """A tqdm bar of ``total`` steps (``initial`` done already: a resumed run), showing ``compiling`` until
  :func:`start_clock` is called; ``kwargs`` go to ``tqdm``."""
  bar = tqdm(total=total, initial=initial, unit="step", desc=desc, disable=disable, **kwargs)
  bar.set_postfix_str("compiling")
  return bar


def start_clock(bar: tqdm) -> None:
  """Restarts ``bar``'s clock after compilation, keeping its count ``n``: elapsed time, rate and ETA then
  cover only the steps run from now on (``initial`` = ``n``), so a compile before this call — or a first,
  compiling step already counted — is not taken as the time of a step. ETA = (total − n) / rate with
  rate = (n − n₀) / (t − t₀) measured from this call (tqdm's smoothing aside)."""
  if bar.disable:
    return
  n = bar.n
  bar.reset()  # n = 0, start_t = now, the smoothed rate forgotten
  bar.n = bar.last_print_n = bar.initial = n
  bar.set_postfix_str("")
