"""Reads an nsys SQLite export (argv[1]) of a training run and prints, per window between the
trainer's step boundaries (argv[2]: the number of steps; the windows are found as the gaps of
more than 20 ms in which the GPU idles while the host logs), how long the GPU ran kernels or
copies against the wall time: whether the step is GPU-bound. Also the kernel count and the
ten kernels with the most time."""
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
    sys.exit(f"no kernel table in {sys.argv[1]}; tables: {sorted(tables)[:40]}")
names = dict(con.execute("select id, value from StringIds")) if "StringIds" in tables else {}
ev = [(s, e, names.get(n, str(n))) for s, e, n in con.execute(
    "select start, end, shortName from CUPTI_ACTIVITY_KIND_KERNEL")]
try:
    ev += [(s, e, "memcpy") for s, e in con.execute("select start, end from CUPTI_ACTIVITY_KIND_MEMCPY")]
    ev += [(s, e, "memset") for s, e in con.execute("select start, end from CUPTI_ACTIVITY_KIND_MEMSET")]
except sqlite3.OperationalError:
    pass
ev.sort()
# Busy intervals (union over streams).
busy, cur = [], None
for s, e, _ in ev:
    if cur and s <= cur[1]:
        cur[1] = max(cur[1], e)
    else:
        if cur:
            busy.append(tuple(cur))
        cur = [s, e]
busy.append(tuple(cur))
# Steps: split at idle gaps over 20 ms (the trainer's sync and logging between steps is short,
# so use the largest gaps instead if there are few).
gaps = sorted(((busy[i + 1][0] - busy[i][1], i) for i in range(len(busy) - 1)), reverse=True)
steps = int(sys.argv[2])
cuts = sorted(i for _, i in gaps[: steps - 1])
bounds, start = [], 0
for c in cuts:
    bounds.append((start, c)); start = c + 1
bounds.append((start, len(busy) - 1))
for k, (a, b) in enumerate(bounds):
    t0, t1 = busy[a][0], busy[b][1]
    work = sum(e - s for s, e in busy[a:b + 1])
    n = sum(1 for s, e, _ in ev if t0 <= s <= t1)
    print(f"window {k + 1}: wall {(t1 - t0) / 1e6:.1f} ms, GPU busy {work / 1e6:.1f} ms ({100 * work / max(1, t1 - t0):.1f} %), {n} kernels/copies")
tot = {}
for s, e, n in ev:
    tot[n] = tot.get(n, 0) + e - s
for n, t in sorted(tot.items(), key=lambda x: -x[1])[:12]:
    print(f"  {t / 1e6:9.1f} ms  {n[:90]}")
a = bounds[1][0] if len(bounds) > 1 else 0
t0, t1 = busy[a][0], busy[-1][1]
work = sum(e - s for s, e in busy[a:])
print(f"windows 2-{len(bounds)}: wall {(t1 - t0) / 1e6:.1f} ms, GPU busy {work / 1e6:.1f} ms ({100 * work / max(1, t1 - t0):.1f} %)")
gl = sorted((busy[i + 1][0] - busy[i][1] for i in range(a, len(busy) - 1)), reverse=True)
print("largest idle gaps (us):", [round(g / 1e3) for g in gl[:12]], "idle gaps over 50 us:", sum(1 for g in gl if g > 50e3), "total idle in gaps under 50 us (ms):", round(sum(g for g in gl if g <= 50e3) / 1e6, 2))
