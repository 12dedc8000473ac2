#!/usr/bin/env bash
# Create the peers' virtual environments under $PEERS_ROOT (default .peers/ under the repo,
# git-ignored), so Tunix, TRL and verl never enter jaxgrpo's own dependencies.
#
#   bash scripts/peers/setup_envs.sh            # both venvs
#   bash scripts/peers/setup_envs.sh tunix      # one of them: tunix | trl
#
# $PEERS_ROOT/tunix : google-tunix (JAX) + its own jax/flax
# $PEERS_ROOT/trl   : trl + CPU torch (the local wheel: `pip install torch==2.13.0`; an unpinned torch
#                     pulls a multi-GB CUDA build) + verl's core_algos (installed --no-deps, imported
#                     without its Ray/vLLM stack); py-spy for `trl_probe.py --profile py-spy`
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="${PEERS_ROOT:-.peers}"
PY=${PYTHON:-python3.11}
TUNIX_VERSION=0.1.7
TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
VERL_VERSION=0.9.1
PYSPY_VERSION=0.4.3
mkdir -p "$ROOT"

want() { [ $# -eq 0 ] || [ "$1" = "$2" ]; }

if want "${1:-}" tunix || [ -z "${1:-}" ]; then
  if [ ! -x "$ROOT/tunix/bin/python" ]; then "$PY" -m venv "$ROOT/tunix"; fi
  "$ROOT/tunix/bin/pip" install -q "google-tunix==$TUNIX_VERSION" safetensors psutil
  "$ROOT/tunix/bin/pip" freeze > "$ROOT/tunix.freeze.txt"
fi

if want "${1:-}" trl || [ -z "${1:-}" ]; then
  if [ ! -x "$ROOT/trl/bin/python" ]; then "$PY" -m venv "$ROOT/trl"; fi
  "$ROOT/trl/bin/pip" install -q "torch==$TORCH_VERSION"
  "$ROOT/trl/bin/pip" install -q "trl==$TRL_VERSION" "torch==$TORCH_VERSION" psutil
  # verl: only trainer/ppo/core_algos is used; its heavy stack (ray, vllm, ...) is not installed.
  "$ROOT/trl/bin/pip" install -q --no-deps "verl==$VERL_VERSION"
  "$ROOT/trl/bin/pip" install -q omegaconf tensordict codetiming orjson ray  # imported by verl/__init__
  "$ROOT/trl/bin/pip" install -q "py-spy==$PYSPY_VERSION"  # sampling profiler for trl_probe.py (a binary)
  "$ROOT/trl/bin/pip" freeze > "$ROOT/trl.freeze.txt"
fi
echo "peers ready under $ROOT/"
