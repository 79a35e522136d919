#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (main at
# 615abd9) and ncu_durations.py. The whole log goes to $OUT/ft.log.
# Call FT (1 x H200): the device time of each kernel of the flash backward (delta, the dQ
# accumulator's zero fill, dK/dV, the dQ convert) and of the forward, hd 128 at B8 S 4k and
# B1 S 4k, hd 64 at B1 S 4k: how much of the backward is outside the dK/dV kernel?
# Prediction: the convert kernel (one thread per element, a 64-bit-free but division-heavy
# index per element) takes 0.4-0.6 ms at B8 S 4k, 4-5 % of the backward; zero fill 0.15 ms,
# delta 0.17 ms.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/ft.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
run() { # tag, flash_check args
  local tag=$1; shift
  stamp "ncu $tag"
  timeout -s KILL 150 $NCU --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum ./flash_check --no-check --variant mma --iters 1 "$@" > $OUT/ncu_$tag.csv 2>$OUT/ncu_$tag.err
  python3 ncu_durations.py $OUT/ncu_$tag.csv | sed "s/^/$tag /" | tail -24
}
run hd128_b8 --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096 --batch micro
run hd128_b1 --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096 --batch 1
run hd64_b1 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --head-dim 64 --lens 4096 --batch 1
stamp bench
./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp done
} > $L 2>&1
cat $L
