#!/usr/bin/env bash
# The whole-model benchmark (and the data-parallel one) in one device call, from the repository root:
#     device run, carry [".whl"], command: bash benchmarks/device_models.sh
# .whl/ holds the wheels the GPU machine lacks (ultralytics, ultralytics-thop: benchmarks/README.md says
# how to fetch them); they are installed into /tmp/site. Every cache goes to /tmp (gpu_models gives each
# row its own empty ones, for cold optimize/compile times). Results and logs land in $OUT (at most 8
# files come back): gpu-models-<date>.json/.png, multi-gpu-<date>.json, models.log, multi.log.
# STAGES picks stages (default "models multi"); MODELS_BUDGET_S (start no new row after it, default 300),
# ROW_TIMEOUT_S (150), MODELS_ARGS and MULTI_ARGS pass more options. Defaults end within about 8 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ultralytics-config MPLCONFIGDIR=/tmp/matplotlib XDG_CACHE_HOME=/tmp/cache
export TRITON_CACHE_DIR=/tmp/triton-cache FUSER_CACHE_DIR=/tmp/fuser-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    echo "no .whl/ carried: the ultralytics rows will record an import error"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPUs')"
python3 -c "import ultralytics, torchvision, timm; print('ultralytics', ultralytics.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)"
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
want models && stage models "${MODELS_S:-480}" python3 -m benchmarks.gpu_models --out "$OUT" \
    --budget-s "${MODELS_BUDGET_S:-300}" --row-timeout-s "${ROW_TIMEOUT_S:-150}" ${MODELS_ARGS:-}
# One GPU lent: two processes share it (exercises the saved model, the device moves and NCCL on one card).
want multi && stage multi "${MULTI_S:-120}" python3 -m benchmarks.multi_gpu --out "$OUT" \
    --procs-per-gpu "${PROCS_PER_GPU:-2}" ${MULTI_ARGS:-}
ls -la "$OUT"
printf '%s\n' "${summary[@]}"
