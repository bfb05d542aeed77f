#!/usr/bin/env bash
# The whole-model benchmark (and the data-parallel one) in one device call, from the repository root:
#     device run, carry [".whl"], command: bash benchmarks/device_models.sh
# .whl/ holds the wheels the GPU machine lacks (ultralytics, ultralytics-thop), set up by device_setup.sh;
# gpu_models gives each row its own empty caches, for cold optimize/compile times. Results and logs land
# in $OUT (at most 8 files come back): gpu-models-<date>.json/.png, multi-gpu-<date>.json, models.log,
# multi.log.
# STAGES picks stages (default "models multi"); MODELS_BUDGET_S (start no new row after it, default 270),
# ROW_TIMEOUT_S (150), MODELS_ARGS and MULTI_ARGS pass more options. The stages' limits (440 + 130 s)
# keep the call inside the device's 600 s; typically it ends in about 8 minutes.
set -uo pipefail
source benchmarks/device_setup.sh
summary=()
stage() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "===== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "^(USDT|  built )"
    local rc=${PIPESTATUS[0]}
    summary+=("$name rc=$rc in $((SECONDS - start)) s")
}
want() { [[ " ${STAGES:-models multi} " == *" $1 "* ]]; }
want models && stage models "${MODELS_S:-440}" python3 -m benchmarks.gpu_models --out "$OUT" \
    --budget-s "${MODELS_BUDGET_S:-270}" --row-timeout-s "${ROW_TIMEOUT_S:-150}" ${MODELS_ARGS:-}
# One GPU lent: two processes share it (exercises the saved model, the device moves and NCCL on one card).
want multi && stage multi "${MULTI_S:-130}" python3 -m benchmarks.multi_gpu --out "$OUT" \
    --procs-per-gpu "${PROCS_PER_GPU:-2}" ${MULTI_ARGS:-}
ls -la "$OUT"
printf '%s\n' "${summary[@]}"
