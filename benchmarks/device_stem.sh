#!/usr/bin/env bash
# The direct kernel's [channels, pixels] accumulator (branch stem-lanes, kernels/NOTES.md version 18) on the GPU, in
# one device call from the repository root:
#     device run, command: bash benchmarks/device_stem.sh
# 1. The GPU kernel tests of the direct kernel: the stem cases and every tile the models' convs can choose (the full
#    GPU suite runs after a merge).
# 2. The tile sweep of the RGB stem, batch 32 and 1, fp16 and tf32: the new candidates and programs of 1-8 pixels per
#    lane (prediction: the fp16 batch-32 default 10-15% under the old kernel's 210 us; the old kernel, not in this
#    tree, is in results/conv-tile-sweep-2026-12-03f.json and layers-2026-12-04.json).
# 3. The shipped table's direct-kernel classes rebuilt from that sweep (the file comes back in $OUT to commit).
# 4. The whole layer benchmark on the rebuilt table, the stem rows beside cuDNN and torch.compile in the same run.
# The stages' limits add up to 585 s.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LOG="$OUT/stem.log"
source benchmarks/device_setup.sh  # also defines stage()
stage tests 120 python3 -m pytest tests/kernels -m gpu -n 16 -q -p no:cacheprovider -k "stem or direct or models_convs"
stage sweep 115 python3 -m benchmarks.conv_tile_sweep --only rgb --budget-s 100 --out "$OUT/sweep" \
    --regimes 32:float16,32:float32,1:float16,1:float32
stage table 30 python3 -m benchmarks.tile_table --from-sweep "$OUT/sweep/conv-tile-sweep.json"
cp kernels/tile_table_sm90.json "$OUT/"
stage layers 320 python3 -m benchmarks.layers --out "$OUT/layers"
rm -f "$OUT"/*/*.png  # at most 8 files come back; the JSONs hold the figures
grep -E "passed|failed|^yolo 3->16|kept|replaced|added" "$LOG" | tail -16
printf '%s\n' "${summary[@]}"
