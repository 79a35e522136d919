"""Reads `nsys stats --report cuda_gpu_trace --format csv` output (argv[1]) and prints, for the
kernels whose name matches argv[2] (a regex), how many ran and the median / mean idle time of
the GPU before each (from the previous kernel's end on any stream), in microseconds: whether
the GPU waits between calls."""
import csv, re, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1], errors="replace")))
pat = re.compile(sys.argv[2])
key_start = next(k for k in rows[0] if k.startswith("Start"))
key_dur = next(k for k in rows[0] if k.startswith("Duration"))
key_name = "Name"
ev = sorted((int(r[key_start]), int(r[key_dur]), r[key_name]) for r in rows if r.get(key_start, "").isdigit())
gaps, durs, end = [], [], None
for s, d, n in ev:
    if pat.search(n) and end is not None:
        gaps.append(max(0, s - end) / 1e3)
        durs.append(d / 1e3)
    end = max(end or 0, s + d)
if gaps:
    print(f"{len(gaps)} kernels matching {sys.argv[2]!r}: idle before each median {statistics.median(gaps):.1f} us, mean {statistics.mean(gaps):.1f} us; duration median {statistics.median(durs):.1f} us")
else:
    print("no matching kernels")
