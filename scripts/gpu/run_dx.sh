#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# kernel_bench and torch_gemm.py (copy scripts/torch_gemm.py there). The whole log goes to
# $OUT/dx.log; stdout gets the summary. Prepared in session 11, not yet run.
# Call DX (1 x H200): issue 5's GEMM goal (95 % of cuBLAS called directly), last measured in
# session 2 (call A: 88-95 %, host-inclusive, when the host still waited for the GPU at every
# GEMM). `kernel_bench gemm` (ours through Burn tensors against `cublasGemmEx` on raw buffers
# and Burn's stock matmul) and torch_gemm.py in the same call; then ncu's device time of the
# GEMM kernels, which for ours and the direct call should be the same cuBLAS kernel.
# Prediction: ours / direct 95-100 % at every Llama shape; equal device times under ncu.
source "$(dirname "$0")/common.sh"
gpu_setup kernel_bench
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dx.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp gemm
for i in 1 2; do timeout -s KILL 150 ./kernel_bench gemm 2>&1; done
timeout -s KILL 120 python3 torch_gemm.py 2>&1
stamp ncu
timeout -s KILL 200 $NCU --clock-control none --csv -k regex:"gemm|xmma|cutlass|sm90" \
  --metrics gpu__time_duration.sum ./kernel_bench gemm > $OUT/ncu_dx.csv 2>/dev/null; echo "ncu rc=$?"
python3 ncu_durations.py $OUT/ncu_dx.csv > $OUT/ncu_dx.txt; wc -l $OUT/ncu_dx.txt
stamp done
} > $L 2>&1
grep -E "panic|rror" $L | head -10 | cut -c1-300
grep -vE "^NCU" $L | grep -E "->|torch shape|shape|===|ncu rc" | cut -c1-200
