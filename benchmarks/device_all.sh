#!/usr/bin/env bash
# One batched GPU session, run through the device tool from the repository root: every GPU test (kernels,
# fused ops on every backend and precision, whole models, CUDA graphs), the whole-model benchmark, the demo
# on the GPU, and the layer benchmark. Each stage has a time limit and appends to $OUT/all.log; results
# (JSON, the demo's plot) land in $OUT. Print a short summary last. STAGES picks stages (default: all four),
# the *_S variables their time limits, GPU_TEST_ARGS what pytest runs (default: every GPU test).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/all.log"
mkdir -p "$OUT"
source benchmarks/device_setup.sh > "$LOG" 2>&1  # also defines stage(), which appends to $LOG
export FUSER_CACHE_DIR="$PWD/.fuser_autotune"
want() { [[ " ${STAGES:-tests models demo layers} " == *" $1 "* ]]; }
want tests && stage gpu_tests "${GPU_TEST_S:-230}" python3 -m pytest -m gpu -n 12 -v -p no:cacheprovider -rf --durations=12 ${GPU_TEST_ARGS:-tests}
want models && stage gpu_models "${MODELS_S:-180}" python3 -m benchmarks.gpu_models --out "$OUT" \
    --budget-s "${MODELS_BUDGET_S:-110}" ${MODELS_ARGS:-}
want demo && stage demo "${DEMO_S:-60}" python3 -m fuser.demo --out "$OUT"
want layers && stage layers "${LAYERS_S:-150}" python3 -m benchmarks.layers --out "$OUT" ${LAYER_ARGS:-}
# The tile choices measured here: carry .fuser_autotune on the next call and they are not measured again.
tar czf "$OUT/autotune.tgz" .fuser_autotune 2>/dev/null
echo "===== summary" >> "$LOG"
grep -E "^(FAILED|ERROR)| FAILED |passed|failed" "$LOG" | tail -25
grep -E "B1 |B32 |fuser vs eager|time per forward|kernel launches|rel. error" "$LOG" | tail -14
printf '%s\n' "${summary[@]}"
