# Sourced by the device scripts (device_models.sh, device_all.sh) at the repository root on the GPU
# machine: NVLink multicast off, every cache in /tmp, the carried wheels in .whl/ installed into
# /tmp/site (the machine has no network: benchmarks/README.md says which wheels and how to fetch
# them), fuser installed in place, and the versions printed; and stage(), the scripts' bounded, logged step.
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
# stage NAME LIMIT_S COMMAND...: one step of a device script, its output appended to $LOG (default $OUT/device.log),
# bounded by timeout(1), which runs programs, not shell functions; each step's exit status and seconds are kept in
# ${summary[@]} for the script's last lines.
LOG=${LOG:-$OUT/device.log}
summary=()
stage() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "===== $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    summary+=("$name rc=$? in $((SECONDS - start)) s")
}
