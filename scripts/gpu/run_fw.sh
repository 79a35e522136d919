#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding kernel_bench (call
# FV's build) and nsys_gaps.py. The whole log goes to $OUT/fw.log.
# Call FW (1 x H200): why single GEMMs in a loop ran 2-9 % slower on Burn's stream than with the
# event crossings in call FV (while steps ran 0.9 % faster): nsys's GPU trace of
# `kernel_bench gemm` with each ordering, the GPU's idle time before each cuBLAS kernel.
# Prediction: with the crossings the GPU idles 5-7 us before each GEMM, on Burn's stream 10-12
# us (as the per-call gaps of call FV), so something on the server thread serializes each call
# with the previous GEMM; the trace's CUDA API rows show what.
source "$(dirname "$0")/common.sh"
gpu_setup kernel_bench
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fw.log
NSYS=$(command -v nsys || find / -name nsys -type f -perm -u+x -not -path "*/proc/*" 2>/dev/null | head -1)
{
echo "nsys: $NSYS"
for o in stream auto; do
  stamp "nsys $o"
  SMP_BURN_GEMM_ORDER=$o timeout -s KILL 150 $NSYS profile -t cuda --cuda-event-trace=false -o /tmp/g_$o -f true ./kernel_bench gemm 2>&1 | grep -E "^(shape|4096|8192)" | sed "s/^/$o /"
  timeout -s KILL 60 $NSYS stats --report cuda_gpu_trace --format csv -o /tmp/t_$o /tmp/g_$o.nsys-rep > /dev/null 2>&1
  f=$(ls /tmp/t_$o*.csv | head -1)
  python3 nsys_gaps.py $f "gemm|sm90|cutlass|xmma|nvjet" | sed "s/^/$o /"
  timeout -s KILL 60 $NSYS stats --report cuda_api_sum --format csv -o /tmp/a_$o /tmp/g_$o.nsys-rep > /dev/null 2>&1
  head -14 $(ls /tmp/a_$o*.csv | head -1) | cut -d, -f1-9 | sed "s/^/$o api /"
  cp $f $OUT/gpu_trace_$o.csv 2>/dev/null
done
stamp done
} > $L 2>&1
cat $L
