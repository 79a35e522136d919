#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, llama2_train), torch_attn.py, torch_llama.py, ptx_dump.py, small.txt and
# tok2048.json (see docs/performance.md, session 9).
# Call DG (1 x H200): the flash forward with an unmasked copy of the block code for blocks no
# row of the cube reaches past: checks, benches against PyTorch's flash in the same call, the
# forward's SASS, then 1b end to end against torch.compile in the same call.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
BW=4x64-split-cp-vd
stamp check every forward tiling
timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling all --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp bench
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-140
stamp torch attention
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp forward sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_fwd_mma_cp" 2>&1 | grep -E "139392|smem=104576" | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  case "$(grep -c . $f)" in 0) continue;; esac
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > /tmp/$n.sass.gz
done
ls -S /tmp/*.sass.gz | head -2 | xargs -I{} cp {} $OUT/sass/
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
stamp 1b
timeout -s KILL 100 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 > $OUT/1b.log 2>&1; echo rc=$?
grep -E "step +([4-9]|1[0-2])/|rror|panic" $OUT/1b.log | cut -c40-260 | tail -9
stamp torch 1b compile
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1
stamp done
