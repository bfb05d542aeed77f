#!/usr/bin/env bash
# The runs kernels/NOTES.md version 17 owes, in one device call from the repository root:
#     device run, carry [".whl"], command: bash benchmarks/device_table.sh
# 1. YOLOv8n and ResNet-50 at batch 32 fp16, untuned, fuser + CUDA graphs only, as the machine's first processes:
#    cold optimize() with the shape-propagation forward no longer benchmarking cuDNN (prediction: YOLOv8n within
#    1 s of the 4.0 s a warmed process took).
# 2. The tile sweep of ResNet-50's stride-1 3x3 convs at 28x28 and 14x14 (fp16 and tf32), then the shipped table
#    rebuilt from it (`tile_table --from-sweep`, in place here; the new table comes back in $OUT).
# 3. ResNet-50 batch 32 fp16 untuned on the rebuilt table, then tuned, in the same call (prediction: within 1%).
# Results land in $OUT (at most 8 files come back): first/, sweep/, after/, tuned/, the table and the log.
# The stages' limits add up to 520 s, inside the device's 600 s per command with the set-up.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/table.log"
source benchmarks/device_setup.sh  # also defines stage()
# timeout(1) runs programs, not shell functions: the rows command is an array
rows=(python3 -m benchmarks.gpu_models --variants fuser+graphs --budget-s 100 --row-timeout-s 140)
stage first 110 "${rows[@]}" --rows yolov8n:32:float16 resnet50:32:float16 --tune off --out "$OUT/first"
[ "${SKIP_SWEEP:-0}" = 1 ] || stage sweep 170 python3 -m benchmarks.conv_tile_sweep --only late --budget-s 140 --out "$OUT/sweep" \
    --layers resnet50.layer2.3x3@28,resnet50.layer3.3x3@14 --regimes 32:float16,32:float32
[ "${SKIP_SWEEP:-0}" = 1 ] || stage table 30 python3 -m benchmarks.tile_table --from-sweep "$OUT/sweep/conv-tile-sweep.json"
cp kernels/tile_table_sm90.json "$OUT/"
stage after 60 "${rows[@]}" --rows resnet50:32:float16 --tune off --out "$OUT/after"
stage tuned 150 "${rows[@]}" --rows resnet50:32:float16 --tune on --out "$OUT/tuned"
rm -f "$OUT"/*/*.png  # at most 8 files come back; the JSONs hold the figures
grep -E "^\| (yolov8n|resnet50)|^(yolov8n|resnet50)|kept|replaced|added" "$LOG" | tail -20
printf '%s\n' "${summary[@]}"
