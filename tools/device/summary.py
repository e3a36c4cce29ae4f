#!/usr/bin/env python3
"""Joins the GPU benchmark (bench/cuda_decode_bench.cpp) and PyTorch's (torch_sdpa_bench.py)
JSON files of one device run into the short table that tools/device/run.sh prints last,
with the project's goals checked: dense at 128K batch 1 against the copy bandwidth, sparse
speedups over PyTorch's fastest dense path at P = 0.9, selection share of the sparse step
(tactic, psa; sketch_topp, with its byte floor: sketch + union K/V at
the copy bandwidth).

Usage: summary.py cuda_decode_bench.json torch_sdpa.json [--base base_bench.json]
(--base: the same benchmark built from another commit and run in the same device run;
its rows are printed as base:dense, base:tactic, ... next to ours.)
"""
import json
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"summary: cannot read {path}: {e}")
        return None


def main():
    argv = sys.argv[1:]
    base = None
    if "--base" in argv:
        i = argv.index("--base")
        base = load(argv[i + 1]) if i + 1 < len(argv) else None
        argv = argv[:i] + argv[i + 2:]
    ours = load(argv[0]) if len(argv) > 0 else None
    torch = load(argv[1]) if len(argv) > 1 else None
    tbest = {}
    if torch:
        print(f"PyTorch {torch.get('torch')} cuDNN {torch.get('cudnn')}: copy "
              f"{torch['copy']['gbps_median']:.0f} GB/s")
        for r in torch["runs"]:
            if "best" in r:
                tbest[(r["context"], r["batch"])] = r["best"]
    if not ours:
        return 1
    copy = ours["copy"]["gbps_median"]
    print(f"{ours['device']['name']}: device-to-device copy {copy:.0f} GB/s (read + write), "
          f"P = {ours['options']['p']}, concentration {ours['options']['concentration']}")
    hdr = (f"{'ctx':>6} {'B':>2} {'method':<12} {'us/step':>8} {'sel%':>5} {'GB/s':>6} {'%copy':>6} "
           f"{'xTorch':>6} {'mass':>5} {'tok%':>6} {'err':>6} {'floor':>7}")
    print(hdr)
    goals = {}
    base_runs = {(r["context"], r["batch"]): r for r in (base or {}).get("runs", [])}
    for r in ours.get("runs", []):
        n, b = r["context"], r["batch"]
        tb = tbest.get((n, b))
        tus = tb["us_median"] if tb else None
        if (n, b) in base_runs:  # the other commit's figures, same device run
            br = base_runs[(n, b)]
            d = br["dense"]["best"]
            x = f"{tus / d['us_median']:6.2f}" if tus else "     -"
            print(f"{n:>6} {b:>2} {'base:dense':<12} {d['us_median']:8.1f} {'':>5} {d['gbps']:6.0f} "
                  f"{d['pct_copy']:6.1f} {x}")
            for m in br.get("methods", []):
                if "step_us" in m:
                    x = f"{tus / m['step_us']:6.2f}" if tus else "     -"
                    print(f"{n:>6} {b:>2} {'base:' + m['method']:<12.12} {m['step_us']:8.1f} "
                          f"{100 * m['select_share']:5.1f} {m['attend_gbps']:6.0f} {m['attend_pct_copy']:6.1f} {x} "
                          f"{m['true_mass']:5.3f} {100 * m['tokens_frac']:6.2f} {m['rel_err']:6.4f}")
        d = r["dense"]["best"]
        x = f"{tus / d['us_median']:6.2f}" if tus else "     -"
        label = "dense:" + d.get("plan", "") if d.get("plan") else "dense"
        print(f"{n:>6} {b:>2} {label:<12.12} {d['us_median']:8.1f} {'':>5} {d['gbps']:6.0f} {d['pct_copy']:6.1f} "
              f"{x} {1:5.3f} {100:6.1f} {0:6.4f}")
        if tb:
            print(f"{n:>6} {b:>2} {'torch:' + tb['backend']:<12.12} {tus:8.1f} {'':>5} {tb['gbps']:6.0f} "
                  f"{tb['pct_copy']:6.1f} {1:6.2f}")
        if n == 131072 and b == 1:
            goals["dense_pct_copy"] = d["pct_copy"]
        for m in r.get("methods", []):
            if "step_us" not in m:
                print(f"{n:>6} {b:>2} {m.get('method', '?'):<12} error: {m.get('error', '')[:60]}")
                continue
            x = tus / m["step_us"] if tus else None
            xs = f"{x:6.2f}" if x else "     -"
            fl = f"{m['floor_us']:7.1f}" if "floor_us" in m else ""
            print(f"{n:>6} {b:>2} {m['method']:<12} {m['step_us']:8.1f} {100 * m['select_share']:5.1f} "
                  f"{m['attend_gbps']:6.0f} {m['attend_pct_copy']:6.1f} {xs} {m['true_mass']:5.3f} "
                  f"{100 * m['tokens_frac']:6.2f} {m['rel_err']:6.4f} {fl}")
            if n == 131072 and m["method"] in ("tactic", "psa") and x:
                goals[(b, m["method"])] = (x, m["select_share"])
            if m["method"] == "sketch_topp":
                goals[("sketch", n, b)] = (x, m["select_share"], m["step_us"], d["us_median"],
                                           tus / m["floor_us"] if tus and "floor_us" in m else None)
    for t in ours.get("traces", []):
        if "error" in t:
            print(f"trace {t['path']}: error {t['error'][:100]}")
            continue
        h = t["header"]
        print(f"trace {t['path']}: {h['n_tokens']} tokens, layers {h['layers']}, {h['steps']} steps "
              f"({h['n_q_heads']}/{h['n_kv_heads']} heads, d {h['head_dim']})")
        for l in t["layers"]:
            parts = [f"L{l['layer']:>2} dense {l['dense_us']:.1f}us"]
            for name, v in l.items():
                if isinstance(v, dict) and "true_mass" in v:
                    parts.append(f"{name} mass {v['true_mass']:.3f} tok {100 * v['tokens_frac']:.1f}% "
                                 f"err {v['rel_err']:.3f} {v['step_us']:.1f}us")
            print("  " + " | ".join(parts))
    print("goals (sketch_topp at P = 0.9):")
    for (key, (x, sel, us, dense_us, xfloor)) in sorted((k, v) for k, v in goals.items() if k[0] == "sketch"):
        _, n, b = key
        want = {(131072, 1): 3.0, (131072, 16): 3.0, (32768, 1): 1.5}.get((n, b))
        xs = f"{x:.2f}x cuDNN" if x else "- (no PyTorch row)"
        line = f"  {n // 1024}K B={b}: {xs}"
        if want:
            line += f" (goal >= {want}x)"
        if xfloor:
            line += f", at most {xfloor:.2f}x at the byte floor"
        if n == 8192:
            line += f"; {dense_us / us:.2f}x our dense (goal >= 1)"
        line += f"; selection {100 * sel:.1f}% of the step (goal <= 25%)"
        print(line)
    print("goals (tactic, psa):")
    if "dense_pct_copy" in goals:
        print(f"  dense 128K B=1: {goals['dense_pct_copy']:.1f}% of copy bandwidth (goal >= 85%)")
    for b, want in ((1, 5), (16, 8)):
        for meth in ("tactic", "psa"):
            if (b, meth) in goals:
                x, sel = goals[(b, meth)]
                print(f"  {meth} 128K B={b}: {x:.2f}x PyTorch's fastest dense (goal >= {want}x), "
                      f"selection {100 * sel:.1f}% of the step (goal < 20%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
