#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check (call DN's build; SMP_BURN_NORM_BWD_AHEAD=0 runs the kernel now on main).
# Call DO (1 x H200): why the staged RMSNorm backward has a fixed ~11 us per call that neither
# more cubes (DL) nor a second stage in flight (DN) removes. Prediction: instruction issue at
# low occupancy (8 warps per SM): issue slots busy > 60 %, few eligible warps, stalls on
# short scoreboard / barrier rather than long scoreboard (memory).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0 SMP_BURN_NORM_BWD_AHEAD=0
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
# Launch 8 of `fused_check norm --iters 1` is the first h 4096 plain call.
timeout -s KILL 150 $NCU --clock-control none -k regex:rms_norm_bwd_staged --launch-skip 8 -c 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
  ./fused_check norm --iters 1 > $OUT/ncu_do.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|Throughput|Issue Slots|Issued Ipc|Eligible|Active Warps|No Eligible|Warp Cycles Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers|Executed Instructions|Stall|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" $OUT/ncu_do.txt | cut -c1-130 | head -60
