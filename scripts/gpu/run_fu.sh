#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# kernel_bench and llama2_train (the dQ convert kernels vectorized), ncu_durations.py,
# torch_attn.py, torch_llama.py, small.txt and tok2048.json. The whole log goes to $OUT/fu.log.
# Call FU (1 x H200): the flash backward with the vectorized dQ convert (one thread per 8
# columns of a row instead of per element): checks, kernel figures beside PyTorch's SDPA, the
# convert kernels' device time under ncu, and the 1b / 7B steps.
# Prediction: convert 786 -> about 200 us at B8 S 4k (805 MB at ~4 TB/s, as the delta kernel
# runs); hd-128 backward +4 %: B8 S 4k 249.5 -> 258-260, B1 S 4k 237.7 -> 246-248, S 16k
# +2 % (the convert is a smaller share there, the dK/dV kernel being quadratic); hd 64 +4 %
# at S 4k; 1b and 7B steps +0.5-1 %.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fu.log
T="--variant mma --mma-tiling 8x2-cp"
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks
timeout -s KILL 150 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
timeout -s KILL 200 ./flash_check $T --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
SMP_BURN_FLASH_BULK_DQ=0 timeout -s KILL 100 ./flash_check $T --quick --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
timeout -s KILL 80 ./flash_check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
stamp ncu
for bulk in 1 0; do
  SMP_BURN_FLASH_BULK_DQ=$bulk timeout -s KILL 100 $NCU --csv -k regex:convert\|dkdv\|delta\|full --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum ./flash_check --no-check $T --mma-bwd-tiling 8x64-atomic-cp-vd-wg --iters 1 --lens 4096 --batch micro > $OUT/ncu_fu_$bulk.csv 2>/dev/null
  python3 ncu_durations.py $OUT/ncu_fu_$bulk.csv | sed "s/^/bulk=$bulk /" | tail -4
done
stamp kernels
for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check $T --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 python3 torch_attn.py --batch $b --lens 4096,16384 --head-dims 128,64 2>&1 | grep -E "RESULT|rror" | cut -c1-200
done
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-ours /"
timeout -s KILL 100 python3 torch_llama.py --preset 1b --steps 10 2>&1 | tail -1 | sed "s/^/1b-eager /"
stamp 7b
timeout -s KILL 110 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-ours /"
timeout -s KILL 100 python3 torch_llama.py --preset 7b --steps 8 2>&1 | tail -1 | sed "s/^/7b-eager /"
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
for tag, lo, hi in (("1b-ours ", 4, 11), ("7b-ours ", 3, 9)):
    v = [int(m.group(2)) for l in L if l.startswith(tag) for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and lo <= int(m.group(1)) <= hi]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "^bench|RESULT|===|passed|FAIL|panic|rror|kernel_bench|eager|NCU|validation loss|MFU" $L | grep -v "step +[1-8]/" | sed 's/(mma kernels)//; s/\/bshd causal//' | cut -c1-230
