#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, kernel_bench, llama2_train), torch_attn.py, ptx_dump.py, small.txt and
# tok2048.json (see docs/performance.md, session 9).
# Call DC (1 x H200): the flash forward with packed probabilities (registers and spills, checks,
# benches against PyTorch's flash in the same call), the reload as one pinned asynchronous copy
# (round trips, bandwidth), and 7B with every layer recomputed, with and without offloading.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
BW=4x64-split-cp-vd
stamp check every forward tiling
timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling all --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -8
stamp bench hd128 B1
timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp,4x2-cp,8x1-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd128 micro batches
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd64 B1
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp,8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp torch
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" . 2>&1 | grep -E "flash_(fwd|bwd)" | cut -c1-220 | head -20
stamp offload round trips and copy bandwidth
timeout -s KILL 90 ./kernel_bench offload 2>&1 | grep -E "offload|FAIL|panic|rror" | cut -c1-300
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
for o in "" "--activation-offloading"; do
  stamp 7b every layer recomputed $o
  timeout -s KILL 130 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 8 --checkpointed-layers 32 $o $F --out-dir /tmp/o7 > $OUT/7b$o.log 2>&1; echo rc=$?
  grep -E "offload|step +[3-8]/|rror|panic" $OUT/7b$o.log | cut -c40-330 | tail -7
done
rm -rf $OUT/kc
stamp done
