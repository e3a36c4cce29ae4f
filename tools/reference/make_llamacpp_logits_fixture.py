#!/usr/bin/env python3
"""Writes tests/data/smollm2_llamacpp_logits.json: the golden logits of llama.cpp on the
SmolLM2-135M-Instruct Q4_1 GGUF for a ~1K-token excerpt of Moby Dick (Project Gutenberg
header stripped): the top-20 (token id, logit) at 10 positions.

The token ids come from Hugging Face `tokenizers` (pip install tokenizers) with SmolLM2's
real tokenizer.json; the test (tests/test_model_logits.cpp) first checks that cumulus's own
tokenizer gives exactly these ids for the excerpt, then feeds the same ids to cumulus. The
ids are given to llama.cpp explicitly (tools/reference/llamacpp_logits.cpp), in one batch
from position 0, so both engines see identical input.

Build llama.cpp first: tools/reference/build_llamacpp.sh
Usage (from the repository root):
  python3 tools/reference/make_llamacpp_logits_fixture.py [--shared ../shared] \
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] > tests/data/smollm2_llamacpp_logits.json
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TOP_K = 20
TARGET_TOKENS = 1024


def gutenberg_body(path):
    """The text between the START and END markers, as cumulus's text_strip_gutenberg."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n", text.index("*** START OF")) + 1
    end = text.index("*** END OF")
    return text[start:end].strip(" \r\n\t")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--bin", default=os.path.join(
        os.environ.get("CUMULUS_REFERENCE_DIR", os.path.join(ROOT, ".reference")), "llamacpp-build", "bin",
        "llamacpp_logits"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    tok = Tokenizer.from_file(os.path.join(args.shared, "data/models/smollm2-135m-instruct-meta/tokenizer.json"))
    book = "data/text/pg2701_moby_dick.txt"
    body = gutenberg_body(os.path.join(args.shared, book))
    at = body.index("Call me Ishmael")
    # Whole paragraphs from "Call me Ishmael" until the excerpt holds TARGET_TOKENS or more.
    sep = "\r\n\r\n" if "\r\n\r\n" in body[at:at + 5000] else "\n\n"
    paragraphs = body[at:].split(sep)
    excerpt = paragraphs[0]
    for p in paragraphs[1:]:
        if len(tok.encode(excerpt, add_special_tokens=False).ids) >= TARGET_TOKENS:
            break
        excerpt = excerpt + sep + p
    ids = tok.encode(excerpt, add_special_tokens=False).ids
    n = len(ids)
    assert TARGET_TOKENS <= n <= 1600, n
    positions = [0, 1, 7, 63, 255, 511, 767, n - 40, n - 10, n - 1]

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(" ".join(str(i) for i in ids))
        ids_path = f.name
    try:
        out = subprocess.run([args.bin, args.model, ids_path, ",".join(str(p) for p in positions), str(TOP_K),
                              str(args.threads)], check=True, capture_output=True, text=True)
    finally:
        os.unlink(ids_path)
    logits = json.loads(out.stdout)

    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    fixture = {
        "comment": "llama.cpp (vendored by llama-cpp-python, see tools/reference/build_llamacpp.sh) logits on "
                   "SmolLM2-135M-Instruct Q4_1; written by tools/reference/make_llamacpp_logits_fixture.py",
        "llama_cpp_python_version": os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36"),
        "model_sha256": sha,
        "source": book + " (Gutenberg header stripped), from 'Call me Ishmael'",
        "excerpt": excerpt,
        "token_ids": ids,
        "top_k": TOP_K,
        "logits": logits,
    }
    json.dump(fixture, sys.stdout, ensure_ascii=False, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
