#!/usr/bin/env bash
# The accelerator rows of BENCHMARKS.md in one run: first scripts/plan.py --devices (the compiler's per-device bytes
# of the pod workload at Qwen3-0.6B on this GPU, beside the formula's GPU estimate), then the sizes users train first (scripts/bench_accel.py: Qwen3-0.6B-
# and 1.7B-shaped random models in bf16 — train-step MFU against the chip's bf16 peak, decode tokens/s against the
# HBM roofline, one whole GRPO iteration; results as OUT/res/accel_<shape>.json), then the binary-tree reproduction (default policy, then the paper's
# gpt2-small policy), the built-in engine against transformers' generate, layers as a scan at depth 28, the train
# step, MoE, LoRA/QLoRA, the sampler and its decode over the filled KV cache — each step under its own time limit, in priority order, until a global
# deadline; one log and one tarball of JSON results under OUT.
#
# Usage (on a machine with one GPU and JAX's CUDA build; python3 is its interpreter):
#   OUT=/some/dir DEADLINE_S=520 bash scripts/gpu_check.sh
#   ONLY=scan_layers,lora LIMITS=scan_layers=240,lora=200 OUT=... bash scripts/gpu_check.sh   # some steps, longer limits
#   DRY=1 OUT=/tmp/dry bash scripts/gpu_check.sh    # the CPU dry path (tests/test_gpu_check.py): the plumbing and
#                                                  # bench_accel.py at its toy shape, nothing else
# Wheels missing there (datasets and its two pure-Python requirements; our flax/optax/orbax/chex versions, so the
# run uses the versions the CPU suite tests) are installed from .whl/ when it exists.
# Not here: vLLM (its CUDA build is far over the 64 MiB a run may carry) and the disaggregated async rows (one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT/res"
LOG="$OUT/gpu.log"
START=$(date +%s)
DEADLINE_S="${DEADLINE_S:-520}"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxgrpo-gpu-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.9

if [[ -d .whl ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi

step() {  # step NAME LIMIT_S CMD... : runs CMD under min(LIMIT_S, time left), logs its output and its wall time
  local name=$1 limit=$2
  shift 2
  if [[ -n "${ONLY:-}" && ",$ONLY," != *",$name,"* ]]; then
    return
  fi
  local override
  override=$(tr ',' '\n' <<<"${LIMITS:-}" | sed -n "s/^$name=//p")
  [[ -n "$override" ]] && limit=$override
  local left=$((DEADLINE_S - ($(date +%s) - START)))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    echo "=== $name: skipped (deadline)" | tee -a "$LOG"
    return
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: rc $? in $(($(date +%s) - t0))s" | tee -a "$LOG"
}

if [[ -n "${DRY:-}" ]]; then
  ONLY=accel_dry
fi
{
  nvidia-smi -L || echo "no nvidia-smi"
  "$PY" -c "import jax, flax, optax, transformers, torch; print('jax', jax.__version__, jax.devices(), 'flax', \
flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
} >>"$LOG" 2>&1

# first: the plan of the pod workload (Qwen3-0.6B, 64 completions) compiled for this GPU, beside the formula's
# estimate for the same chip (docs/scale.md, "GPU targets: estimated"): the estimate checked against the compiler
# (the estimate of the chip lent: an H200 or A100 is not an H100's datasheet)
PLAN_ARGS=(--config scripts/configs/pod_grpo.yaml --model qwen3-0.6b --rollout.prompts_per_step 8 --no-fix --json)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
  *H200*) ESTIMATE=h200-1 ;;
  *A100*) ESTIMATE=a100-1 ;;
  *) ESTIMATE=h100-1 ;;
esac
step plan_devices 150 bash -c "\"$PY\" scripts/plan.py --devices --programs step,sampler ${PLAN_ARGS[*]} >\"$OUT/res/plan_devices.json\""
step plan_estimate 30 bash -c "\"$PY\" scripts/plan.py --topology $ESTIMATE ${PLAN_ARGS[*]} >\"$OUT/res/plan_estimate.json\""
step accel_dry 120 "$PY" scripts/bench_accel.py --dry --out "$OUT/res"
step accel_0.6b 150 "$PY" scripts/bench_accel.py --shapes 0.6b --out "$OUT/res"
step accel_1.7b 170 "$PY" scripts/bench_accel.py --shapes 1.7b --out "$OUT/res"
step binary_tree_gpt2 120 "$PY" scripts/binary_tree.py --no-plot --quiet --out "$OUT/res/bt_gpt2"
step binary_tree_gpt2_small 170 "$PY" scripts/binary_tree.py --policy gpt2-small --seeds 2 --no-plot --quiet \
  --out "$OUT/res/bt_gpt2_small"
step engines 100 "$PY" scripts/bench_engines.py --skip-vllm --workloads 20m,150m --repeats 3 --out "$OUT/res/engines.json"
step engines_150m 150 "$PY" scripts/bench_engines.py --skip-vllm --workloads 150m --repeats 2 \
  --out "$OUT/res/engines_150m.json"
step scan_layers 100 "$PY" scripts/bench_scan_layers.py --layers 28 --rounds 1 --run-repeats 5
step train_step 60 "$PY" scripts/bench_train_step.py --rounds 3
step lora 90 "$PY" scripts/bench_lora.py --steps 3
step lora_adapters 200 "$PY" scripts/bench_lora.py --steps 3 --modes lora,qlora
step moe 50 "$PY" scripts/bench_moe.py --repeats 3 --skip-mismatch
step sampler 50 "$PY" scripts/bench_sampler.py --repeats 3
# the decode loop over the filled KV-cache slots against the whole cache, 64 rows x (64 + 4,096) tokens
step decode_blocks 90 "$PY" scripts/bench_decode_attention.py --prompts 8 --samples 8 --rounds 3
step binary_tree_gpt2_small_more 120 "$PY" scripts/binary_tree.py --policy gpt2-small --seeds 2 --seed-offset 2 \
  --no-plot --quiet --out "$OUT/res/bt_gpt2_small_2"
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$OUT/res"
echo "=== total $(($(date +%s) - START))s" | tee -a "$LOG"
