#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check and kernel_bench, torch_attn.py and ncu_durations.py. The whole log goes to
# $OUT/dy.log; stdout gets the summary.
# Call DY (1 x H200): (1) the fused atomic dQ deferred by one block (`SMP_BURN_FLASH_DEFER_DQ`,
# dS^T double-buffered, read after the next block's barrier): one cube barrier per block in the
# dK/dV kernel instead of two. Checks of the atomic tilings with it, then benches with it on
# and off, same call, against PyTorch's flash. Prediction: hd 128 backward +2-5 % (S 16k
# 241 -> 246-253, S 4k 203 -> 207-213). (2) Call DX found `kernel_bench gemm`'s forward +
# backward column at 199-545 TFLOP/s where its three GEMMs take ~790 TFLOP/s of device time:
# `kernel_bench gemm-fb` splits one shape's time into host phases; ncu lists every kernel.
# Prediction: `sum` / its backward or a host wait in `backward()`, not the GEMMs.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dy.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
AT=8x64-atomic-cp-vd,4x64-atomic-cp-vd,8x32-atomic-cp-vd
{
stamp checks
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $AT --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -8
timeout -s KILL 100 ./flash_check --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
stamp bench
for D in 1 0 1; do
  SMP_BURN_FLASH_DEFER_DQ=$D timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/defer=$D /"
  SMP_BURN_FLASH_DEFER_DQ=$D timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/defer=$D /"
done
for D in 1 0; do
  SMP_BURN_FLASH_DEFER_DQ=$D timeout -s KILL 100 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd,4x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/defer=$D /"
done
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp gemm-fb
timeout -s KILL 60 ./kernel_bench gemm-fb 2>&1
timeout -s KILL 120 $NCU --clock-control none --csv --metrics gpu__time_duration.sum ./kernel_bench gemm-fb > $OUT/ncu_dy.csv 2>/dev/null; echo "ncu rc=$?"
python3 ncu_durations.py $OUT/ncu_dy.csv > $OUT/ncu_dy.txt; wc -l $OUT/ncu_dy.txt
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|^defer|RESULT|===|gemm-fb|ncu rc" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-220
