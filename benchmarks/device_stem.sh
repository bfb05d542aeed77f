#!/usr/bin/env bash
# The direct kernel (the RGB stems; kernels/NOTES.md version 18) on the GPU, in one device call from the repository
# root:
#     device run, carry [".whl"], command: bash benchmarks/device_stem.sh
# 1. sweep: the tile sweep of the RGB stems (YOLOv8n, EfficientNet-B0, MobileNetV3), batch 32 and 1, fp16 and tf32.
# 2. table: the shipped table's direct-kernel classes rebuilt from that sweep (the file comes back in $OUT to commit).
# 3. tests: GPU kernel tests (TEST_K, a pytest -k expression; default the stem cases and every tile the models'
#    convs can choose).
# 4. models: whole-model rows on the rebuilt table (MODEL_ROWS, default YOLOv8n at batch 32 fp16).
# 5. layers: the whole layer benchmark (not in the default STAGES: with the others it passes the 600 s of a call).
# STAGES picks stages (default "sweep table tests models"); SWEEP_S, TESTS_S, MODELS_S, LAYERS_S their limits
# (defaults 150, 180, 100, 320 s).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/stem.log"
source benchmarks/device_setup.sh  # also defines stage()
source benchmarks/device_tile_stages.sh
want() { [[ " ${STAGES:-sweep table tests models} " == *" $1 "* ]]; }
sweep_s=${SWEEP_S:-150}
want sweep && stage sweep "$sweep_s" python3 -m benchmarks.conv_tile_sweep --only rgb --budget-s $((sweep_s - 25)) \
    --out "$OUT/sweep" --regimes 32:float16,32:float32,1:float16,1:float32
want table && table_stage "$OUT/sweep/conv-tile-sweep.json"
want tests && gpu_tests_stage "${TESTS_S:-180}" "${TEST_K:-stem or direct or models_convs}"
want models && models_stage "${MODELS_S:-100}" "${MODEL_ROWS:-yolov8n:32:float16}"
want layers && layers_stage "${LAYERS_S:-320}"
finish_tile_call 40
