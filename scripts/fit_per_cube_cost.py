"""Splits attention throughput into a steady-state rate and a per-cube cost.

Reads `flash_check` bench lines (or `torch_attn.py` RESULT lines) for one kernel at several
sequence lengths with the same tokens per call (torch_micro's batches: `--batch micro`), and
fits `1/T = a + b/S` by least squares: `1/a` is the rate a cube reaches in its key-block loop,
and `b/S / a` the share of the time that per-cube costs (first copies, diagonal blocks, output
writes, scheduling tails) take at length S. Session 13 used it to compare the flash forward
with PyTorch's (docs/performance.md, call EF).

Usage: python3 fit_per_cube_cost.py [--pass fwd|bwd] FILE...   (or lines on stdin)
"""
import argparse
import re
import sys

BENCH = re.compile(r"S\s+(\d+): fwd\s+[\d.]+ ms\s+([\d.]+) TFLOP/s \| bwd[^|]*?([\d.]+) TFLOP/s")


def points(lines, which):
    out = []
    for line in lines:
        if line.startswith("RESULT|torch|"):
            f = line.strip().split("|")
            out.append((int(f[4]), float(f[7] if which == "fwd" else f[9])))
            continue
        m = BENCH.search(line)
        if m:
            out.append((int(m.group(1)), float(m.group(2) if which == "fwd" else m.group(3))))
    return out


def fit(pts):
    xs = [1.0 / s for s, _ in pts]
    ys = [1.0 / t for _, t in pts]
    n = len(pts)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pass", dest="which", choices=["fwd", "bwd"], default="fwd")
    p.add_argument("files", nargs="*")
    a = p.parse_args()
    lines = []
    for f in a.files or ["-"]:
        lines += (sys.stdin if f == "-" else open(f)).read().splitlines()
    pts = points(lines, a.which)
    if len(pts) < 2 or len({s for s, _ in pts}) < 2:
        sys.exit(f"need bench lines at two or more lengths, found {len(pts)}")
    a_, b_ = fit(pts)
    print(f"steady-state rate 1/a = {1 / a_:.1f} TFLOP/s, b = {b_:.3f}")
    for s, t in sorted(pts):
        print(f"S {s:6d}: measured {t:6.1f}, fitted {1 / (a_ + b_ / s):6.1f}, "
              f"per-cube share {b_ / s / (a_ + b_ / s) * 100:4.1f} %")


if __name__ == "__main__":
    main()
