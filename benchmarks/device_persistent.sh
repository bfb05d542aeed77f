#!/usr/bin/env bash
# Persistent grids of the implicit GEMM (TileConfig.persistent; kernels/NOTES.md versions 19-20) on the GPU, in one
# device call from the repository root:
#     device run, carry [".whl"], command: bash benchmarks/device_persistent.sh
# 1. tests: every whole 3x3 candidate on persistent grids of 1-3 programs per SM, and every tile the models' convs
#    can choose (the lists' twins among them), against float64 (Triton flattens the tile loop with the reduction
#    loop, the loop nest it has miscompiled at 8 warps: issue 8 item 6).
# 2. sweep: the layers with grids of many tiles at batch 32 (SWEEP_LAYERS: YOLOv8n's 64->64 @80 and 64->128 stride 2
#    @160), fp16 and tf32 (SWEEP_REGIMES), their candidates, the sweep's extra tiles and every whole candidate on
#    1-3 programs per SM, each against float64, beside cuDNN.
# 3. table: the shipped table's classes of those layers rebuilt from the sweep and the committed sweeps named in
#    TABLE_SWEEPS (a class that also holds shapes this sweep lacks is kept unless a sweep named there has them; the
#    file comes back in $OUT).
# 4. models: whole-model rows on the rebuilt table (MODEL_ROWS, default YOLOv8n at batch 32 fp16).
# 5. layers: the whole layer benchmark (not in the default STAGES: with all the others it passes the 600 s of a call).
# 6. resident: the resident-weight 3x3 kernel (kernels/conv_resident.py) against float64 on every measured config,
#    then timed against the shipped kernel and cuDNN on YOLOv8n's 64->64 @80 (benchmarks/resident_weights.py; not
#    in the default STAGES).
# 7. halo: the Gluon halo 3x3 kernel (kernels/conv_halo.py) against float64 (its GPU tests), then timed against the
#    implicit GEMM, conv2d_act's route and cuDNN (benchmarks/halo_conv.py; results/halo-conv-2026-12-04b.json came
#    from this; not in the default STAGES).
# STAGES picks stages (default "tests sweep table models"); TEST_K the tests (a pytest -k expression); TESTS_S,
# SWEEP_S, MODELS_S, LAYERS_S their limits (defaults 240, 150, 100 and 320 s).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/persistent.log"
source benchmarks/device_setup.sh  # also defines stage()
source benchmarks/device_tile_stages.sh
want() { [[ " ${STAGES:-tests sweep table models} " == *" $1 "* ]]; }
want tests && gpu_tests_stage "${TESTS_S:-240}" "${TEST_K:-persistent or models_convs}"
sweep_s=${SWEEP_S:-150}
want sweep && stage sweep "$sweep_s" python3 -m benchmarks.conv_tile_sweep --only late \
    --layers "${SWEEP_LAYERS:-yolov8.64x3x3@80,yolov8.64->128s2@160}" --budget-s $((sweep_s - 25)) --out "$OUT/sweep" \
    --regimes "${SWEEP_REGIMES:-32:float16,32:float32}"
# shellcheck disable=SC2086  # TABLE_SWEEPS splits into one argument per file
want table && table_stage ${TABLE_SWEEPS:-} "$OUT/sweep/conv-tile-sweep.json"
want models && models_stage "${MODELS_S:-100}" "${MODEL_ROWS:-yolov8n:32:float16}"
want layers && layers_stage "${LAYERS_S:-320}"
want resident && stage resident-tests 120 python3 -m pytest tests/kernels/test_kernels_resident.py -m gpu -q \
    -p no:cacheprovider
want resident && stage resident 120 python3 -m benchmarks.resident_weights --out "$OUT/resident"
want halo && stage halo-tests 150 python3 -m pytest tests/kernels/test_kernels_halo.py -m gpu -q -p no:cacheprovider \
    -n 8
want halo && stage halo 170 python3 -m benchmarks.halo_conv --out "$OUT/halo"
finish_tile_call 30
