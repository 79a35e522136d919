#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check and llama2_train, torch_llama.py, small.txt and tok2048.json. The whole log goes to
# $OUT/dv.log; stdout gets the summary.
# Call DV (1 x H200, build of call DU): should the fused atomic dQ become the default backward?
# Call DU: 8x64-atomic-cp-vd 206.7 / 242.2 TFLOP/s at hd 128 S 4k / 16k against the split
# default's 196.2 / 211.7. Here every atomic tiling at hd 128 and 64, then 1b and 7B end to end
# with the split default and with the best atomic tiling, and torch.compile 1b, same call.
# Prediction: the atomic tiling wins at both head dims by 5-15 % in the backward, and 1b / 7B
# steps get 1-3 % faster (attention's backward is about 15-20 % of a step).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dv.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
BW=4x64-split-cp-vd,8x64-atomic-cp-vd,8x32-atomic-cp-vd,4x64-atomic-cp-vd,4x32-atomic-cp-vd
{
stamp bench hd128
timeout -s KILL 150 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd64
timeout -s KILL 100 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp 1b
for t in default 8x64-atomic-cp-vd; do
  E=""; [ $t != default ] && E="SMP_BURN_FLASH_MMA_BWD_TILING=$t"
  env $E timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/bwd=$t /"
done
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1
stamp 7b
for t in default 8x64-atomic-cp-vd; do
  E=""; [ $t != default ] && E="SMP_BURN_FLASH_MMA_BWD_TILING=$t"
  env $E timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/bwd=$t /"
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|^\{" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-100
