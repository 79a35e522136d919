"""Turns the logs of one `scripts/bench.sh` run into a markdown table (item, ours, baseline, ratio)
ready to paste into docs/benchmarks.md.

Usage: python3 scripts/bench_table.py LOGS_DIR [--window 1b=4:11] [--window 7b=3:9] [--out FILE]

LOGS_DIR holds the files bench.sh writes, named by what ran (BUILD is `new` or `base`):
  llama-MODEL-BUILD.log / .metrics.jsonl   llama2_train's log and its metrics.jsonl (MODEL 1b,
                                           7b, or 7b32k-rows / 7b32k-docs for packed documents)
  torch-MODEL-eager.log / torch-MODEL-compile.log   scripts/torch_llama.py (last line: JSON)
  attn-BUILD-hdD.log                       `RESULT|bench|label|B<b>|S|fwd_ms|fwd_tflops|bwd_ms|bwd_tflops|...`
  attn-torch.log                           scripts/torch_attn.py (`RESULT|torch|...|B<b>|S|D|...`)
  gemm-BUILD.log, gemm-torch.log           `kernel_bench gemm`, scripts/torch_gemm.py
  gpt-BUILD-cube.log / gpt-BUILD-fusion.log   gpt_train (last line: JSON)
  check-BUILD.log                          `kernel_bench check`
  coll-BUILD.log, coll-torch.log           collective_bench, scripts/torch_coll.py (`RESULT|op|bytes|variant|ms|busbw`)
  runs.tsv, gpu.txt, builds.txt, command.txt   what ran, on which GPU, with which binaries

Tokens/s of a Llama run is the median over the steps of its window (`MODEL=FIRST:LAST`; the first
steps compile kernels, so they are left out). A row whose baseline did not run keeps its figure
and leaves the baseline empty. Only the Python standard library is used.
"""
import argparse
import json
import os
import re
import statistics
import sys

STEP_LINE = re.compile(r"step +(\d+)/\d+: loss ([\d.]+).*?\| (\d+) tok/s")
MFU = re.compile(r"MFU ([\d.]+)%")
MEM = re.compile(r"mem ([\d.]+) GiB")
GEMM = re.compile(r"^\s*(\d+) x (\d+) -> (\d+)((?:\s+[\d.]+%?)+)")


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def last_json(text):
    """The last line of `text` that parses as a JSON object."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        i = line.find("{")
        if i < 0:
            continue
        try:
            v = json.loads(line[i:])
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


def llama_run(logs, model, build, window):
    """Median tokens/s, MFU (percent), peak GiB and last loss of one llama2_train run."""
    first, last = window
    rows = []
    metrics = read(os.path.join(logs, f"llama-{model}-{build}.metrics.jsonl"))
    for line in (metrics or "").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        mem = m.get("peak_mem_bytes")
        rows.append((m.get("step"), m.get("tokens_per_sec"), m.get("mfu"),
                     mem / 2**30 if mem else None, m.get("loss")))
    if not rows:
        # No metrics file (the run died early, or an older build): the log's step lines.
        for line in (read(os.path.join(logs, f"llama-{model}-{build}.log")) or "").splitlines():
            s = STEP_LINE.search(line)
            if not s:
                continue
            mfu, mem = MFU.search(line), MEM.search(line)
            rows.append((int(s.group(1)), float(s.group(3)),
                         float(mfu.group(1)) / 100 if mfu else None,
                         float(mem.group(1)) if mem else None, float(s.group(2))))
    warm = [r for r in rows if r[0] is not None and first <= r[0] <= last and r[1]]
    if not warm:
        return None
    mfus = [r[2] for r in warm if r[2] is not None and r[2] == r[2]]
    mems = [r[3] for r in rows if r[3] is not None]
    return {
        "tps": statistics.median(r[1] for r in warm),
        "lo": min(r[1] for r in warm),
        "hi": max(r[1] for r in warm),
        "n": len(warm),
        "mfu": 100 * statistics.median(mfus) if mfus else None,
        "mem": max(mems) if mems else None,
        "loss": rows[-1][4],
    }


def attention(logs, build):
    """{(hd, batch, S, pass): [(kernel, TFLOP/s), ...]} from the RESULT|bench lines of our runs
    (`RESULT|bench|fwd-NAME|B<b>|S|ms|tflops`, one per kernel and pass)."""
    out = {}
    for name in sorted(os.listdir(logs)):
        m = re.fullmatch(rf"attn-{build}-hd(\d+)(-.*)?\.log", name)
        if not m:
            continue
        for line in read(os.path.join(logs, name)).splitlines():
            f = line.strip().split("|")
            if len(f) == 7 and f[0] == "RESULT" and f[1] == "bench" and f[3].startswith("B"):
                what, _, kernel = f[2].partition("-")
                pas = {"fwd": "forward", "bwd": "backward"}.get(what)
                if pas:
                    key = (int(m.group(1)), int(f[3][1:]), int(f[4]), pas)
                    out.setdefault(key, []).append((kernel, float(f[6])))
    return out


def torch_attention(logs):
    """{(hd, batch, S, pass): TFLOP/s} from scripts/torch_attn.py's RESULT lines."""
    out = {}
    for line in (read(os.path.join(logs, "attn-torch.log")) or "").splitlines():
        f = line.strip().split("|")
        if len(f) >= 10 and f[0] == "RESULT" and f[1] == "torch":
            hd, bsz, s = int(f[5]), int(f[3][1:]), int(f[4])
            out[(hd, bsz, s, "forward")] = float(f[7])
            out[(hd, bsz, s, "backward")] = float(f[9])
    return out


def gemm(logs, who):
    """{'m x k -> n': [numbers...]} from `kernel_bench gemm` or scripts/torch_gemm.py."""
    out = {}
    for line in (read(os.path.join(logs, f"gemm-{who}.log")) or "").splitlines():
        m = GEMM.match(line)
        if m:
            out[f"{m.group(1)} x {m.group(2)} -> {m.group(3)}"] = [
                float(x.rstrip("%")) for x in m.group(4).split()]
    return out


def coll(logs, who):
    """{(op, bytes): busbw GB/s} for the variant that matters (`burn` for ours)."""
    out = {}
    for line in (read(os.path.join(logs, f"coll-{who}.log")) or "").splitlines():
        f = line.strip().split("|")
        if len(f) == 6 and f[0] == "RESULT" and f[3] in ("burn", "torch"):
            out[(f[1], int(f[2]))] = float(f[5])
    return out


def fmt(x, digits=0):
    if x is None:
        return ""
    return f"{x:,.{digits}f}"


def ratio(a, b):
    return f"{a / b:.3f}x" if a and b else ""


class Table:
    def __init__(self):
        self.sections = []

    def section(self, title, note=None):
        self.sections.append((title, note, []))

    def row(self, item, ours, base, r=""):
        self.sections[-1][2].append((item, ours, base, r))

    def markdown(self):
        out = []
        for title, note, rows in self.sections:
            if not rows:
                continue
            out += [f"### {title}", ""]
            if note:
                out += [note, ""]
            out += ["| item | ours | baseline | ratio |", "| --- | --- | --- | --- |"]
            out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
            out.append("")
        return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs")
    p.add_argument("--window", action="append", default=[],
                   help="MODEL=FIRST:LAST, the steps whose median counts")
    p.add_argument("--out", help="also write the markdown here")
    a = p.parse_args()
    windows = {"1b": (4, 11), "7b": (3, 9), "7b32k-rows": (2, 4), "7b32k-docs": (2, 4)}
    for w in a.window:
        model, span = w.split("=")
        lo, hi = span.split(":")
        windows[model] = (int(lo), int(hi))
    logs = a.logs
    t = Table()

    # Correctness first: a figure of a kernel that fails its check is not worth reading.
    status = {f[0]: f[1] for f in (l.split("\t") for l in
                                   (read(os.path.join(logs, "runs.tsv")) or "").splitlines())
              if len(f) >= 2}
    t.section("Checks")
    for b in ("new", "base"):
        text = read(os.path.join(logs, f"check-{b}.log"))
        if text is not None:
            ok = len(re.findall(r" ok$", text, re.M))
            bad = len(re.findall(r"FAIL", text))
            rc = status.get(f"check-{b}", "0")
            t.row(f"`kernel_bench check` ({b} build)",
                  f"{ok} ok, {bad} FAIL" + (f", exit status {rc}" if rc != "0" else ""), "", "")

    t.section("Attention (causal, 32 heads, bf16; TFLOP/s)",
              "Forward 4·B·H·S²·D/2 FLOPs, backward 2.5x that; baseline PyTorch's SDPA flash "
              "backend on the same shapes.")
    ours, theirs = attention(logs, "new"), torch_attention(logs)
    base = attention(logs, "base")
    for key in sorted(ours, key=lambda k: (-k[0], k[2], k[1], k[3] != "forward")):
        hd, bsz, s, pas = key
        for kernel, mine in ours[key]:
            item = f"{pas} `{kernel}`, hd {hd}, B{bsz} S={s}"
            rows = []
            if key in theirs:
                rows.append((f"{fmt(theirs[key], 1)} (PyTorch)", theirs[key]))
            rows += [(f"{fmt(v, 1)} (base build)", v) for k, v in base.get(key, []) if k == kernel]
            for baseline, value in rows or [("", None)]:
                t.row(item, fmt(mine, 1), baseline, ratio(mine, value))

    t.section("GEMMs (bf16 in, f32 accumulation; TFLOP/s)",
              "`fwd`: our cuBLAS linear on Burn tensors against cuBLAS called directly on raw "
              "buffers; `fwd+bwd`: forward, dx and dw against PyTorch's `F.linear`.")
    g_ours, g_torch, g_base = gemm(logs, "new"), gemm(logs, "torch"), gemm(logs, "base")
    for shape, v in g_ours.items():
        if len(v) >= 4:
            t.row(f"{shape}, fwd", fmt(v[0], 1), f"{fmt(v[3], 1)} (cuBLAS direct)",
                  ratio(v[0], v[3]))
        if shape in g_torch and len(g_torch[shape]) >= 2:
            t.row(f"{shape}, fwd+bwd", fmt(v[1], 1), f"{fmt(g_torch[shape][1], 1)} (PyTorch)",
                  ratio(v[1], g_torch[shape][1]))
        if shape in g_base:
            t.row(f"{shape}, fwd+bwd", fmt(v[1], 1), f"{fmt(g_base[shape][1], 1)} (base build)",
                  ratio(v[1], g_base[shape][1]))

    t.section("Llama training steps (one GPU, S=4096, micro-batch 1; tokens/s)",
              "Ours: median of the warm steps (" + ", ".join(
                  f"{m}: steps {lo}-{hi}" for m, (lo, hi) in windows.items())
              + "), MFU and peak memory from metrics.jsonl. PyTorch: `scripts/torch_llama.py`, "
                "Hugging Face LlamaForCausalLM, median step after warm-up.")
    for model in ("1b", "7b"):
        if model not in windows:
            continue
        mine = llama_run(logs, model, "new", windows[model])
        if not mine:
            continue

        def cell(r, spread=False):
            extra = [f"{fmt(r['lo'])}-{fmt(r['hi'])} over {r['n']} steps" if spread else None,
                     f"{r['mfu']:.1f} % MFU" if r["mfu"] else None,
                     f"{r['mem']:.1f} GiB" if r["mem"] else None,
                     f"loss {r['loss']:.4f}" if r.get("loss") else None]
            return f"{fmt(r['tps'])} ({', '.join(x for x in extra if x)})"

        item, rows = f"Llama {model}", []
        other = llama_run(logs, model, "base", windows[model])
        if other:
            rows.append((f"{cell(other)} (base build)", ratio(mine["tps"], other["tps"])))
        for mode, label in (("eager", "PyTorch eager"), ("compile", "torch.compile")):
            r = last_json(read(os.path.join(logs, f"torch-{model}-{mode}.log")))
            if r and r.get("tokens_per_s_per_gpu"):
                tps = r["tokens_per_s_per_gpu"]
                rows.append((f"{fmt(tps)} ({label}, {100 * r.get('mfu', 0):.1f} % MFU, "
                             f"{r.get('peak_mem_gib', 0):.1f} GiB)", ratio(mine["tps"], tps)))
        # The first row says everything about our run, the others only its median.
        for i, (baseline, r) in enumerate(rows or [("", "")]):
            t.row(item, cell(mine, spread=True) if i == 0 else fmt(mine["tps"]), baseline, r)

    t.section("Packed documents (Llama 2 7B, S=32,768, micro-batch 1, all 32 layers recomputed "
              "selectively; tokens/s)",
              "The same rows with `--document-masking` (attention inside each document) and "
              "without (each row one causal sequence); steps 2-4. MFU counts whole rows.")
    rows_new = llama_run(logs, "7b32k-rows", "new", windows["7b32k-rows"])
    for mode, label in (("docs", "documents masked"), ("rows", "rows causal")):
        mine = llama_run(logs, f"7b32k-{mode}", "new", windows[f"7b32k-{mode}"])
        if not mine:
            continue
        ours = (f"{fmt(mine['tps'])} ({fmt(mine['lo'])}-{fmt(mine['hi'])}"
                + (f", {mine['mem']:.1f} GiB" if mine["mem"] else "") + ")")
        rows = []
        if mode == "docs" and rows_new:
            rows.append((f"{fmt(rows_new['tps'])} (rows causal)", ratio(mine["tps"], rows_new["tps"])))
        other = llama_run(logs, f"7b32k-{mode}", "base", windows[f"7b32k-{mode}"])
        if other:
            rows.append((f"{fmt(other['tps'])}"
                         + (f", {other['mem']:.1f} GiB" if other["mem"] else "")
                         + " (base build)", ratio(mine["tps"], other["tps"])))
        for baseline, r in rows or [("", "")]:
            t.row(f"7B S=32k, {label}", ours, baseline, r)

    t.section("GPT example (86M parameters, S=1024, micro-batch 8; tokens/s)",
              "`gpt_train`'s own figure over its timed steps; baseline the same build on "
              "`CudaCube` (no fusion), or the base build.")
    runs = {(b, k): last_json(read(os.path.join(logs, f"gpt-{b}-{k}.log")))
            for b in ("new", "base") for k in ("cube", "fusion")}
    fus, cube = runs[("new", "fusion")], runs[("new", "cube")]
    if fus and cube:
        t.row("`burn::backend::Cuda` (fusion) against `CudaCube`", fmt(fus["tokens_per_sec"]),
              f"{fmt(cube['tokens_per_sec'])} (CudaCube)",
              ratio(fus["tokens_per_sec"], cube["tokens_per_sec"]))
    for k in ("fusion", "cube"):
        n, o = runs[("new", k)], runs[("base", k)]
        if n and o:
            t.row(f"{k} backend", fmt(n["tokens_per_sec"]), f"{fmt(o['tokens_per_sec'])} (base build)",
                  ratio(n["tokens_per_sec"], o["tokens_per_sec"]))
        elif n and not (fus and cube):
            t.row(f"{k} backend", fmt(n["tokens_per_sec"]), "", "")

    t.section("Collectives (bf16, bus bandwidth GB/s, from 64 MiB)",
              "Ours: `CudaTensorComm` on Burn tensors; baseline `torch.distributed` (NCCL).")
    c_ours, c_torch = coll(logs, "new"), coll(logs, "torch")
    for (op, size), bw in sorted(c_ours.items(), key=lambda x: (x[0][0], x[0][1])):
        if size >= 64 << 20:
            theirs_bw = c_torch.get((op, size))
            t.row(f"{op}, {size >> 20} MiB", fmt(bw, 1),
                  f"{fmt(theirs_bw, 1)} (torch)" if theirs_bw else "", ratio(bw, theirs_bw))

    head = []
    for name, label in (("command.txt", "Command"), ("gpu.txt", "GPU"), ("builds.txt", "Binaries")):
        text = (read(os.path.join(logs, name)) or "").strip()
        if text:
            head.append(f"- {label}: " + "; ".join(text.splitlines()))
    runs_tsv = read(os.path.join(logs, "runs.tsv")) or ""
    failed = [l.split("\t") for l in runs_tsv.splitlines() if l.count("\t") >= 2 and l.split("\t")[1] != "0"]
    for tag, rc, secs in (f[:3] for f in failed):
        head.append(f"- **{tag} exited with status {rc}** after {secs} s"
                    + (" (killed at its time limit)" if rc in ("124", "137") else "")
                    + f": see logs/{tag}.log")
    timing = [l.split("\t") for l in runs_tsv.splitlines() if l.count("\t") >= 2]
    if timing:
        head.append("- Wall time per run (s): " + ", ".join(f"{f[0]} {f[2]}" for f in timing))
    text = "\n".join(head) + "\n\n" + t.markdown()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
