#!/usr/bin/env bash
# Where the M = 1 tensor-core GEMV's time goes (issue 24), one device call:
# 1. benchmarks/studies/int4_read_pattern.cu: the kernel's access pattern with the math replaced
#    by a spin (stored rows vs a packed tile-major layout, loads pipelined one trip ahead or not),
#    beside a plain streaming read of the same bytes;
# 2. Nsight Compute on the real kernels (PROBE_CONFIGS "config@NxK ..."), one call each.
# Results in $OUT (read_pattern.txt, ncu_tc.txt).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=$PWD/shared/src:$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/read_pattern benchmarks/studies/int4_read_pattern.cu || exit 1
timeout ${PATTERN_S:-150} /tmp/read_pattern | tee "$out/read_pattern.txt"
configs=${PROBE_CONFIGS:-"tc-t4-u1-k2@8192x8192 tc-t2-u2@8192x8192 tc-t4-u1@28672x8192"}
tiled=${PROBE_TILED:+--tiled}
first=${configs%% *}
shape=${first#*@}
# Builds the tc library once (cached for the profiled processes).
timeout 300 python3 benchmarks/studies/profile_quant.py --m 1 --n ${shape%x*} --k ${shape#*x} --config ${first%@*} --calls 2 \
  || exit 1
for case in $configs; do
  cfg=${case%@*} shape=${case#*@}
  echo "=== $cfg M=1 $shape" | tee -a "$out/ncu_tc.txt"
  timeout ${NCU_S:-120} ncu --clock-control none -k regex:int4_tc --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section LaunchStats \
    python3 benchmarks/studies/profile_quant.py --m 1 --n ${shape%x*} --k ${shape#*x} --config "$cfg" $tiled 2>&1 \
    | grep -v "^==PROF==" >> "$out/ncu_tc.txt"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|No Eligible|Eligible Warps" \
    "$out/ncu_tc.txt" | tail -14
done
