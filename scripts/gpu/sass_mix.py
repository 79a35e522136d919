"""Instruction mix of a kernel's hottest loop from `cuobjdump -sass` output (plain or .gz).

Usage: python3 sass_mix.py FILE.sass[.gz] [...]
The hottest loop is taken as the largest span closed by a backward branch (`BRA` to a lower
address): with every inner loop unrolled at compile time, that is the key-block loop of the
flash kernels and the row loop of the RMSNorm backward. Prints the opcode counts (the base
opcode, before the first dot) in that span and in the whole kernel.
"""
import collections
import gzip
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        out = []
        for line in f:
            m = LINE.search(line)
            if m:
                out.append((int(m.group(1), 16), m.group(3), m.group(4)))
        return out


def main():
    for path in sys.argv[1:]:
        ins = parse(path)
        if not ins:
            print(f"{path}: no instructions")
            continue
        best = (0, 0)
        for i, (addr, op, args) in enumerate(ins):
            if op.startswith("BRA"):
                t = re.search(r"0x([0-9a-f]+)", args)
                if t and int(t.group(1), 16) < addr:
                    start = int(t.group(1), 16)
                    j = next(k for k, x in enumerate(ins) if x[0] >= start)
                    if i - j > best[1] - best[0]:
                        best = (j, i)
        loop = ins[best[0] : best[1] + 1]
        total = collections.Counter(op.split(".")[0] for _, op, _ in ins)
        hot = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        mma = hot.get("HMMA", 0)
        print(f"== {path}: {len(ins)} instructions, hottest loop {len(loop)} "
              f"({mma} HMMA, {len(loop) / max(mma, 1):.2f} instructions per HMMA)")
        for op, n in hot.most_common(25):
            print(f"   {op:10} {n:6}  ({100 * n / len(loop):5.1f} %)   kernel {total[op]}")


if __name__ == "__main__":
    main()
