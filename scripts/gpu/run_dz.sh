#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check, kernel_bench and llama2_train, torch_gemm.py, torch_llama.py, small.txt and
# tok2048.json. The whole log goes to $OUT/dz.log; stdout gets the summary.
# Call DZ (1 x H200): (1) fused.rs's three cube reductions now share two helpers
# (`plane_total_to`, `planes_total`): `fused_check check --quick` and its bench must give the
# same results and times. (2) `kernel_bench gemm` now prints the host's issue time per call,
# with the default ordering and with `SMP_BURN_GEMM_ORDER=signal`, to tell whether the 5-13 us
# per call under direct cuBLAS (call DX) is host or GPU. Prediction: issue 10-30 us per call,
# under the 45-160 us device time, so the gap is on the GPU (the crossings). (3) 1b and 7B end
# to end with the deferred dQ (call DY), torch.compile 1b in the same call. Prediction: 7B
# +0.3-0.6 % (attention backward is ~15 % of the step, 2-3 % faster), 1b unchanged (hd 64
# keeps the split dQ).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dz.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp fused
timeout -s KILL 150 ./fused_check check --quick 2>&1
timeout -s KILL 120 ./fused_check bench 2>&1
stamp gemm
timeout -s KILL 150 ./kernel_bench gemm 2>&1
SMP_BURN_GEMM_ORDER=signal timeout -s KILL 150 ./kernel_bench gemm 2>&1 | sed "s/^/signal /"
timeout -s KILL 120 python3 torch_gemm.py 2>&1
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-default /"
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1
stamp 7b
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-default /"
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|===|GB/s|x .* -> |^\{|attention backward" $L | cut -c1-200 | head -80
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-110
