#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, kernel_bench, llama2_train), torch_attn.py, torch_micro.py, ptx_dump.py,
# small.txt and tok2048.json (see docs/performance.md, session 8). The offloading half is run_db.sh.
# Call DA (1 x H200): flash backward with fused atomic dQ on the cp.async pipeline (new -atomic-cp tilings):
# checks, then hd 128 / 64 benches at B=1 and torch_micro's batches, against PyTorch's flash in the same call.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
BW=4x32-atomic-cp-vd,8x32-atomic-cp-vd,4x64-atomic-cp-vd,8x64-atomic-cp-vd,4x64-split-cp-vd
stamp check
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|probe|passed|checks" | cut -c1-220 | tail -20
stamp bench hd128 B1
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd128 micro batches
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd64 B1
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $BW --lens 4096 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp torch
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_micro.py 2>&1 | tail -2
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1); echo "ptxas: $P"
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" . 2>&1 | cut -c1-250 | tail -60
ls -la $OUT/kc | head; du -sh $OUT/kc
stamp done
