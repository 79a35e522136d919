"""PyTorch's linear-layer GEMM TFLOP/s at the shapes `kernel_bench gemm` times (bf16, H200).

Usage: python3 scripts/torch_gemm.py   (beside `kernel_bench gemm` on the same machine, for a
ratio; scripts/bench.sh runs both)
"""
import time
import torch
import torch.nn.functional as F

SHAPES = [(4096, 2048, 2048), (4096, 2048, 5632), (4096, 5632, 2048),
          (4096, 4096, 4096), (4096, 4096, 11008), (4096, 11008, 4096), (8192, 8192, 8192)]

def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters

print(f"{'torch shape':<28} {'fwd':>10} {'f+b':>10}")
for m, k, n in SHAPES:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flop = 2 * m * n * k
    fwd = timed(lambda: F.linear(x, w), 20)
    g = torch.ones(m, n, device="cuda", dtype=torch.bfloat16)
    def fb():
        # Seeded as `kernel_bench gemm` seeds its backward: no reduction in the timed loop.
        F.linear(x, w).backward(g)
    both = timed(fb, 10)
    print(f"{f'{m} x {k} -> {n}':<28} {flop / fwd / 1e12:>10.1f} {3 * flop / both / 1e12:>10.1f}")
