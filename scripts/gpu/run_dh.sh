#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, fused_check, kernel_bench, llama2_train), torch_attn.py, ptx_dump.py,
# small.txt and tok2048.json (see docs/performance.md, session 9).
# Build of commit "flash backward: unmasked copy" (the patch it needed is now on main), as in
# docs/performance.md.
# Call DH (1 x H200):
# 1. the flash backward kernels with an unmasked copy of the block code for blocks that need no
#    causal mask (as call DG did for the forward): checks on both pipelines and both dQ schemes,
#    benches against PyTorch's flash in the same call, 1b losses against call DG's;
# 2. the RMSNorm backward keeping the current row raw across its reduction (`lean`, fewer
#    registers) against the previous kernel (SMP_BURN_NORM_BWD_LEAN=0): checks, A/B timing,
#    ptxas registers of both, ncu occupancy of both;
# 3. `kernel_bench offload` after the HostActivation review mend (e353c81).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check fused_check kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
stamp flash check
timeout -s KILL 100 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd,4x64-split,8x64-split-pf-vd,8x64-atomic-cp-vd,8x64-atomic --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp flash bench
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 40 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
stamp torch attention
timeout -s KILL 60 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 40 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp RMSNorm backward: checks, lean on and off
for l in 1 0; do
  SMP_BURN_NORM_BWD_LEAN=$l timeout -s KILL 120 ./fused_check check --quick > $OUT/fused_check_lean$l.txt 2>&1; echo "lean=$l rc=$?"
  grep -E "FAIL|panic|rror|rms_norm" $OUT/fused_check_lean$l.txt | cut -c1-200 | head -12
done
stamp RMSNorm backward timing A/B
for l in 1 0 1 0; do
  echo "SMP_BURN_NORM_BWD_LEAN=$l"
  SMP_BURN_NORM_BWD_LEAN=$l timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep -E "rms_norm_bwd" | cut -c1-160
done
for t in 256,4 256,6 1024,1; do
  echo "SMP_BURN_NORM_BWD=$t lean"
  SMP_BURN_NORM_BWD=$t timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep -E "rms_norm_bwd" | cut -c1-160
done
stamp ptxas on the norm kernels
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "rms_norm_bwd_v2" 2>&1 | cut -c1-220 | head -30
stamp ncu on the norm backward
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
for l in 1 0; do
  SMP_BURN_NORM_BWD_LEAN=$l timeout -s KILL 90 $NCU --section LaunchStats --section Occupancy --section SpeedOfLight \
    --section WarpStateStats -k regex:rms_norm_bwd_v2 -c 2 ./fused_check norm --iters 1 > $OUT/ncu_norm_lean$l.txt 2>&1; echo "lean=$l rc=$?"
  grep -E "^  [a-z_]+rms|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Memory Throughput|DRAM Throughput|Duration|Warp Cycles Per Issued" $OUT/ncu_norm_lean$l.txt | cut -c1-150 | head -24
done
stamp offload
timeout -s KILL 90 ./kernel_bench offload 2>&1 | grep -E "offload|FAIL|panic|rror" | cut -c1-300
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
stamp 1b
timeout -s KILL 60 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 > $OUT/1b.log 2>&1; echo rc=$?
grep -E "step +([4-9]|1[0-2])/|rror|panic" $OUT/1b.log | cut -c40-200 | tail -9
stamp done
