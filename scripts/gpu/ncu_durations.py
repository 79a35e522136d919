"""Summarizes `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum`
output (argv[1]): per kernel name and launch shape, the launches, the median device time, the DRAM
bytes and the bandwidth they give. Kernels appear in launch order."""
import csv, sys, statistics
from collections import OrderedDict
rows = [r for r in csv.reader(open(sys.argv[1], errors='replace')) if len(r) > 14]
hdr = rows[0]; rows = rows[1:]
ix = {k: hdr.index(k) for k in ("ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name", "Metric Unit", "Metric Value")}
scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
         "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
launches = OrderedDict()
for r in rows:
    key = r[ix["ID"]]
    d = launches.setdefault(key, {"name": r[ix["Kernel Name"]].split("(")[0][:60], "shape": r[ix["Grid Size"]] + "x" + r[ix["Block Size"]]})
    v = float(r[ix["Metric Value"]].replace(",", "")) * scale.get(r[ix["Metric Unit"]], 1)
    d[r[ix["Metric Name"]]] = v
groups = OrderedDict()
for d in launches.values():
    groups.setdefault((d["name"], d["shape"]), []).append(d)
for (name, shape), ds in groups.items():
    t = statistics.median(x.get("gpu__time_duration.sum", 0) for x in ds)
    b = statistics.median(x.get("dram__bytes_read.sum", 0) + x.get("dram__bytes_write.sum", 0) for x in ds)
    print(f"NCU|{name}|{shape}|n={len(ds)}|{t*1e6:.1f} us|{b/1e6:.1f} MB|{b/t/1e9 if t else 0:.0f} GB/s")
