"""One line per `fused_check norm --iters N` run under `ncu --csv --metrics gpu__time_duration.sum`
(argv[1], label argv[2]): the median device time of the RMSNorm backward kernel and of the
column sum after it, for each of the six calls in `bench_norm_bwd`'s order (h 2048, h 2048
adding into a gradient, h 4096, ..., h 5120 adding), and the effective bandwidth of the pair
by `fused_check`'s byte count."""
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors='replace')) if len(r) > 14]
hdr = rows[0]; rows = rows[1:]
ix = {k: hdr.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
norm, colsum = [], []
for r in rows:
    if r[ix["Metric Name"]] != "gpu__time_duration.sum":
        continue
    t = float(r[ix["Metric Value"]].replace(",", "")) * scale[r[ix["Metric Unit"]]]
    name = r[ix["Kernel Name"]]
    if "rms_norm_bwd" in name:
        norm.append(t)
    elif "column_sum" in name:
        colsum.append(t)
configs = [(h, acc) for h in (2048, 4096, 5120) for acc in (False, True)]
if not norm or len(norm) % len(configs):
    print(f"{sys.argv[2]} unexpected launch count: {len(norm)} norm, {len(colsum)} column sum")
    sys.exit()
per = len(norm) // len(configs)
out = []
for k, (h, acc) in enumerate(configs):
    tn = statistics.median(norm[k * per:(k + 1) * per])
    tc = statistics.median(colsum[k * per:(k + 1) * per]) if len(colsum) == len(norm) else 0.0
    act = 4096 * h * 2
    b = (4 if acc else 3) * act + 2 * h * 2 + 4096 * 4
    out.append(f"h{h}{'+' if acc else ''} {tn:.1f}+{tc:.1f}us {b / (tn + tc) / 1e3:.0f}GB/s")
print(f"SWEEP|{sys.argv[2]}|" + " | ".join(out))
