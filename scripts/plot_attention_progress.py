"""Writes docs/attention_progress.svg: our causal flash attention (hd 128, batch 1, 32 heads,
bf16, one H200) by session against PyTorch's flash backend in the same call, at S 4096 and
16384. The figures are docs/performance.md's (the call named beside each session below); no
dependencies, so `python3 scripts/plot_attention_progress.py` runs anywhere."""

# session: (call, fwd 4k, fwd 16k, bwd 4k, bwd 16k), TFLOP/s, default tilings of the time.
OURS = [
    (2, "session 2 (wmma)", 85, 91, 57, 62),
    (3, "call M (mma.sync)", 175, 190, 135, 151),
    (4, "calls T, W (cp.async)", 219, 262, 189, 203),
    (9, "call DG (unmasked blocks)", 245, 294, 188, 197),
    (10, "call DI (backward split)", 248, 295, 194, 206),
    (11, "calls DU, DV (addresses, atomic dQ)", 257, 315, 203, 241),
    (12, "call EA (dQ deferred, two m-tiles)", 252, 315, 217, 252),
]
# PyTorch's flash backend (torch 2.11 SDPA), same call as session 12's last figures (call EC).
TORCH = {"fwd 4k": 249, "fwd 16k": 338, "bwd 4k": 218, "bwd 16k": 303}

W, H = 820, 330
PANEL_W, PANEL_H = 320, 220
LEFT, TOP = 60, 50
Y_MAX = 350


def panel(x0, title, fwd, bwd, t_fwd, t_bwd):
    out = [f'<text x="{x0 + PANEL_W / 2}" y="{TOP - 18}" text-anchor="middle" font-size="14">{title}</text>']
    out.append(f'<rect x="{x0}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/>')
    for v in range(0, Y_MAX + 1, 50):
        y = TOP + PANEL_H - v / Y_MAX * PANEL_H
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{v}</text>')
    sessions = [s for s, *_ in OURS]
    lo, hi = min(sessions), max(sessions)

    def px(s):
        return x0 + 15 + (s - lo) / (hi - lo) * (PANEL_W - 30)

    def py(v):
        return TOP + PANEL_H - v / Y_MAX * PANEL_H

    for s in sessions:
        out.append(f'<text x="{px(s):.1f}" y="{TOP + PANEL_H + 14}" text-anchor="middle" font-size="10">{s}</text>')
    for values, ref, color, name in ((fwd, t_fwd, "#1f77b4", "forward"), (bwd, t_bwd, "#d62728", "backward")):
        pts = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in zip(sessions, values))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        for s, v in zip(sessions, values):
            out.append(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="3" fill="{color}"/>')
        out.append(f'<line x1="{x0}" y1="{py(ref):.1f}" x2="{x0 + PANEL_W}" y2="{py(ref):.1f}" '
                   f'stroke="{color}" stroke-dasharray="5,4"/>')
        out.append(f'<text x="{x0 + 4}" y="{py(ref) - 4:.1f}" font-size="10" fill="{color}">'
                   f'PyTorch {name} {ref}</text>')
        out.append(f'<text x="{px(sessions[-1]) - 4:.1f}" y="{py(values[-1]) + 14:.1f}" text-anchor="end" '
                   f'font-size="10" fill="{color}">ours {values[-1]}</text>')
    return out


def main():
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
            f'<rect width="{W}" height="{H}" fill="white"/>']
    body += panel(LEFT, "S = 4096", [o[2] for o in OURS], [o[4] for o in OURS], TORCH["fwd 4k"], TORCH["bwd 4k"])
    body += panel(LEFT + PANEL_W + 70, "S = 16384", [o[3] for o in OURS], [o[5] for o in OURS],
                  TORCH["fwd 16k"], TORCH["bwd 16k"])
    body.append(f'<text x="{W / 2}" y="{H - 30}" text-anchor="middle" font-size="11">session '
                '(solid: ours, default tilings; dashed: PyTorch flash, same call as session 11)</text>')
    body.append(f'<text x="14" y="{TOP + PANEL_H / 2}" font-size="11" transform="rotate(-90 14 {TOP + PANEL_H / 2})" '
                'text-anchor="middle">TFLOP/s (causal, hd 128, batch 1, one H200)</text>')
    body.append("</svg>")
    with open("docs/attention_progress.svg", "w") as f:
        f.write("\n".join(body) + "\n")
    print("wrote docs/attention_progress.svg")


if __name__ == "__main__":
    main()
