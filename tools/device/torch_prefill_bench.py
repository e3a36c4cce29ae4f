#!/usr/bin/env python3
"""PyTorch's causal prefill attention on the GPU, the yardstick of bench/cuda_prefill_bench.cpp.

torch.nn.functional.scaled_dot_product_attention(is_causal=True) on the llama3-8b shape: q
[1, 32, n, 128], K/V [1, 8, n, 128] f16, enable_gqa=True, under each backend that runs
(flash, cuDNN, memory-efficient; a backend that refuses GQA also runs on K/V repeated to 32
heads, labelled so). Events around each call, warm-up, then the median. Each backend's
output is checked on sampled rows against float32 math on the same inputs. With --ours
(cuda_prefill_bench's JSON) it prints the joined table: our dense and flexprefill against
PyTorch's fastest causal path, ratios from the same device run.

Usage: torch_prefill_bench.py [--contexts 32768,131072] [--iters 5] [--warmup 1]
                              [--json PATH] [--ours PATH]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup, iters):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(iters):
        torch.cuda.synchronize()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
    return statistics.median(ms), ms


def sampled_reference(q, k, v, rows):
    """float32 causal attention of the given query rows of every head: [1, hq, len(rows), d]."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    out = []
    for i in rows:
        kk = k[:, :, : i + 1].float().repeat_interleave(hq // hkv, dim=1)
        vv = v[:, :, : i + 1].float().repeat_interleave(hq // hkv, dim=1)
        s = (q[:, :, i : i + 1].float() @ kk.transpose(-1, -2)) / d ** 0.5
        out.append(torch.softmax(s, dim=-1) @ vv)
    return torch.cat(out, dim=2)


def joined_table(ours, torch_report):
    lines = ["| ctx | method | ms | TFLOP/s | x PyTorch best | x our dense | block share % | err |",
             "|---|---|---|---|---|---|---|---|"]
    truns = {r["context"]: r for r in torch_report["runs"]}
    for r in ours["runs"]:
        n = r["context"]
        t = truns.get(n, {"backends": {}})
        ok = {k: b for k, b in t["backends"].items() if "ms" in b}
        best = min(ok.values(), key=lambda b: b["ms"])["ms"] if ok else None
        flops = 4 * 128 * 32 * n * (n + 1) / 2
        dense = r["dense"]["ms"]
        f = r["flexprefill"]
        def ratio(ms):
            return f"{best / ms:.2f}" if best else ""
        lines.append(f"| {n // 1024}K | dense (ours) | {dense:.2f} | {flops / dense * 1e-9:.0f} | {ratio(dense)} | 1.00 | 100 | "
                     f"{r['dense']['max_row_err_vs_f64']:.1e} |")
        lines.append(f"| {n // 1024}K | flexprefill (ours, total) | {f['ms_total']:.2f} | | {ratio(f['ms_total'])} | "
                     f"{dense / f['ms_total']:.2f} | {100 * f['block_share']:.1f} | {f['err_vs_dense']:.1e} |")
        lines.append(f"| {n // 1024}K | flexprefill sparse kernel alone | {f['ms_attention']:.2f} | "
                     f"{f['attention_tflops_effective']:.0f} | {ratio(f['ms_attention'])} | {dense / f['ms_attention']:.2f} | | |")
        for name, b in sorted(ok.items(), key=lambda kv: kv[1]["ms"]):
            lines.append(f"| {n // 1024}K | PyTorch {name} | {b['ms']:.2f} | {flops / b['ms'] * 1e-9:.0f} | "
                         f"{best / b['ms']:.2f} | {dense / b['ms']:.2f} | 100 | {b['err']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="torch_prefill.json")
    ap.add_argument("--ours", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report = {"device": props.name, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "runs": []}
    print(f"torch {torch.__version__} on {props.name}")
    hq, hkv, d = 32, 8, 128
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for n in [int(x) for x in a.contexts.split(",")]:
        q = torch.randn(1, hq, n, d, dtype=torch.float16, device="cuda")
        k = torch.randn(1, hkv, n, d, dtype=torch.float16, device="cuda")
        v = torch.randn(1, hkv, n, d, dtype=torch.float16, device="cuda")
        rows = [0, 1, n // 2, n - 1]
        ref = sampled_reference(q, k, v, rows)
        flops = 4 * d * hq * n * (n + 1) / 2
        run = {"context": n, "flops": flops, "backends": {}}
        for name, be in backends:
            for gqa in (True, False):
                label = name if gqa else name + "_repeat_kv"
                try:
                    kk, vv = (k, v) if gqa else (k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1))

                    def fn(kk=kk, vv=vv, be=be, gqa=gqa):
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                    out = fn()
                    torch.cuda.synchronize()
                    got = out[:, :, rows].float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    del out
                    ms, samples = timed(fn, a.warmup, a.iters)
                    run["backends"][label] = {"ms": ms, "samples_ms": samples, "tflops": flops / ms * 1e-9, "err": err}
                    print(f"{n:7d} {label:20s} {ms:9.2f} ms {flops / ms * 1e-9:7.1f} TFLOP/s err {err:.1e}", flush=True)
                    break  # GQA ran natively: no repeated-K/V run needed
                except Exception as e:  # noqa: BLE001 - a backend that refuses is reported, not fatal
                    run["backends"][label] = {"error": str(e).splitlines()[0][:200]}
                    print(f"{n:7d} {label:20s} refused: {run['backends'][label]['error']}", flush=True)
                finally:
                    torch.cuda.empty_cache()
        report["runs"].append(run)
        del q, k, v
        torch.cuda.empty_cache()
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    if a.ours:
        with open(a.ours) as f:
            ours = json.load(f)
        print()
        print(joined_table(ours, report))


if __name__ == "__main__":
    main()
