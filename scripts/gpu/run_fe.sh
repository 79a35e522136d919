#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the
# warp-grid kernel adding dQ with 16-byte atomics, 8x64-atomic-cp-vd the hd-64 default) and
# flash_check_pairs (call FD's build: 8-byte pair atomics). The whole log goes to $OUT/fe.log,
# ncu's per-instruction source page of the new grid kernel to $OUT/grid4_source.csv.gz.
# Call FE (1 x H200): call FD's source-level ncu put 11 % of the grid kernel's stall samples on
# long scoreboards right after the dQ pair atomics (registers not yet released by the REDGs).
# Quads halve the atomics for 16 shuffles per lane and block. Prediction: checks pass; those
# stalls halve; backward +2-4 % at hd 128.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_pairs
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fe.log
W="8x64-atomic-cp-vd-wg"
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 100 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W,8x32-atomic-cp-vd-wg,4x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 60 ./flash_check --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $W,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  for v in flash_check_pairs flash_check; do
    stamp "bench $rep $v"
    for b in 1 micro; do
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 90 ./$v --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
stamp ncu source
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 120 $NCU --section SpeedOfLight --section SourceCounters --section WarpStateStats -k regex:dkdv -c 1 -o /tmp/grid4 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W --lens 4096 --iters 1 > /dev/null 2>&1; echo rc=$?
$NCU -i /tmp/grid4.ncu-rep --page details 2>&1 | grep -E "Duration|L1/TEX Cache|Registers" | head -5
$NCU -i /tmp/grid4.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/grid4_source.csv.gz
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror|rc=|Duration|L1/TEX|Registers" $L | sed 's/(mma kernels)//; s/bench mma\[8x2-cp,//; s/\/bshd causal//' | cut -c1-200
