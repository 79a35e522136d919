"""The PyTorch baseline of `collective_bench`: torch.distributed (NCCL) all-reduce, all-gather,
reduce-scatter and broadcast of bf16 buffers from 1 MiB to 1 GiB, printed as collective_bench
prints its own (`RESULT|op|bytes|torch|ms|busbw_GBps`, rank 0).

Conventions shared with collective_bench: `bytes` is the full buffer (the all-reduce buffer, the
gathered output, the reduce-scatter input); bus bandwidth as nccl-tests (all-reduce x 2(n-1)/n,
all-gather and reduce-scatter x (n-1)/n, broadcast x 1). Each figure is the median of 20
iterations, each timed with CUDA events and synchronized (collective_bench's are the mean of
back-to-back iterations, which flatters small sizes a little; from 64 MiB the GPU time
dominates).

Usage: torchrun --nproc-per-node 2 scripts/torch_coll.py [--max-mib 1024]
"""
import argparse
import os

import torch
import torch.distributed as dist


def median_seconds(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-mib", type=int, default=1024)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mib = 1
    while mib <= a.max_mib:
        n = mib * 2**20 // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        shard = torch.randn(n // world, device="cuda", dtype=torch.bfloat16)
        full = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world),
            "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (world - 1) / world),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (world - 1) / world),
            "broadcast": (lambda: dist.broadcast(x, 0), 1.0),
        }
        for op, (fn, factor) in ops.items():
            t = median_seconds(fn)
            if rank == 0:
                print(f"RESULT|{op}|{n * 2}|torch|{t * 1e3:.4f}|{n * 2 / t / 1e9 * factor:.1f}",
                      flush=True)
        del x, shard, full
        mib *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
