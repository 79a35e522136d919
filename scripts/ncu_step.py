"""Whether a training step is GPU-bound, and where its device time goes: from ncu's device time
of every kernel of a 2-step llama2_train run, one step's kernels (after the last AdamW launch of
step 1 up to the last of step 2: AdamW launches come in runs at each step's end), grouped by
kernel family, summed against the step's wall time from an unprofiled run.

Usage: ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \
         llama2_train --device cuda --model 1b --steps 2 ... > ncu.csv
       python3 scripts/ncu_step.py ncu.csv STEP_MS    (STEP_MS: the median step of a plain run)
"""
import csv, re, sys
from collections import OrderedDict
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 10]
# The trainer's own lines share stdout with ncu's CSV: start at the header.
first = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
hdr = rows[first]; rows = [r for r in rows[first + 1:] if r[0].isdigit()]
ix = {k: hdr.index(k) for k in ("ID", "Kernel Name", "Metric Unit", "Metric Value")}
scale = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}
k = OrderedDict()
for r in rows:
    k[int(r[ix["ID"]])] = (r[ix["Kernel Name"]], float(r[ix["Metric Value"]].replace(",", "")) * scale.get(r[ix["Metric Unit"]], 1e-9))
ids = list(k)
ad = [i for i, x in enumerate(ids) if "adamw" in k[x][0]]
# Runs of AdamW launches: the last index of each run ends a step.
ends = [ad[j] for j in range(len(ad)) if j + 1 == len(ad) or ad[j + 1] - ad[j] > 200]
if len(ends) < 2:
    sys.exit(f"found {len(ends)} AdamW runs; need 2")
step = [k[ids[i]] for i in range(ends[-2] + 1, ends[-1] + 1)]
tot = sum(t for _, t in step)
print(f"one step: {len(step)} kernels, {tot * 1e3:.1f} ms of GPU time against a {float(sys.argv[2]):.1f} ms step ({100 * tot * 1e3 / float(sys.argv[2]):.1f} %)")
fam = {}
def family(n):
    n = n.split("(")[0]
    for pat, name in (("gemm|sm90|cutlass|nvjet|xmma", "cuBLAS GEMMs"), ("flash_bwd_dkdv", "flash dK/dV"), ("flash_fwd", "flash forward"),
                      ("flash_dq|flash_delta|full_kernel", "flash delta, dQ zero/convert"), ("adamw|sq_sum", "AdamW, sum of squares")):
        if re.search(pat, n):
            return name
    return re.sub(r"_(f|e|i|o|n|c|m)_[a-z0-9_]+$", "", n)[:48]
for n, t in step:
    f = family(n); c, s = fam.get(f, (0, 0.0)); fam[f] = (c + 1, s + t)
for f, (c, s) in sorted(fam.items(), key=lambda x: -x[1][1])[:16]:
    print(f"  {s * 1e3:7.2f} ms  {c:5d}  {f}")
