#!/usr/bin/env bash
# The peer comparison in one command (downloads the peers into $PEERS_ROOT on first use):
#
#   bash scripts/peers/run_all.sh                      # numbers (≈3 min) + speed/memory (1 round, 20m)
#   ROUNDS=3 bash scripts/peers/run_all.sh             # speed/memory: 3 alternating rounds, medians
#   ROUNDS=3 WORKLOADS="20m 150m" bash scripts/peers/run_all.sh   # both workloads
#   SKIP_SPEED=1 bash scripts/peers/run_all.sh         # numbers only
#   PEERS_ROOT=/elsewhere/.peers bash scripts/peers/run_all.sh    # venvs and models elsewhere
#
# PEERS_ROOT (default .peers/ under the repo) holds the two venvs (tunix/, trl/) and the saved models
# (model/ for 20m, model-150m/); the outputs go to .peers/out/ under the repo: {inputs,trl,verl,tunix}.npz,
# the equivalence table numbers.md and the speed tables peers_bench_<workload>.md (+ raw JSON lines).
# Not part of the default test run.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PEERS_ROOT="${PEERS_ROOT:-$PWD/.peers}"
OUT=.peers/out
mkdir -p "$OUT"
[ -x "$PEERS_ROOT/tunix/bin/python" ] && [ -x "$PEERS_ROOT/trl/bin/python" ] || bash scripts/peers/setup_envs.sh
for w in ${WORKLOADS:-20m}; do
  dir="$PEERS_ROOT/model"; [ "$w" = 20m ] || dir="$PEERS_ROOT/model-$w"
  [ -f "$dir/model.safetensors" ] || "$PEERS_ROOT/trl/bin/python" scripts/peers/make_model.py "$dir" --size "$w"
done
python scripts/peers/make_inputs.py "$OUT/inputs.npz"
"$PEERS_ROOT/trl/bin/python" scripts/peers/numbers_trl.py "$OUT/inputs.npz" "$PEERS_ROOT/model" "$OUT/trl.npz"
"$PEERS_ROOT/trl/bin/python" scripts/peers/numbers_verl.py "$OUT/inputs.npz" "$OUT/verl.npz"
"$PEERS_ROOT/tunix/bin/python" scripts/peers/numbers_tunix.py "$OUT/inputs.npz" "$OUT/tunix.npz"
python scripts/peers/compare.py "$OUT" | tee "$OUT/numbers.md"
if [ -z "${SKIP_SPEED:-}" ]; then
  for w in ${WORKLOADS:-20m}; do
    python scripts/peers/bench_peers.py --workload "$w" --rounds "${ROUNDS:-1}" --out "$OUT/peers_bench_$w.md"
  done
fi
