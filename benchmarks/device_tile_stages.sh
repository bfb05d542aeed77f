# Sourced after device_setup.sh by the tile-work device scripts (device_stem.sh, device_persistent.sh): the stages
# they share, each through device_setup.sh's stage() (bounded, logged to $LOG, its status kept in ${summary[@]}).

# gpu_tests_stage LIMIT_S K: the GPU kernel tests the pytest -k expression K selects
gpu_tests_stage() {
    stage tests "$1" python3 -m pytest tests/kernels -m gpu -n 16 -q -p no:cacheprovider -k "$2"
}

# table_stage SWEEP_JSON...: the shipped table's classes rebuilt from conv_tile_sweep results; the file comes back
# in $OUT to commit
table_stage() {
    stage table 30 python3 -m benchmarks.tile_table --from-sweep "$@"
    cp kernels/tile_table_sm90.json "$OUT/"
}

# models_stage LIMIT_S ROWS: whole-model rows (ROWS: model:batch:dtype, space-separated) on the current table
models_stage() {
    # shellcheck disable=SC2086  # ROWS splits into one argument per row
    stage models "$1" python3 -m benchmarks.gpu_models --out "$OUT/models" --rows $2 --budget-s 10 \
        --row-timeout-s $(($1 - 10))
}

# layers_stage LIMIT_S: the whole layer benchmark
layers_stage() {
    stage layers "$1" python3 -m benchmarks.layers --out "$OUT/layers"
}

# finish_tile_call LINES: drop the plots (at most 8 files come back; the JSONs hold the figures), then print the
# log's last LINES result lines and each stage's status
finish_tile_call() {
    rm -f "$OUT"/*/*.png
    grep -E "passed|failed|b32 |b1 |kept|replaced|added|^\| [a-z]|^(variant|resident|shipped|cudnn) " "$LOG" | tail -"$1"
    printf '%s\n' "${summary[@]}"
}
