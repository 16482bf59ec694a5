#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and Nsight Compute (ncu): why each exchange kernel is where it
# is against the memory floor. For each kernel, one launch profiled with the sections that say
# whether it is bound by DRAM, by instruction issue or by latency (speed of light, occupancy,
# warp stall reasons, memory workload), from `benchmarks/kernel_speed.py --only NAME --repeat 1`
# at the size the benchmark tables use. Run after `scripts/gpu_check.sh` (which builds the
# package with CUDA); about 2 minutes. Reports: $OUT/ncu_<kernel>.txt (OUT: runs/gpu_profile).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_profile}
N=${N:-100000000}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then
  echo "gpu_profile: no ncu (Nsight Compute) found" >&2
  exit 2
fi
# case name in benchmarks/kernel_speed.py : CUDA kernel name in cpp/onebit_cuda.cu
for pair in worker_deferred:worker_pass1 server_reduce:server_pass1 decompress:decompress_kernel \
  lamb_update:lamb_kernel adam_update:adam_kernel; do
  case_name=${pair%%:*}
  kernel=${pair##*:}
  echo "=== $case_name ($kernel)"
  # --clock-control none: the clocks the benchmark runs at, not ncu's base clocks; the name as a
  # regex, so that it matches with or without the namespace (adam_kernel, not frozen_adam_kernel)
  "$NCU" --clock-control none --kernel-name "regex:(^|:)$kernel$" --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    "$PY" benchmarks/kernel_speed.py --device cuda --n "$N" --repeat 1 --only "^$case_name\$" \
    >"$OUT/ncu_$case_name.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Waves Per SM|Block Limit Registers|Stall|One or More Eligible|Issued Warp" \
    "$OUT/ncu_$case_name.txt" | head -n 30
done
