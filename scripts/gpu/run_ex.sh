#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (call
# EU's final build, the baseline) and flash_check_stats (the cp.async dK/dV kernel reads lse and
# delta as one packed pair per query: `flash_pack_stats`, 8-byte cp.async, one 8-byte shared
# load where two 4-byte ones were). The whole log goes to $OUT/ex.log.
# Call EX (1 x H200): call EW found the dK/dV kernel bound by shared-memory wavefronts (L1/TEX
# 80 %), with 11.0 M scalar shared loads against FA2's 1.7 M, about 8.6 M of them lse and
# delta. Prediction: checks pass; shared loads 11.0 M -> ~6.7 M, wavefronts -2 %; backward
# +1-2 % at hd 128.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_stats
export CUDA_VISIBLE_DEVICES=0
L=$OUT/ex.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check_stats timeout -s KILL 150 ./flash_check_stats --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,8x64-atomic,4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check_stats timeout -s KILL 60 ./flash_check_stats --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
for rep in 1 2; do
  for v in flash_check flash_check_stats; do
    stamp "$v $rep"
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp ncu
for v in flash_check flash_check_stats; do
SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 90 $NCU --section SpeedOfLight --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active -k regex:dkdv -c 1 ./$v $B --lens 4096 --iters 1 2>&1 | grep -E "^  [a-z_]+|Duration|L1/TEX Cache|l1tex__|smsp__|sm__pipe" | cut -c1-150
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|Duration|L1/TEX|l1tex|smsp|sm__pipe|^  [a-z]" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
