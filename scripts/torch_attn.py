"""The PyTorch baseline of our attention benchmark: SDPA (flash backend), causal, 32 heads,
forward and backward timed separately, at the shapes flash_check benches (`--batch micro`: 8
sequences at S=4096, 2 at S=16384, the same tokens per call), head dims 128 and 64. Same FLOP
convention as flash_check: forward 4*B*H*S^2*D/2 (causal), backward 2.5x the forward.

Usage: python3 scripts/torch_attn.py [--batch 1|micro] [--lens 4096,16384] [--head-dims 128,64]
Prints one line per shape: RESULT|torch|sdpa-flash|B<b>|S|D|fwd_ms|fwd_tflops|bwd_ms|bwd_tflops|fwd_bwd_tflops
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


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
    p.add_argument("--batch", default="1", help="a batch size, or 'micro': 32768 tokens per call")
    p.add_argument("--lens", default="4096,16384")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--heads", type=int, default=32)
    a = p.parse_args()
    for d in [int(x) for x in a.head_dims.split(",")]:
        for s in [int(x) for x in a.lens.split(",")]:
            b = max(1, 16384 // s * 2) if a.batch == "micro" else int(a.batch)
            h = a.heads
            q, k, v = [
                torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            ]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                g = torch.randn_like(o)
                fwd = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                # The backward alone: keep one graph and replay its backward.
                bwd = median_seconds(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
            fwd_flops = 4 * b * h * s * s * d / 2
            bwd_flops = 2.5 * fwd_flops
            print(
                f"RESULT|torch|sdpa-flash|B{b}|{s}|{d}|{fwd*1e3:.3f}|{fwd_flops/fwd/1e12:.1f}|"
                f"{bwd*1e3:.3f}|{bwd_flops/bwd/1e12:.1f}|{(fwd_flops+bwd_flops)/(fwd+bwd)/1e12:.1f}",
                flush=True,
            )
            del q, k, v, o, g
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
