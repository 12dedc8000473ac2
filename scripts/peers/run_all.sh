#!/usr/bin/env bash
# The peer comparison in one command (downloads the peers into .peers/ on first use):
#
#   bash scripts/peers/run_all.sh                 # numbers (≈3 min) + speed/memory (1 round)
#   ROUNDS=3 bash scripts/peers/run_all.sh        # speed/memory: 3 alternating rounds, medians
#   SKIP_SPEED=1 bash scripts/peers/run_all.sh    # numbers only
#
# Writes .peers/out/{inputs,trl,tunix}.npz, the equivalence table .peers/out/numbers.md and the
# speed table .peers/out/peers_bench.md (+ raw JSON). Not part of the default test run.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.peers/out
mkdir -p "$OUT"
[ -x .peers/tunix/bin/python ] && [ -x .peers/trl/bin/python ] || bash scripts/peers/setup_envs.sh
[ -f .peers/model/model.safetensors ] || .peers/trl/bin/python scripts/peers/make_model.py .peers/model
python scripts/peers/make_inputs.py "$OUT/inputs.npz"
.peers/trl/bin/python scripts/peers/numbers_trl.py "$OUT/inputs.npz" .peers/model "$OUT/trl.npz"
.peers/tunix/bin/python scripts/peers/numbers_tunix.py "$OUT/inputs.npz" "$OUT/tunix.npz"
python scripts/peers/compare.py "$OUT" | tee "$OUT/numbers.md"
if [ -z "${SKIP_SPEED:-}" ]; then
  python scripts/peers/bench_peers.py --rounds "${ROUNDS:-1}" --out "$OUT/peers_bench.md"
fi
