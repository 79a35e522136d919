#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, fused_check) and ptx_dump.py (see docs/performance.md, session 9).
# Call DF (1 x H200): the SASS of the default flash kernels at hd 128 (8x2-cp forward,
# 4x64-split-cp-vd backward) and of the RMSNorm backward, for an instruction mix read offline:
# the forward issues about 5 other instructions per MMA (call DB's ncu), and which ones is the
# next question.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
stamp populate the kernel cache
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096 --iters 2 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 60 ./fused_check norm --iters 5 2>&1 | grep -E "rms_norm_bwd_h4096 |panic|rror" | cut -c1-160
stamp ptx and sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
echo "ptxas $P cuobjdump $C"
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp|flash_bwd_dq_mma_cp|rms_norm_bwd" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > $OUT/sass/$n.sass.gz
  gzip -c $f > $OUT/sass/$n.ptx.gz
done
ls -la $OUT/sass
stamp done
