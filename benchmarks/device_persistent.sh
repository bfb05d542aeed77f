#!/usr/bin/env bash
# Persistent grids of the implicit GEMM (TileConfig.persistent; kernels/NOTES.md version 19) on the GPU, in one
# device call from the repository root:
#     device run, command: bash benchmarks/device_persistent.sh
# 1. tests: every whole 3x3 candidate on persistent grids of 1-3 programs per SM against float64 (Triton flattens
#    the tile loop with the reduction loop, the loop nest it has miscompiled at 8 warps: issue 8 item 6).
# 2. sweep: YOLOv8n's 64->64 @80 at batch 32, fp16 and tf32 (SWEEP_LAYERS, SWEEP_REGIMES), its candidates, the
#    sweep's extra tiles and every whole candidate's persistent twins, each against float64, beside cuDNN.
# If a twin wins: conv_boxes-style twins in the candidate lists, then `tile_table --from-sweep` on this sweep.
# STAGES picks stages (default "tests sweep"); TESTS_S and SWEEP_S their limits (defaults 240 and 300 s).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/persistent.log"
source benchmarks/device_setup.sh  # also defines stage()
want() { [[ " ${STAGES:-tests sweep} " == *" $1 "* ]]; }
want tests && stage tests "${TESTS_S:-240}" python3 -m pytest tests/kernels -m gpu -n 16 -q -p no:cacheprovider \
    -k persistent
sweep_s=${SWEEP_S:-300}
want sweep && stage sweep "$sweep_s" python3 -m benchmarks.conv_tile_sweep --only late --layers "${SWEEP_LAYERS:-yolov8.64x3x3@80}" \
    --budget-s $((sweep_s - 30)) --out "$OUT/sweep" --regimes "${SWEEP_REGIMES:-32:float16,32:float32}"
grep -E "passed|failed|b32 |b1 " "$LOG" | tail -20
printf '%s\n' "${summary[@]}"
