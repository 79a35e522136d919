"""Device time and DRAM bandwidth of every profiled launch, in launch order: kernel, grid x
block, time, and the bytes moved when they were collected. Each launch is printed on its own,
so that two shapes sharing a grid are not merged. For memory-bound kernels (norms, RoPE,
SwiGLU, AdamW): their bandwidth against a device-to-device copy's is the figure to watch.

Usage: ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
         PROGRAM ARGS > ncu.csv
       python3 scripts/ncu_durations.py ncu.csv
"""
import csv, sys
from collections import OrderedDict
rows = [r for r in csv.reader(open(sys.argv[1], errors='replace')) if len(r) > 14]
hdr = rows[0]; rows = rows[1:]
ix = {k: hdr.index(k) for k in ("ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name", "Metric Unit", "Metric Value")}
scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3,
         "second": 1.0, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
launches = OrderedDict()
for r in rows:
    d = launches.setdefault(int(r[ix["ID"]]), {"name": r[ix["Kernel Name"]].split("(")[0][:50],
                                              "shape": r[ix["Grid Size"]] + "x" + r[ix["Block Size"]]})
    d[r[ix["Metric Name"]]] = float(r[ix["Metric Value"]].replace(",", "")) * scale.get(r[ix["Metric Unit"]], 1)
for i, d in launches.items():
    t = d.get("gpu__time_duration.sum", 0)
    line = f"NCU|{i}|{d['name']}|{d['shape'].replace(' ', '')}|{t * 1e6:.1f} us"
    if "dram__bytes_read.sum" in d:
        b = d["dram__bytes_read.sum"] + d.get("dram__bytes_write.sum", 0)
        line += f"|{b / 1e6:.1f} MB DRAM|{b / t / 1e9 if t else 0:.0f} GB/s"
    print(line)
