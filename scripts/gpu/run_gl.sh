#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# kernel_bench, llama2_train, step_median.py, torch_attn.py, torch_llama.py, small.txt and
# tok2048.json. The whole log goes to $OUT/gl.log.
# Call GL (1 x H200): the build with the warpgroup backward as the hd-128 default and the
# forward's two schedules in one loop (review item D1: the lockstep schedule now issues its
# scores before the prefetch). Every kernel's check, both forward schedules' full check, the
# defaults beside PyTorch's SDPA, the 7B step beside PyTorch eager, and the 1b step.
# Prediction: checks pass; forward as call GK (430 / 452); backward as call GK (333 / 378);
# 7B 11.6-11.7k (+2-3 % over call GG's 11,354; eager 8.2k); 1b unchanged (about 49.6k, its
# hd-64 kernels untouched).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gl.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 150 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wgd,8x1-wg --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --no-bench > /tmp/fc.txt 2>&1; echo "flash_check rc=$? ok=$(grep -c '|true$' /tmp/fc.txt) false=$(grep -c '|false$' /tmp/fc.txt)"; grep -E "FAIL|panic|rror|all checks" /tmp/fc.txt | cut -c1-200 | head -5
stamp kernels
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd,8x1-wg --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128,64 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp 7b
timeout -s KILL 170 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-ours /"
timeout -s KILL 130 python3 torch_llama.py --preset 7b --steps 8 2>&1 | tail -1 | sed "s/^/7b-eager /"
stamp 1b
timeout -s KILL 90 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-ours /"
stamp done
} > $L 2>&1
python3 step_median.py $L 7b-ours:3:9 1b-ours:4:11
grep -E "===|passed|FAIL|panic|rror|kernel_bench|flash_check|^bench|RESULT|eager|train loss|attention \(" $L | sed 's/\x1b\[[0-9;]*m//g' | grep -v "step +[0-9]" | cut -c1-220 | head -60
