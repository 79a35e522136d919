#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, llama2_train), torch_attn.py, torch_llama.py, ptx_dump.py, small.txt and
# tok2048.json (see docs/performance.md, session 9).
# Call DD (1 x H200): the flash forward with 32-key blocks (-k32 tilings): registers and spills,
# checks, benches against PyTorch's flash in the same call; then 1b end to end (default forward
# tiling and the best -k32 one) against PyTorch eager and torch.compile in the same call.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
BW=4x64-split-cp-vd
FW=8x2-cp,4x2-cp,8x2-cp-k32,4x2-cp-k32,8x1-cp-k32,4x1-cp-k32
stamp check the 32-key tilings
timeout -s KILL 120 ./flash_check --quick --variant mma --mma-tiling 8x2-cp-k32,4x2-cp-k32,8x1-cp-k32,4x1-cp-k32 --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp bench hd128 B1 and micro batches, hd64 B1
timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling $FW --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling $FW --mma-bwd-tiling $BW --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling $FW --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
stamp torch attention
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" . 2>&1 | grep -E "flash_fwd_mma_cp" | cut -c1-220 | head -20
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
for t in "" ${FWD_TILING:-}; do
  stamp 1b forward tiling ${t:-default}
  if [ -n "$t" ]; then export SMP_BURN_FLASH_MMA_TILING=$t; else unset SMP_BURN_FLASH_MMA_TILING; fi
  timeout -s KILL 100 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 > $OUT/1b$t.log 2>&1; echo rc=$?
  grep -E "step +([4-9]|1[0-2])/|rror|panic" $OUT/1b$t.log | cut -c40-260 | tail -9
done
unset SMP_BURN_FLASH_MMA_TILING
stamp torch 1b eager and compile
timeout -s KILL 90 python3 torch_llama.py --preset 1b --steps 10 2>&1 | tail -2
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -2
rm -rf $OUT/kc
stamp done
