#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, kernel_bench, llama2_train), torch_attn.py, torch_micro.py, ptx_dump.py,
# small.txt and tok2048.json (see docs/performance.md, session 8). Not yet run.
# Call DA (1 x H200): flash backward with fused atomic dQ on the cp.async pipeline (new -atomic-cp tilings):
# checks, then hd 128 / 64 benches at B=1 and torch_micro's batches, against PyTorch's flash in the same call.
exec 2>&1
stamp() { echo "=== $(date +%T) $*"; }
for l in libnvrtc.so libcublasLt.so libcublas.so libnccl.so; do
  d=$(dirname "$(find / -name "$l*" -not -path '*/proc/*' 2>/dev/null | grep -v stubs | head -1)")
  export LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH
done
G=$PWD/.gpu; cd $G
for b in flash_check kernel_bench llama2_train; do gunzip -c $b.gz > $b; chmod +x $b; done
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
BW=4x32-atomic-cp-vd,8x32-atomic-cp-vd,4x64-atomic-cp-vd,8x64-atomic-cp-vd,4x64-split-cp-vd
stamp check
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|probe|passed|checks" | cut -c1-220 | tail -20
stamp bench hd128 B1
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd128 micro batches
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling $BW --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench hd64 B1
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $BW --lens 4096 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp offload round trips and copy bandwidth
timeout -s KILL 120 ./kernel_bench offload 2>&1 | grep -E "offload|FAIL|panic|rror" | cut -c1-300
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
for o in "" "--activation-offloading"; do
  stamp 7b every layer recomputed $o
  timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 8 --checkpointed-layers 32 $o $F --out-dir /tmp/o7 > $OUT/7b$o.log 2>&1; echo rc=$?
  grep -E "layers recompute|step +[5-8]/|rror|panic" $OUT/7b$o.log | cut -c40-330 | tail -5
done
stamp torch
timeout -s KILL 60 python3 torch_attn.py 2>&1 | tail -4
timeout -s KILL 60 python3 torch_micro.py 2>&1 | tail -2
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1); echo "ptxas: $P"
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" . 2>&1 | cut -c1-250 | tail -60
ls -la $OUT/kc | head; du -sh $OUT/kc
stamp done
