#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this session's final build) and torch_attn.py. ncu's reports go to $OUT.
# Call EV (1 x H200): where the backward's steady state loses to FlashAttention-2's (260
# against 322 TFLOP/s inside the loop, session 13; not the exponential's denormal fix-up, call
# ET). One launch each of our dK/dV kernel (8x64-atomic-cp-vd) and PyTorch's flash backward
# kernel, causal, B1 H32 S 4096 hd 128, under ncu: warp stalls, issue rate, pipes, instruction
# counts. Prediction: ours issues 15-25 % more instructions for the same FLOPs and stalls more
# on shared memory (short scoreboard / MIO throttle); FA2 has higher tensor-pipe utilization.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0 SMP_BURN_CACHE_DIR=/tmp/kc
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
S="--section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis"
K="Registers Per|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Duration|Stall|Warp Cycles Per Issued|Issued Ipc|Issue Slots Busy|Executed Instructions |Executed Ipc|No Eligible|Eligible Warps|Active Warps Per|Pipe|Compute \(SM\) Throughput|Memory Throughput|Bank|L1/TEX Hit|Shared"
L=$OUT/ev.log
{
stamp "ours under ncu ($NCU)"
./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096 --iters 1 > /dev/null 2>&1
timeout -s KILL 150 $NCU $S -k regex:dkdv -c 1 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096 --iters 1 > $OUT/ncu_ours.txt 2>&1; echo rc=$?
grep -E "^  [a-z_]+|$K" $OUT/ncu_ours.txt | cut -c1-150 | head -80
stamp "PyTorch under ncu"
timeout -s KILL 200 $NCU $S -k regex:"flash_bwd|bwd_kernel" --launch-skip 2 -c 1 python3 torch_attn.py --batch 1 --lens 4096 --head-dims 128 > $OUT/ncu_torch.txt 2>&1; echo rc=$?
grep -E "^  [a-zA-Z_]+|$K" $OUT/ncu_torch.txt | cut -c1-150 | head -80
stamp done
} > $L 2>&1
cat $L
