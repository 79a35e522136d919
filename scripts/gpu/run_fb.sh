#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (call FA's
# build) and ptx_dump.py. Writes $OUT/fb.log and the SASS of the two hd-128 dK/dV kernels
# (per-warp `flash_bwd_dkdv_mma_cp`, warp-grid `flash_bwd_dkdv_mma_grid`, both with the
# deferred dQ) to $OUT/sass/ (read here by scripts/gpu/sass_mix.py).
# Call FB (1 x H200): call FA's ncu put 20-23 % of our dK/dV kernels' stall samples on long
# scoreboards against 7 % in FA2's kernel. Long scoreboards wait on global or local memory:
# spills at 253 registers, or tensor metadata (strides) reloaded from global memory inside
# the loop. Prediction: ptxas reports spills for the grid kernel and/or the loop holds LDG/LDL
# beyond the cp.async copies.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/fb.log
{
stamp compile
for t in 8x64-atomic-cp-vd 8x64-atomic-cp-vd-wg; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $t --lens 4096 --iters 2 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done
stamp ptx and sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_bwd_dkdv_mma_cp|flash_bwd_dkdv_mma_grid" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  cp $f $OUT/sass/
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > $OUT/sass/$n.sass.gz
done
ls -la $OUT/sass
stamp done
} > $L 2>&1
cat $L | cut -c1-200
