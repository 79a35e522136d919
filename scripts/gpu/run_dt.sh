#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check, flash_check and llama2_train, norm_sweep.py, ncu_durations.py, torch_llama.py,
# small.txt and tok2048.json. The whole log goes to $OUT/dt.log; stdout gets the summary.
# Call DT (1 x H200), the session's build: the staged RMSNorm backward at its new default (one
# row per stage, 2-4 cubes per SM by bytes in flight) against the shapes calls DQ-DS measured;
# the memory-bound kernels' device times; where the flash backward kernels stall (ncu); 1b
# against torch.compile in the same call; 7B.
# Prediction: the default matches the best measured shape at each width (h 4096 plain about
# 39.5 us with the column sum, adding about 44 us); 1b unchanged within noise (45-47k tok/s).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dt.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 150 ./fused_check check --quick 2>&1
stamp norm sweep
for s in default 128_8_4 128_16_3 128_8_2; do
  SMP_BURN_NORM_BWD_STAGED=${s//_/,} timeout -s KILL 100 $NCU --clock-control none --csv \
    -k regex:"rms_norm_bwd|column_sum" --metrics gpu__time_duration.sum ./fused_check norm --iters 2 \
    > $OUT/ncu_dt_$s.csv 2>/dev/null
  python3 norm_sweep.py $OUT/ncu_dt_$s.csv "staged=$s"
done
stamp fused bench
timeout -s KILL 120 ./fused_check bench 2>&1
timeout -s KILL 120 $NCU --clock-control none --csv -k regex:"rms_norm|swiglu|rope|column_sum|copy_kernel" \
  --metrics gpu__time_duration.sum ./fused_check bench --iters 1 > $OUT/ncu_dt_bench.csv 2>/dev/null; echo "ncu rc=$?"
python3 ncu_durations.py $OUT/ncu_dt_bench.csv
stamp flash backward stalls
timeout -s KILL 150 $NCU --clock-control none -k regex:"flash_bwd" -c 2 \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
  ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 16384 --iters 1 \
  > $OUT/ncu_dt_flash.txt 2>&1; echo "ncu rc=$?"
grep -E "flash_bwd|stalled|hmma|lsu|bank|issue_active|warps_active|duration" $OUT/ncu_dt_flash.txt | awk '$NF+0 > 0.05 || /flash_bwd/' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | cut -c1-120
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -3
stamp 7b
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 10 $F --out-dir /tmp/o7 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "check |SWEEP|===|ncu rc|^BW\||^NCU" $L | cut -c1-330
grep -A 40 "=== .* flash backward stalls" $L | grep -v "^===" | head -40
grep -E "step +[0-9]+/|tok/s|val|^\{" $L | grep -v "step +[1-3]/" | sed 's/.*INFO.[^ ]* //' | cut -c1-150 | tail -24
