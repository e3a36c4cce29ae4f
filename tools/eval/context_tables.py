#!/usr/bin/env python3
"""Joins `cumulus eval kl --json` reports taken at several contexts into one table per text
and two SVG plots (tokens attended and KL against context, one line per method).

    tools/eval/context_tables.py OUT_DIR REPORT.json...

Prints the Markdown tables (one per text, rows method x context) to stdout and writes
OUT_DIR/<stem>_tokens_vs_context.svg and OUT_DIR/<stem>_kl_vs_context.svg, <stem> the
model file's name. Every figure comes from the reports as written: nothing is recomputed
but the ratios to oracle_topp's union and dense's perplexity in the same report.
"""
import json
import math
import os
import sys
from collections import defaultdict

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf"]


def load(paths):
    rows = []  # (text, context, run, report)
    for p in paths:
        with open(p) as f:
            rep = json.load(f)
        c = rep["continuation"]
        text = os.path.basename(rep["options"]["text"]) if "text" in rep["options"] else os.path.basename(p)
        for run in c["runs"]:
            rows.append((text, c["context"], run, rep))
    return rows


def fmt(x, digits=4):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1e-2 and x != 0 else f"{x:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{x}"


def table(rows):
    by_text = defaultdict(list)
    for r in rows:
        by_text[r[0]].append(r)
    out = []
    for text, rs in by_text.items():
        out.append(f"\n**{text}**\n")
        out.append("| method | context | KV read % | tokens/head-step | / oracle_topp union | true mass | reached P "
                   "| KL mean | KL p95 | ppl / dense |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        contexts = sorted({r[1] for r in rs})
        labels = []
        for r in rs:
            if r[2]["label"] not in labels:
                labels.append(r[2]["label"])
        for label in labels:
            for ctx in contexts:
                run = [r[2] for r in rs if r[1] == ctx and r[2]["label"] == label]
                if not run:
                    continue
                run = run[0]
                same = [r[2] for r in rs if r[1] == ctx]
                oracle = next((x for x in same if x["label"] == "oracle_topp"), None)
                dense = next((x for x in same if x["label"] == "dense"), None)
                ratio = run["tokens_mean"] / oracle["tokens_mean"] if oracle else None
                reached = run.get("reached")
                has_claim = run.get("claimed_mean") is not None and label not in ("dense",)
                out.append(
                    f"| {label} | {ctx} | {100 * run['kv_fraction']:.1f} | {run['tokens_mean']:.0f} | "
                    f"{ratio:.2f} | {run['mass_true_mean']:.4f} | "
                    f"{(f'{100 * reached:.1f}%' if has_claim and reached is not None else '-')} | "
                    f"{run['kl']['mean']:.3g} | {run['kl']['p95']:.3g} | "
                    f"{run['ppl'] / dense['ppl']:.4f} |")
    return "\n".join(out)


def svg_plot(path, title, ylabel, series, log_y=False):
    """series: {label: [(x, y), ...]}; x on a log2 axis."""
    w, h, ml, mr, mt, mb = 640, 400, 70, 150, 40, 50
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ys = [y for pts in series.values() for _, y in pts if y is not None and (y > 0 or not log_y)]
    if not xs or not ys:
        return
    tx = lambda x: ml + (math.log2(x) - math.log2(xs[0])) / max(1e-9, math.log2(xs[-1]) - math.log2(xs[0])) * (w - ml - mr)
    if log_y:
        lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        ty = lambda y: h - mb - (math.log10(y) - lo) / max(1e-9, hi - lo) * (h - mt - mb)
        ticks = [10.0 ** e for e in range(lo, hi + 1)]
    else:
        lo, hi = 0.0, max(ys) * 1.05
        ty = lambda y: h - mb - (y - lo) / (hi - lo) * (h - mt - mb)
        ticks = [hi * i / 5 for i in range(6)]
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2 - mr / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
         f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
         f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
         f'<text x="{(ml + w - mr) / 2}" y="{h - 12}" text-anchor="middle">context (tokens)</text>',
         f'<text x="16" y="{(mt + h - mb) / 2}" text-anchor="middle" transform="rotate(-90 16 {(mt + h - mb) / 2})">'
         f'{ylabel}</text>']
    for x in xs:
        s.append(f'<text x="{tx(x):.1f}" y="{h - mb + 16}" text-anchor="middle">{x}</text>')
    for t in ticks:
        s.append(f'<line x1="{ml - 4}" y1="{ty(t):.1f}" x2="{w - mr}" y2="{ty(t):.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{ml - 6}" y="{ty(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
    for i, (label, pts) in enumerate(series.items()):
        pts = [(x, y) for x, y in sorted(pts) if y is not None and (y > 0 or not log_y)]
        if not pts:
            continue
        c = COLORS[i % len(COLORS)]
        s.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                 + " ".join(f"{tx(x):.1f},{ty(y):.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            s.append(f'<circle cx="{tx(x):.1f}" cy="{ty(y):.1f}" r="3" fill="{c}"/>')
        s.append(f'<text x="{w - mr + 8}" y="{mt + 14 * i + 4}" fill="{c}">{label}</text>')
    s.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(s) + "\n")


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: context_tables.py OUT_DIR REPORT.json...")
    out_dir, paths = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    rows = load(paths)
    print(table(rows))
    stem = os.path.splitext(os.path.basename(rows[0][3]["model"]["path"]))[0]
    # Plots: the mean over texts of each method's share of the context attended and KL.
    share, kl = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    for text, ctx, run, _ in rows:
        if run["label"] == "dense":
            continue
        share[run["label"]][ctx].append(run["tokens_mean"] / ctx)
        kl[run["label"]][ctx].append(run["kl"]["mean"])
    mean = lambda d: {k: [(x, sum(v) / len(v)) for x, v in pts.items()] for k, pts in d.items()}
    svg_plot(os.path.join(out_dir, f"{stem}_tokens_vs_context.svg"),
             "tokens attended (group union) / context, mean over texts", "share of the context", mean(share))
    svg_plot(os.path.join(out_dir, f"{stem}_kl_vs_context.svg"), "KL(dense || method), mean over texts",
             "mean KL (nats, log scale)", mean(kl), log_y=True)


if __name__ == "__main__":
    main()
