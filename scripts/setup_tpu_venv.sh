#!/usr/bin/env bash
# Build .venv-tpu/: a virtual environment of its own with libtpu, for compiling programs for TPU topologies ahead of
# time on a machine without a TPU (`jax.experimental.topologies.get_topology_desc` gives compile-only TPU devices;
# docs/models.md, "Target platform"; docs/scale.md).
#
# Why a second environment: with libtpu installed, jax registers the TPU backend in every process of that
# environment, and on a machine without a TPU each `import jax` then pays libtpu's probing; the main environment
# stays CPU-only. The `tpu-aot` extra of setup.cfg is `jax[tpu]` at the main environment's jax version (it resolves
# libtpu==0.0.42.1, a ~213 MB wheel); the venv gets the same jax / jaxlib / flax / optax / orbax / chex / numpy /
# ml-dtypes versions as the python that runs this script, so both environments trace the same programs.
# The tests that compile for a TPU run their compile code in a child process with this venv's python
# (tests/test_tpu_aot.py, through tests/helpers.py's ensure_side_venv("tpu")).
#
# Idempotent: a stamp file records the inputs; a second run with the same inputs returns at once. The installer (uv
# with pip's configuration, else pip) and the stamp check are scripts/_venv_common.sh.
# Usage: bash scripts/setup_tpu_venv.sh   (PYTHON=... to pick the base interpreter; VENV=... for another path)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VENV="${VENV:-.venv-tpu}"
PINS="$("$PY" - <<'PYEOF'
from importlib import metadata
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "ml-dtypes"]
pins = []
for n in names:
  try:
    pins.append(f"{n}=={metadata.version(n)}")
  except metadata.PackageNotFoundError:
    pass
print(" ".join(pins))
PYEOF
)"
WANT="$("$PY" -c 'import sys; print(sys.version.split()[0])') $PINS $(sha1sum scripts/setup_tpu_venv.sh scripts/_venv_common.sh setup.cfg | cut -c1-12 | tr '\n' ' ')"
# shellcheck source=scripts/_venv_common.sh
source scripts/_venv_common.sh
if venv_up_to_date "$WANT"; then
  exit 0
fi
venv_installer
echo "setup_tpu_venv: building $VENV with $INSTALLER ($PINS)"
rm -rf "$VENV"
make_venv
# shellcheck disable=SC2086
install $PINS -e ".[tpu-aot]"
"$VENV/bin/python" -c "import jax, libtpu; from jax.experimental import topologies; print('setup_tpu_venv: jax', \
jax.__version__, 'libtpu', libtpu.__version__ if hasattr(libtpu, '__version__') else '?')"
venv_stamp "$WANT"
