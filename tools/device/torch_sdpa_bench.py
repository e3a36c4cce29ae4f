#!/usr/bin/env python3
"""PyTorch's dense decode attention on the GPU, the yardstick of bench/cuda_decode_bench.cpp.

torch.nn.functional.scaled_dot_product_attention with each backend that runs (flash,
cuDNN, memory-efficient) on the llama3-8b decode shape by default: q [B, 32, 1, 128], K/V
[B, 8, n, 128] f16, enable_gqa=True (each K/V head read once for its 4 query heads). Timed
like our benchmark: a CUDA graph of one call replayed between two events, each replay
preceded (outside the events) by a 256 MiB fill that evicts the L2; warm-up, then the median.
A backend that cannot take GQA natively is also run on K/V repeated to 32 heads (it then
reads 4x the bytes), labelled as such. The device-to-device copy bandwidth is measured in
this process too. Each backend's output is checked against float32 math on the same inputs.

Usage: torch_sdpa_bench.py [--contexts 8192,32768,131072] [--batches 1,16] [--iters 30]
                           [--warmup 5] [--backends flash,cudnn,efficient] [--shape 32,8,128]
                           [--json PATH]
(--backends narrows the run, e.g. to profile one backend's kernels under Nsight Compute;
--shape QUERY_HEADS,KV_HEADS,HEAD_DIM another model's decode shape, e.g. 4,1,256 for Gemma 3
270M's global layers.)
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed_graph(fn, flush, warmup, iters):
    """Captures fn in a CUDA graph; returns (microseconds per replay, list), or raises."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        g.replay()
    us = []
    for i in range(iters):
        flush.fill_(i & 0xFF)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        us.append(1e3 * e0.elapsed_time(e1))
    return statistics.median(us), us


def timed_eager(fn, flush, warmup, iters):
    """Fallback when a backend cannot be captured in a graph: events around each call."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    us = []
    for i in range(iters):
        flush.fill_(i & 0xFF)
        torch.cuda.synchronize()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        us.append(1e3 * e0.elapsed_time(e1))
    return statistics.median(us), us


def copy_bandwidth(iters):
    n = 1 << 30
    a = torch.ones(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gbps = []
    for i in range(iters + 3):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        if i >= 3:
            gbps.append(2 * n / (e0.elapsed_time(e1) * 1e-3) / 1e9)
    return statistics.median(gbps), gbps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backends", default="flash,cudnn,efficient")
    ap.add_argument("--shape", default="32,8,128", help="query heads, kv heads, head_dim")
    ap.add_argument("--json", default="torch_sdpa.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report = {"device": props.name, "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "runs": []}
    copy_gbps, samples = copy_bandwidth(20)
    report["copy"] = {"gbps_median": copy_gbps, "gbps_samples": samples, "bytes": 1 << 30,
                      "counted": "read + write"}
    print(f"torch {torch.__version__} on {props.name}: device-to-device copy {copy_gbps:.0f} GB/s")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    hq, hkv, d = (int(x) for x in a.shape.split(","))
    assert hq % hkv == 0, f"--shape {a.shape}: query heads must be a multiple of kv heads"
    report["shape"] = {"n_q_heads": hq, "n_kv_heads": hkv, "head_dim": d}
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    wanted = a.backends.split(",")
    backends = [b for b in backends if b[0] in wanted]
    for n in [int(x) for x in a.contexts.split(",")]:
        for bsz in [int(x) for x in a.batches.split(",")]:
            q = torch.randn(bsz, hq, 1, d, dtype=torch.float16, device="cuda")
            k = torch.randn(bsz, hkv, n, d, dtype=torch.float16, device="cuda")
            v = torch.randn(bsz, hkv, n, d, dtype=torch.float16, device="cuda")
            kv_bytes = 2 * bsz * hkv * n * d * 2
            # float32 reference on one sequence (the first), to check every backend.
            kr = k[:1].float().repeat_interleave(hq // hkv, dim=1)
            vr = v[:1].float().repeat_interleave(hq // hkv, dim=1)
            ref = torch.softmax((q[:1].float() @ kr.transpose(-1, -2)) / d ** 0.5, dim=-1) @ vr
            del kr, vr
            run = {"context": n, "batch": bsz, "bytes": kv_bytes, "backends": {}}
            for name, be in backends:
                for gqa in (True, False):
                    label = name if gqa else name + "_repeat_kv"
                    try:
                        if gqa:
                            kk, vv = k, v
                        else:
                            kk = k.repeat_interleave(hq // hkv, dim=1)
                            vv = v.repeat_interleave(hq // hkv, dim=1)

                        def fn(kk=kk, vv=vv, be=be, gqa=gqa):
                            with sdpa_kernel([be]):
                                return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)

                        out = fn()
                        torch.cuda.synchronize()
                        err = ((out[:1].float() - ref).norm() / ref.norm()).item()
                        try:
                            med, us = timed_graph(fn, flush, a.warmup, a.iters)
                            mode = "graph"
                        except Exception as ge:  # noqa: BLE001
                            torch.cuda.synchronize()
                            med, us = timed_eager(fn, flush, a.warmup, a.iters)
                            mode = "eager (graph capture failed: " + str(ge).strip().splitlines()[0][:120] + ")"
                        gbps = kv_bytes / (med * 1e-6) / 1e9
                        run["backends"][label] = {"us_median": med, "us_samples": us, "gbps": gbps, "mode": mode,
                                                  "pct_copy": 100 * gbps / copy_gbps, "rel_err": err,
                                                  "reads_bytes": kv_bytes * (1 if gqa else hq // hkv)}
                        print(f"  n={n:>6} B={bsz:>2} {label:<20} {med:9.1f} us {gbps:7.0f} GB/s "
                              f"{100 * gbps / copy_gbps:5.1f}% of copy  rel.err {err:.1e}  {mode[:5]}")
                        del kk, vv
                        if gqa:
                            break  # the repeated-K/V form only when GQA is refused
                    except Exception as e:  # noqa: BLE001 - record why a backend did not run
                        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                        run["backends"][label] = {"error": msg}
                        print(f"  n={n:>6} B={bsz:>2} {label:<20} not run: {msg}")
                        torch.cuda.synchronize()
            ok = {kk: vv for kk, vv in run["backends"].items() if "us_median" in vv}
            if ok:
                best = min(ok, key=lambda x: ok[x]["us_median"])
                run["best"] = {"backend": best, **{kk: ok[best][kk] for kk in ("us_median", "gbps", "pct_copy")}}
            report["runs"].append(run)
            del q, k, v
            torch.cuda.empty_cache()
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    sys.exit(main())
