"""Prints the median and range of the tokens/s of llama2_train's step lines in a call's log
(argv[1]), for each `TAG:FIRST:LAST` of argv[2:]: the lines prefixed `TAG ` whose step number
lies in FIRST..LAST (the warm steps; the first ones compile kernels)."""
import re, statistics, sys

lines = open(sys.argv[1]).read().splitlines()
for spec in sys.argv[2:]:
    tag, lo, hi = spec.rsplit(":", 2)
    lo, hi = int(lo), int(hi)
    v = [
        int(m.group(2))
        for l in lines
        if l.startswith(tag + " ")
        for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)]
        if m and lo <= int(m.group(1)) <= hi
    ]
    rng = (min(v), max(v)) if v else None
    print(tag, "median", statistics.median(v) if v else None, "range", rng, len(v))
