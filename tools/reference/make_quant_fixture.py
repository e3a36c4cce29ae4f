#!/usr/bin/env python3
"""Writes tests/data/quant_reference.json: random ggml blocks of every type cumulus
dequantises, with the float32 values that gguf-py (the ggml project's own Python package,
`pip install gguf`) decodes them to. The C++ tests decode the same bytes and compare.

Block bytes are random except the f16 scale fields, which are set to sane values so the
reference holds no Inf/NaN. Each quantised type also gets two edge blocks (every other
byte 0xFF: largest codes, 6-bit scales and mins 63, Q6_K scales -1; every other byte 0x80:
Q6_K scales -128, lone top bits), and a GEMV case: a matrix of 3 rows of random blocks, a
random x and y = W x summed in float64 over gguf-py's dequantised W (the golden for the
quantised GEMV; x is float32).

Usage: python3 tools/reference/make_quant_fixture.py > tests/data/quant_reference.json
"""
import importlib.metadata
import json
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

# Byte offsets of the f16 scale fields of each block type.
SCALE_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
N_BLOCKS = 3
GEMV_ROWS = 3


def f32_list(a):
    """float32 values as the shortest decimals that read back to the same float32."""
    return [float(str(np.float32(v))) for v in a]


def random_blocks(rng, t, fields, n_blocks, fill=None):
    block_size, type_size = gguf.GGML_QUANT_SIZES[t]
    if fill is None:
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    else:
        raw = np.full((n_blocks, type_size), fill, dtype=np.uint8)
    for b in range(n_blocks):
        for off in fields:
            mag = np.float16(rng.uniform(2.0 ** -10, 2.0 ** -4))
            sign = -1 if (off == 0 and rng.random() < 0.3) else 1
            raw[b, off:off + 2] = np.frombuffer(np.float16(sign * mag).tobytes(), dtype=np.uint8)
    return raw


def main():
    rng = np.random.default_rng(20240601)
    cases = []
    gemv_cases = []
    for t, fields in SCALE_FIELDS.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[t]
        raw = np.concatenate([random_blocks(rng, t, fields, N_BLOCKS),
                              random_blocks(rng, t, fields, 1, fill=0xFF),
                              random_blocks(rng, t, fields, 1, fill=0x80)])
        values = quants.dequantize(raw.reshape(-1), t)
        assert np.all(np.isfinite(values))
        cases.append({"type": t.name, "block_size": block_size, "type_size": type_size,
                      "raw_hex": raw.tobytes().hex(), "values": f32_list(values)})
        # GEMV: 3 rows of 2 blocks (32-element types: 4 blocks).
        per_row = 2 if block_size == 256 else 4
        raw = random_blocks(rng, t, fields, GEMV_ROWS * per_row)
        w = quants.dequantize(raw.reshape(-1), t).astype(np.float64).reshape(GEMV_ROWS, -1)
        x = rng.standard_normal(w.shape[1]).astype(np.float32)
        y = w @ x.astype(np.float64)
        gemv_cases.append({"type": t.name, "rows": GEMV_ROWS, "cols": int(w.shape[1]),
                           "raw_hex": raw.tobytes().hex(), "x": f32_list(x),
                           "y": [float(v) for v in y], "abs_y": [float(v) for v in np.abs(w) @ np.abs(x)]})
    for t, np_type in ((T.F16, np.float16), (T.BF16, None)):
        x = rng.standard_normal(64).astype(np.float32) * 3
        if np_type is not None:
            raw = x.astype(np.float16).view(np.uint8)
        else:  # bf16: top half of the f32 bits, rounded to nearest even
            bits = x.view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            raw = bits.view(np.uint8)
        values = quants.dequantize(raw, t)
        cases.append({"type": t.name, "block_size": 1, "type_size": 2,
                      "raw_hex": raw.tobytes().hex(), "values": f32_list(values)})
    json.dump({"generator": "tools/reference/make_quant_fixture.py",
               "reference": f"gguf-py {importlib.metadata.version('gguf')} gguf.quants.dequantize",
               "cases": cases, "gemv_cases": gemv_cases}, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
