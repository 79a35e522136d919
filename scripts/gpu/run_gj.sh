#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# llama2_train, ptx_dump.py, step_median.py, torch_attn.py, small.txt and tok2048.json. The
# whole log goes to $OUT/gj.log.
# Call GJ (1 x H200): the warpgroup-MMA dK/dV kernel with the overlapped schedule (each product
# its own wgmma group: P computed while dP^T runs, dV issued before dS^T, dK running while dQ
# is staged; two cube barriers per block instead of four). Its full check, ptxas, its figures
# beside PyTorch, and the 7B step with it.
# Prediction: checks pass; 245-255 registers, perhaps a few spills; backward +8-15 % over call
# GI's 289 / 333 (B8 4k / B2 16k): 315-330 / 360-380; 7B +2 % over 11,354 (about 11,600), the
# attention backward being about 10 % of the step.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gj.log
PTXAS=$(command -v ptxas || find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp check
timeout -s KILL 240 ./flash_check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --no-bench > /tmp/check.txt 2>&1; echo "flash_check rc=$? ok=$(grep -c '|true$' /tmp/check.txt) false=$(grep -c '|false$' /tmp/check.txt)"
grep -E "FAIL|panic|rror|all checks" /tmp/check.txt | cut -c1-200 | head -10
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$PTXAS" "flash_bwd_dkdv_wgmma" 2>&1 | cut -c1-300
stamp bench
for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp 7b
SMP_BURN_FLASH_MMA_BWD_TILING=8x64-atomic-cp-vd-wgmma timeout -s KILL 170 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-ours /"
stamp done
} > $L 2>&1
python3 step_median.py $L 7b-ours:3:9
grep -E "===|flash_check|passed|FAIL|panic|rror|ptxas|registers|^bench|RESULT|train loss|attention \(" $L | sed 's/\x1b\[[0-9;]*m//g' | grep -v "step +[0-9]" | cut -c1-300 | head -60
