#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (call EH's build) and ptx_dump.py. Writes $OUT/el.log and the SASS of the
# default hd-128 flash kernels to $OUT/sass/ (read here by scripts/gpu/sass_mix.py).
# Call EL (1 x H200): where the instructions of the default hd-128 kernels go now (call DF
# read them in session 9: forward 1,510 per warp and block, 256 HMMA). Prediction: the
# forward's loop lost its 128 rescale FMULs from the common path (they sit behind a branch);
# the dK/dV loop with the deferred fused dQ shows its exponent's fix-up (FSETP and predicated
# FMULs around each MUFU) as the largest non-MMA share.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/el.log
{
stamp compile
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096 --iters 2 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
stamp ptx and sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > $OUT/sass/$n.sass.gz
done
ls -la $OUT/sass
stamp done
} > $L 2>&1
cat $L | cut -c1-200
