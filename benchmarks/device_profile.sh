#!/usr/bin/env bash
# What the two layers kernels/NOTES.md version 17 could not explain wait on, through Nsight Compute, in one device
# call from the repository root:
#     device run, command: bash benchmarks/device_profile.sh
# The fp16 RGB stem (the direct kernel) and YOLO's 64->64 @80 in fp16 (the box-tile implicit GEMM), batch 32,
# untuned default tiles (benchmarks/stall_profile.py launches them): one launch each after two, with the warp
# stall reasons, scheduler, occupancy, memory and speed-of-light sections, clocks left alone (METHOD.md), on ncu's raw
# page by default (PAGE=details for the sections' tables, as results/ncu-2026-12-04 holds). A machine
# whose runtime gives ncu no counters (gVisor, KINDS.md) says so in the log. Reports as CSV in $OUT.
set -uo pipefail
PAGE=${PAGE:-raw}  # raw: every metric under its own name, the stall reasons among them; details: the sections' tables
source benchmarks/device_setup.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
if [ -z "$NCU" ]; then
    echo "no ncu on this machine"
    exit 1
fi
profile() {
    local name=$1 kernel=$2 layer=$3
    local start=$SECONDS
    timeout 240 "$NCU" --clock-control none --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        --csv --page "$PAGE" --log-file "$OUT/$name.csv" \
        python3 -m benchmarks.stall_profile --layer "$layer" --dtype fp16 --batch 32 --calls 4 > "$OUT/$name.log" 2>&1
    echo "$name rc=$? in $((SECONDS - start)) s"
    grep -E "tile |==ERR|==WARNING|Failed" "$OUT/$name.log" "$OUT/$name.csv" | head -5
    if [ "$PAGE" = raw ]; then
        # the stall reasons, largest first: warps waiting per issued instruction, by reason
        python3 -m benchmarks.stall_reasons "$OUT/$name.csv" | head -12
    else
        grep -iE "Stall|Warp Cycles|Issued|Occupancy|Throughput" "$OUT/$name.csv" | cut -c1-200 | head -25
    fi
}
profile stem _direct_conv_act_kernel "yolo 3->16 3x3 s2 @640"
profile c64 _conv2d_act_kernel "yolo 64->64 3x3 s1 @80"
