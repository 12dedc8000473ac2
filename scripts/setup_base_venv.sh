#!/usr/bin/env bash
# Build .venv-base/: the README's set-up command 1 (`pip install -e '.[plot]'`) and nothing else, in a venv of its
# own, so that tests/test_base_install.py runs the documented demo commands where only the declared dependencies are
# installed. The test environment (`.[test]`) pulls in torch, which pulls in jinja2 and more: a package a
# documented command imports but setup.cfg does not declare works there and fails for a user (issue 33).
#
# Every version is held to the one in the python that runs this script (its `pip freeze` as a constraints file:
# constraints pin what the base install resolves, they add no package), so both environments compute the same
# numbers, share one XLA compilation cache, and the build reads uv's cache instead of the indexes.
#
# Idempotent: a stamp file records the inputs (python version, the constraints, this script, setup.cfg); a second
# run with the same inputs returns at once. The installer (uv with pip's configuration, else pip) and the stamp
# check are scripts/_venv_common.sh, shared with setup_vllm_venv.sh.
# Usage: bash scripts/setup_base_venv.sh   (PYTHON=... to pick the base interpreter; VENV=... for another path)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VENV="${VENV:-.venv-base}"
# the base python's versions, minus editable installs (jaxgrpo itself) and direct references
PINS="$("$PY" -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' || true)"
WANT="$("$PY" -c 'import sys; print(sys.version.split()[0])') $(echo "$PINS" | sha1sum | cut -c1-12) \
$(sha1sum scripts/setup_base_venv.sh scripts/_venv_common.sh setup.cfg | cut -c1-12 | tr '\n' ' ')"
# shellcheck source=scripts/_venv_common.sh
source scripts/_venv_common.sh
if venv_up_to_date "$WANT"; then
  exit 0
fi
venv_installer
echo "setup_base_venv: building $VENV with $INSTALLER (-e '.[plot]', versions held to $PY's)"
rm -rf "$VENV"
make_venv
echo "$PINS" >"$VENV/constraints.txt"
install --constraint "$VENV/constraints.txt" -e '.[plot]'
"$VENV/bin/python" -c "import jaxgrpo, jax, transformers; print('setup_base_venv: jax', jax.__version__, \
'transformers', transformers.__version__)"
venv_stamp "$WANT"
