#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, fused_check, kernel_bench, llama2_train), ptx_dump.py, small.txt and
# tok2048.json (see docs/performance.md, session 9).
# Call DB (1 x H200): why the flash kernels run below PyTorch's (ncu launch stats, occupancy,
# warp stalls; ptxas registers and spills), the RMSNorm backward with 1, 2 and 4 rows per
# iteration (checks, then a sweep), activation offloading on CUDA (round trips, copy bandwidth),
# and 7B with every layer recomputed, with and without offloading.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check fused_check kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
stamp "flash kernels under ncu ($NCU)"
timeout -s KILL 150 $NCU --section LaunchStats --section Occupancy --section SpeedOfLight \
  --section WarpStateStats --section ComputeWorkloadAnalysis -k regex:flash -c 4 \
  ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd \
  --lens 4096 --iters 1 > $OUT/ncu_flash.txt 2>&1; echo rc=$?
grep -E "^  [a-z_]+flash|Registers Per|Shared Memory Config|Dynamic Shared|Static Shared|Achieved Occupancy|Theoretical Occupancy|Block Limit|Compute \(SM\) Throughput|Memory Throughput|Duration|Stall|Warp Cycles Per Issued|Issued Ipc|Local" $OUT/ncu_flash.txt | cut -c1-150 | head -90
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" . 2>&1 | grep -iE "flash|rms|spill|regist" | cut -c1-220 | head -40
stamp RMSNorm backward depth checks
for d in 2 4; do
  SMP_BURN_NORM_BWD=512,2,$d timeout -s KILL 120 ./fused_check check --quick 2>&1 | grep -E "FAIL|panic|rror|all .*pass|passed" | cut -c1-200 | tail -4
done
stamp RMSNorm backward sweep threads,cubes_per_sm,depth
for t in 512,2,1 512,2,2 512,2,4 512,4,4 256,4,2 256,4,4 256,8,4; do
  echo "SMP_BURN_NORM_BWD=$t"
  SMP_BURN_NORM_BWD=$t timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep -E "rms_norm_bwd" | cut -c1-160
done
stamp offload round trips and copy bandwidth
timeout -s KILL 90 ./kernel_bench offload 2>&1 | grep -E "offload|FAIL|panic|rror" | cut -c1-300
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
for o in "" "--activation-offloading"; do
  stamp 7b every layer recomputed $o
  timeout -s KILL 130 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 8 --checkpointed-layers 32 $o $F --out-dir /tmp/o7 > $OUT/7b$o.log 2>&1; echo rc=$?
  grep -E "layers recompute|offload|step +[3-8]/|rror|panic" $OUT/7b$o.log | cut -c40-330 | tail -7
done
stamp done
