#!/usr/bin/env bash
# The whole-model benchmark (and the data-parallel one) in one device call, from the repository root:
#     device run, carry [".whl"], command: bash benchmarks/device_models.sh
# .whl/ holds the wheels the GPU machine lacks (ultralytics, ultralytics-thop), set up by device_setup.sh;
# gpu_models gives each row its own empty caches, for cold optimize/compile times. Results and logs land
# in $OUT (at most 8 files come back): gpu-models-<date>.json/.png, multi-gpu-<date>.json, models.log,
# multi.log.
# STAGES picks stages (default "multi models"); TOTAL_S (default 570) bounds the whole call inside the
# device's 600 s: the data-parallel stage runs first (MULTI_S, default 150), and the whole-model stage
# gets what is left, starting no new row once less than ROW_TIMEOUT_S (default 150) would remain.
# MODELS_ARGS and MULTI_ARGS pass more options. Typically the call ends in about 8-9 minutes.
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
want() { [[ " ${STAGES:-multi models} " == *" $1 "* ]]; }
# One GPU lent: two processes share it (exercises the saved model, the device moves and NCCL on one card).
want multi && stage multi "${MULTI_S:-150}" python3 -m benchmarks.multi_gpu --out "$OUT" \
    --procs-per-gpu "${PROCS_PER_GPU:-2}" ${MULTI_ARGS:-}
left=$(( ${TOTAL_S:-570} - SECONDS ))
budget=$(( left - ${ROW_TIMEOUT_S:-150} - 10 ))
want models && stage models "$left" python3 -m benchmarks.gpu_models --out "$OUT" \
    --budget-s "$(( budget > 30 ? budget : 30 ))" --row-timeout-s "${ROW_TIMEOUT_S:-150}" ${MODELS_ARGS:-}
ls -la "$OUT"
printf '%s\n' "${summary[@]}"
