#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this build) and flash_check_eh (call EH's build, the baseline), ptx_dump.py and
# sass_mix.py. The whole log goes to $OUT/em.log; stdout gets the summary.
# Call EM (1 x H200): the `cp.async` dK/dV kernel walks its (head, query block) iterations with
# counters instead of `it / n_blk` and `it % n_blk` (call EL's SASS: three integer divisions
# by a runtime divisor per block, about 45 of ~1,150 instructions on a block's path).
# Prediction: checks pass (GQA groups of 2 exercise the head counter); backward +2-4 % at
# every shape; the default dK/dV kernel stays at or under 252 registers without spills.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_eh
export CUDA_VISIBLE_DEVICES=0
L=$OUT/em.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd,4x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  stamp "baseline (call EH's build) $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_eh timeout -s KILL 100 ./flash_check_eh $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  SMP_BURN_CACHE_DIR=/tmp/kc_eh timeout -s KILL 100 ./flash_check_eh $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  stamp "counters $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 100 ./flash_check $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 100 ./flash_check $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp hd64
SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp ptxas-sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
rm -rf /tmp/ptx; timeout -s KILL 60 python3 ptx_dump.py /tmp/kc_em /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin > /tmp/$n.sass
  echo "$n: $(python3 sass_mix.py /tmp/$n.sass | head -1)"
done
# Only the default hd-128 kernels come back (by their shared memory sizes in the ptxas lines).
for n in $(grep -E "smem=(177280|139392):" $L | sed 's/.*\[\(.*\)\.ptx\]/\1/'); do
  gzip -c /tmp/$n.sass > $OUT/sass/$n.sass.gz
done
ls $OUT/sass
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|registers|passed|checks|==|^flash" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
