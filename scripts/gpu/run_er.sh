#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check_base and
# flash_check_a (as in call EQ) and ptx_dump.py. The whole log goes to $OUT/er.log.
# Call ER (1 x H200): in call EQ, flash_check_a's forward ran 318 TFLOP/s at B8 S 4k against
# _base's 334, though the forward's code is the same in both, and its PTX spilled (100 B)
# where call EP's did not. Is CubeCL's kernel generation different from one process to the
# next (cubecl-opt's GVN and passes iterate std HashMaps, seeded at random per process)?
# Each binary compiles its kernels three times, into fresh cache dirs; the forward's PTX is
# hashed and fed to ptxas, and each build is benched at B8 S 4k.
# Prediction: the PTX hashes differ between runs of the same binary, and the forward's rate
# follows its spills (318-320 with spills, 333-336 without).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check_base flash_check_a
export CUDA_VISIBLE_DEVICES=0
L=$OUT/er.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
for v in base a; do
  for rep in 1 2 3; do
    stamp "$v compile $rep"
    D=/tmp/kc_${v}_$rep
    SMP_BURN_CACHE_DIR=$D timeout -s KILL 100 ./flash_check_$v $B --lens 4096 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    rm -rf /tmp/ptx_$v$rep
    timeout -s KILL 60 python3 ptx_dump.py $D /tmp/ptx_$v$rep "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp" 2>&1 | grep -E "smem=(139392|177280)" | cut -c1-150
    for f in /tmp/ptx_$v$rep/flash_fwd*.ptx /tmp/ptx_$v$rep/flash_bwd_dkdv*.ptx; do echo "$(basename $f) $(md5sum < $f | cut -c1-12) $(wc -l < $f) lines"; done
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|smem|ptx " $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
