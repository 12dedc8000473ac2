"""Where a plan compiles for: a TPU topology by its user-facing name, ``cpu-N`` host devices, this machine's
devices, or a GPU (estimated only), with the chip's datasheet numbers.

A TPU target gives *compile-only* devices (``jax.experimental.topologies.get_topology_desc``; needs libtpu, the
``tpu-aot`` extra: ``bash scripts/setup_tpu_venv.sh`` builds ``.venv-tpu/``): XLA's TPU compiler runs on this
machine and checks the program against the chip's HBM, nothing runs. Names: ``v5p-64`` (v4/v5p count
TensorCores: 2 per chip, so 32 chips, topology ``v5:2x4x4``), ``v5e-16`` / ``v5litepod-16`` and ``v6e-64`` (one
core per chip: 16 and 64 chips, ``v5e:4x4``, ``v6e:8x8``), ``v4-8``, or a raw topology string (``v5e:2x2``,
``v5:2x2x1``).
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.experimental import topologies

__all__ = ["CHIPS", "Chip", "GiB", "Target", "chip_of_kind", "parse_target", "target_devices"]

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip's datasheet numbers: ``hbm_bytes`` of memory per device, ``peak_flops`` dense bf16 FLOP/s,
  ``hbm_bw`` bytes/s, and where they come from."""

  name: str
  hbm_bytes: int
  peak_flops: float
  hbm_bw: float
  source: str


_TPU_DOCS = "cloud.google.com/tpu/docs/{}"
#: datasheet numbers per chip family (per device; a v4/v5p device is one megacore chip)
CHIPS = {
  "v4": Chip("TPU v4", 32 * GiB, 275e12, 1228e9, _TPU_DOCS.format("v4")),
  "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, _TPU_DOCS.format("v5e")),
  "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, _TPU_DOCS.format("v5p")),
  "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, _TPU_DOCS.format("v6e")),
  "h100": Chip("H100 SXM", 80 * 10**9, 989e12, 3.35e12, "nvidia.com H100 datasheet (SXM, dense bf16)"),
  "h200": Chip("H200 SXM", 141 * 10**9, 989e12, 4.8e12, "nvidia.com H200 datasheet (SXM, dense bf16)"),
  "a100": Chip("A100 80GB SXM", 80 * 10**9, 312e12, 2.039e12, "nvidia.com A100 datasheet (80GB SXM, dense bf16)"),
}
# topology-string prefix -> family; family -> (topology prefix, chip config, TensorCores per chip in the name)
_FAMILY_OF_PREFIX = {"v4": "v4", "v5": "v5p", "v5p": "v5p", "v5e": "v5e", "v5litepod": "v5e", "v6e": "v6e"}
_TOPOLOGY = {"v4": ("v4", "megacore", 2), "v5p": ("v5", "megacore", 2), "v5e": ("v5e", "default", 1),
             "v6e": ("v6e", "default", 1)}  # fmt: skip
# chips -> the slice shape Cloud TPU creates (3-D: v4/v5p, 2-D: v5e/v6e)
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}  # fmt: skip
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Target:
  """What a plan compiles for.

  Attributes:
    name: as given (``v5p-64``, ``v5e:4x4``, ``cpu-8``, ``devices``, ``h100-8``).
    platform: ``tpu``, ``cpu``, ``gpu`` (the devices' platform).
    kind: ``topology`` (compile-only TPU devices), ``cpu`` (``cpu-N`` host devices), ``devices`` (this
      machine's), ``estimate`` (a GPU: no compile, the analytic formula only).
    chip: the datasheet numbers, or None (a CPU: no fit test, no roofline).
    topology: the TPU topology string (``v5:2x4x4``), the chip config and the shape; None otherwise.
    chips: devices per slice; slices: ``--slices``.
  """

  name: str
  platform: str
  kind: str
  chip: Chip | None
  chips: int
  slices: int = 1
  topology: str | None = None
  chip_config: str | None = None
  shape: tuple[int, ...] | None = None

  @property
  def devices_total(self) -> int:
    return self.chips * self.slices

  @property
  def fit_test(self) -> bool:
    """Whether the compiler's memory check is the chip's (a TPU topology, or an accelerator of this machine)."""
    return self.kind == "topology" or (self.kind == "devices" and self.platform != "cpu")

  def describe(self) -> str:
    if self.kind == "topology":
      sl = f" x {self.slices} slices" if self.slices > 1 else ""
      return f"{self.name}: topology {self.topology} ({self.chip_config}), {self.chips} devices{sl}, {self.chip.name}"
    if self.kind == "estimate":
      return f"{self.name}: {self.chips} x {self.chip.name} (estimated by formula, nothing compiled)"
    return f"{self.name}: {self.devices_total} {self.platform} devices"


#: ``device.device_kind`` (lower case) -> family, first match wins
_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"), ("v5", "v5p"), ("v4", "v4"),
          ("h100", "h100"), ("h200", "h200"), ("a100", "a100"))  # fmt: skip


def chip_of_kind(device_kind: str) -> Chip | None:
  """The datasheet of a device kind (``TPU v5 lite`` -> v5e, ``NVIDIA H100 80GB HBM3`` -> H100), None for a CPU or
  an unknown chip (no fit test, no roofline: never a guessed peak); a PCIe H100 is not the SXM datasheet: None."""
  kind = device_kind.lower()
  if "pcie" in kind:
    return None
  return next((CHIPS[f] for key, f in _KINDS if key in kind and ("tpu" in kind) == f.startswith("v")), None)


def _device_chip(device) -> Chip | None:
  """The datasheet of this machine's accelerator, its memory the runtime's ``bytes_limit`` when it reports one (what
  a program may really use); None for a CPU."""
  if device.platform == "cpu":
    return None
  chip = chip_of_kind(device.device_kind)
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = (stats or {}).get("bytes_limit")
  if limit:
    base = chip or Chip(device.device_kind, 0, float("nan"), float("nan"), "unknown chip: no roofline")
    chip = dataclasses.replace(base, hbm_bytes=int(limit), source=f"{base.source}; memory: the runtime's bytes_limit")
  return chip


def _bad(text: str, why: str) -> ValueError:
  return ValueError(
    f"--topology {text!r}: {why}; expected a Cloud TPU name (v5p-64, v5e-16, v5litepod-64, v6e-256, v4-8), a "
    "topology string (v5e:4x4, v5:2x4x4), cpu-N, devices, or a GPU estimate (h100-8, h200-8, a100-8)"
  )


def parse_target(text: str, slices: int = 1) -> Target:
  """The :class:`Target` of ``text`` (see the module docstring); ValueError in one line for a name it does not know."""
  if not isinstance(slices, int) or slices < 1:
    raise ValueError(f"--slices must be an int >= 1; got {slices!r}")
  t = text.strip().lower()
  if t == "devices":
    d = jax.devices()
    return Target(text, d[0].platform, "devices", _device_chip(d[0]), len(d))
  if m := re.fullmatch(r"cpu-(\d+)", t):
    return Target(text, "cpu", "cpu", None, int(m.group(1)), slices)
  if m := re.fullmatch(r"(h100|h200|a100)-(\d+)", t):
    return Target(text, "gpu", "estimate", CHIPS[m.group(1)], int(m.group(2)), slices)
  if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", t):
    family = _FAMILY_OF_PREFIX[m.group(1)]
    prefix, config, per_chip = _TOPOLOGY[family]
    n = int(m.group(2))
    if n % per_chip:
      raise _bad(text, f"a {family} name counts TensorCores ({per_chip} per chip): {n} is not a multiple")
    chips = n // per_chip
    table = _SHAPES_3D if per_chip == 2 else _SHAPES_2D
    if chips not in table:
      raise _bad(text, f"no {family} slice of {chips} chips; the sizes are {sorted(k * per_chip for k in table)}")
    shape = table[chips]
    return Target(text, "tpu", "topology", CHIPS[family], chips, slices, f"{prefix}:{'x'.join(map(str, shape))}",
                  config, shape)  # fmt: skip
  if m := re.fullmatch(r"(v4|v5|v5p|v5e|v6e):(\d+(?:x\d+){1,2})", t):
    family = _FAMILY_OF_PREFIX[m.group(1)]
    prefix, config, _ = _TOPOLOGY[family]
    shape = tuple(int(x) for x in m.group(2).split("x"))
    chips = 1
    for s in shape:
      chips *= s
    return Target(text, "tpu", "topology", CHIPS[family], chips, slices, f"{prefix}:{m.group(2)}", config, shape)
  raise _bad(text, "unknown")


def _wrap(shape: tuple[int, ...]) -> tuple[bool, bool, bool]:
  """Torus links: a full v4/v5p cube of 4 or more chips a side wraps in every dimension; a v5e/v6e dimension of 16."""
  if len(shape) == 3:
    full = min(shape) >= 4
    return (full, full, full)
  return (shape[0] == 16, shape[1] == 16, False)


def target_devices(target: Target) -> list:
  """The devices to build the mesh of: compile-only TPU devices of the topology (libtpu needed), the first
  ``N`` host CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before jax is
  imported: ``scripts/plan.py`` does it), or this machine's. ValueError in one line otherwise."""
  if target.kind == "estimate":
    raise ValueError(f"{target.name}: a GPU target is estimated by formula; there are no devices to compile for")
  if target.kind == "devices":
    return list(jax.devices())
  if target.kind == "cpu":
    cpus = jax.devices("cpu")
    if len(cpus) < target.devices_total:
      raise ValueError(
        f"--topology {target.name}: this process has {len(cpus)} CPU devices; set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={target.devices_total} before jax is imported "
        "(scripts/plan.py does it)"
      )
    return cpus[: target.devices_total]
  shape3 = target.shape if len(target.shape) == 3 else target.shape + (1,)
  host = tuple(min(2, s) for s in shape3[:2]) + (1,)
  try:
    topo = topologies.get_topology_desc(
      platform="tpu",
      topology_name=target.topology,
      chip_config_name=target.chip_config,
      chips_per_host_bounds=host,
      num_slices=target.slices,
      wrap=_wrap(target.shape),
    )
  except Exception as e:  # noqa: BLE001 - no libtpu, or a topology libtpu refuses: one line
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(
      f"--topology {target.name}: cannot get TPU topology {target.topology} ({first}); compiling for a TPU needs "
      "libtpu: bash scripts/setup_tpu_venv.sh, then run with .venv-tpu/bin/python"
    ) from None
  return list(topo.devices)
