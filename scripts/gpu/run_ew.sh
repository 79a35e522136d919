#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (final
# build) and torch_attn.py. ncu's reports go to $OUT.
# Call EW (1 x H200): call EV found our dK/dV kernel bound by L1/shared memory (L1/TEX
# throughput 80 %, tensor pipe 39 %, B1 H32 S 4096 hd 128) but caught PyTorch's dQ conversion
# kernel instead of its main backward kernel. This takes FlashAttention-2's
# `flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel` and both kernels' shared-memory traffic:
# wavefronts, ldmatrix and shared load/store instructions, bank conflicts.
# Prediction: FA2 at 55-70 % L1/TEX with ~50 % tensor pipe, and fewer shared wavefronts per
# FLOP than ours (its warps split the S tile 2 x 4 where each of ours reads the whole Q block).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0 SMP_BURN_CACHE_DIR=/tmp/kc
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
M="--section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_lsu.sum,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio"
K="^  [a-zA-Z_]|Duration|L1/TEX Cache|L2 Cache|DRAM Through|Compute \(SM\)|Issue Slots|Registers|Achieved Occ|l1tex__|smsp__|sm__pipe"
L=$OUT/ew.log
{
stamp ours
./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096 --iters 1 > /dev/null 2>&1
timeout -s KILL 120 $NCU $M -k regex:dkdv -c 1 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096 --iters 1 > $OUT/ncu_ours.txt 2>&1; echo rc=$?
grep -E "$K" $OUT/ncu_ours.txt | cut -c1-150
stamp PyTorch
timeout -s KILL 150 $NCU $M -k regex:dq_dk_dv --launch-skip 2 -c 1 python3 torch_attn.py --batch 1 --lens 4096 --head-dims 128 > $OUT/ncu_torch.txt 2>&1; echo rc=$?
grep -E "$K" $OUT/ncu_torch.txt | cut -c1-150
stamp done
} > $L 2>&1
cat $L
