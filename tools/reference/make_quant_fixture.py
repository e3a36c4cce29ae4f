#!/usr/bin/env python3
"""Writes tests/data/quant_reference.json: random ggml blocks of every type cumulus
dequantises, with the float32 values that gguf-py (the ggml project's own Python package,
`pip install gguf`) decodes them to. The C++ test decodes the same bytes and compares.

Block bytes are random except the f16 scale fields, which are set to sane values so the
reference holds no Inf/NaN.

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


def main():
    rng = np.random.default_rng(20240601)
    cases = []
    for t, fields in SCALE_FIELDS.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
        for b in range(N_BLOCKS):
            for off in fields:
                mag = np.float16(rng.uniform(2.0 ** -10, 2.0 ** -4))
                sign = -1 if (off == 0 and rng.random() < 0.3) else 1
                raw[b, off:off + 2] = np.frombuffer(np.float16(sign * mag).tobytes(), dtype=np.uint8)
        values = quants.dequantize(raw.reshape(-1), t)
        assert np.all(np.isfinite(values))
        cases.append({"type": t.name, "block_size": block_size, "type_size": type_size,
                      "raw_hex": raw.tobytes().hex(), "values": [float(v) for v in values]})
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
                      "raw_hex": raw.tobytes().hex(), "values": [float(v) for v in values]})
    json.dump({"generator": "tools/reference/make_quant_fixture.py",
               "reference": f"gguf-py {importlib.metadata.version('gguf')} gguf.quants.dequantize",
               "cases": cases}, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
