#!/usr/bin/env python3
"""Cuts a `cumulus trace` file (tools/cli/trace_command.cpp, format in docs/cuda.md) down to
chosen layers and the first S decode steps, so a trace recorded once with many layers and
steps (for CPU-side analysis) yields the small trace a device run carries (the working tree
that travels is limited to 64 MiB).

Step j of the output attends tokens [0, prompt + j + 1) as before; K/V keep the first
prompt + S tokens, Q the first S steps.

Usage: trace_subset.py IN OUT --layers 3,15,27 [--steps 16]
"""
import argparse
import json
import struct
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--steps", type=int, default=0, help="0 = all of the input's steps")
    a = ap.parse_args()
    with open(a.inp, "rb") as f:
        magic = f.read(8)
        version, hb = struct.unpack("<II", f.read(8))
        if magic != b"CUMTRACE" or version != 1:
            sys.exit(f"{a.inp}: not a cumulus trace (magic {magic!r}, version {version})")
        h = json.loads(f.read(hb))
        n_kv, n_q, d = h["n_kv_heads"], h["n_q_heads"], h["head_dim"]
        n, prompt, steps = h["n_tokens"], h["prompt_tokens"], h["steps"]
        kv_bytes = n * n_kv * d * 2
        q_bytes = steps * n_q * d * 4
        blocks = {}
        for layer in h["layers"]:
            k = f.read(kv_bytes)
            v = f.read(kv_bytes)
            q = f.read(q_bytes)
            if len(k) != kv_bytes or len(v) != kv_bytes or len(q) != q_bytes:
                sys.exit(f"{a.inp}: truncated in layer {layer}")
            blocks[layer] = (k, v, q)
    want = [int(x) for x in a.layers.split(",")]
    for layer in want:
        if layer not in blocks:
            sys.exit(f"layer {layer} is not in {a.inp} (layers {h['layers']})")
    s = a.steps or steps
    if not 1 <= s <= steps:
        sys.exit(f"--steps {s} must be in [1, {steps}]")
    n_out = prompt + s
    h2 = dict(h)
    h2.update({"layers": want, "steps": s, "n_tokens": n_out, "cut_from": a.inp})
    hdr = json.dumps(h2).encode()
    with open(a.out, "wb") as f:
        f.write(b"CUMTRACE" + struct.pack("<II", 1, len(hdr)) + hdr)
        for layer in want:
            k, v, q = blocks[layer]
            f.write(k[: n_out * n_kv * d * 2])
            f.write(v[: n_out * n_kv * d * 2])
            f.write(q[: s * n_q * d * 4])
    print(f"{a.out}: layers {want}, {s} steps, {n_out} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
