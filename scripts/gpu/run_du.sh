#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check and llama2_train, ptx_dump.py, sass_mix.py, torch_attn.py, torch_llama.py,
# small.txt and tok2048.json. The whole log goes to $OUT/du.log; stdout gets the summary.
# Call DU (1 x H200): ldmatrix addresses as one loop-invariant value plus a constant
# (`ldsm_x4(base, comptime offset)`) instead of a runtime `(base + offset) / nv` per load. Call
# DF counted about 500 integer instructions (LEA, IMAD, SHF, VIADD) per block pair in the dK/dV
# kernel's loop against 256 HMMA; call DT found both backward kernels latency-bound (short
# scoreboard and fixed-latency waits). Checks of every Mma tiling; hd 128 / 64 benches against
# PyTorch's flash in the same call; the SASS mix of the default kernels; 1b end to end.
# Prediction: integer instructions per dK/dV block 500 -> under 200; backward +5-10 %, forward
# +0-3 %.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/du.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp,8x1 --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd,8x32-split,8x64-atomic --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -8
stamp bench
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp|flash_bwd_dq_mma_cp" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > $OUT/sass/$n.sass.gz
  python3 sass_mix.py $OUT/sass/$n.sass.gz 2>&1 | head -6 | sed "s/^/MIX $n: /"
done
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|^bench|RESULT|===|registers|^MIX" $L | cut -c1-300
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/.*INFO.[^ ]* //' | cut -c1-110 | tail -10
