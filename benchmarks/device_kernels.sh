#!/usr/bin/env bash
# One batched GPU session for the kernels (run through the device tool from the repository root):
# GPU tests, the CPU interpreter tests under the GPU machine's triton (3.6: the second version the
# interpreter shim must work with), then the layer benchmark. Full logs and results go under $OUT;
# the tile choices measured here are kept in .fuser_autotune/ (carried to the next session if asked).
set -uo pipefail
OUT=${OUT:-/tmp/out}
BENCH_ARGS=${BENCH_ARGS:-}
TEST_FILTER=${TEST_FILTER:-}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 FUSER_CACHE_DIR="$PWD/.fuser_autotune"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, torch.cuda.get_device_name())"
start=$SECONDS
timeout "${GPU_TEST_S:-240}" python3 -m pytest tests/kernels -m gpu -n 8 -v -rf -p no:cacheprovider ${TEST_FILTER:+-k "$TEST_FILTER"} \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $((SECONDS - start)) s: $(tail -1 "$OUT/gpu_tests.log")"
if [ -z "${SKIP_CPU_TESTS:-}" ]; then
    start=$SECONDS
    timeout "${CPU_TEST_S:-120}" python3 -m pytest tests/kernels -m "not gpu" -n 8 -q -p no:cacheprovider \
        > "$OUT/cpu_tests_interpreter.log" 2>&1
    echo "interpreter tests rc=$? in $((SECONDS - start)) s: $(tail -1 "$OUT/cpu_tests_interpreter.log")"
fi
start=$SECONDS
timeout "${BENCH_S:-300}" python3 -m benchmarks.layers --out "$OUT/bench" $BENCH_ARGS > "$OUT/bench.log" 2>&1
echo "benchmark rc=$? in $((SECONDS - start)) s"
tar czf "$OUT/autotune.tgz" .fuser_autotune 2>/dev/null
grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -20
[ -f "$OUT/cpu_tests_interpreter.log" ] && grep -E "FAILED|Error" "$OUT/cpu_tests_interpreter.log" | head -10
cat "$OUT/bench.log" | tail -60
