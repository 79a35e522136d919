#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, llama2_train), torch_attn.py, small.txt and tok2048.json (see
# docs/performance.md, session 9).
# Needs scripts/gpu/flash_bwd_mask_split.patch applied first (`git apply`; not on main: no device
# time was left to check it in session 9), then the build of docs/performance.md.
# Call DH (1 x H200): the flash backward kernels with an unmasked copy of the block code for
# blocks that need no causal mask (as call DG did for the forward): checks on both pipelines and
# both dQ schemes, benches against PyTorch's flash in the same call, 1b losses against call DG's.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
stamp check
timeout -s KILL 100 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd,4x64-split,8x64-split-pf-vd,8x64-atomic-cp-vd,8x64-atomic --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp bench
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 40 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
stamp torch attention
timeout -s KILL 60 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 40 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
stamp 1b
timeout -s KILL 60 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 > $OUT/1b.log 2>&1; echo rc=$?
grep -E "step +([4-9]|1[0-2])/|rror|panic" $OUT/1b.log | cut -c40-200 | tail -9
stamp done
