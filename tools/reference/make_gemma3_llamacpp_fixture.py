#!/usr/bin/env python3
"""Writes tests/data/gemma3_llamacpp_logits.json: the golden output of llama.cpp on the
Gemma 3 270M Q4_K_M GGUF for the opening of Pride and Prejudice (Project
Gutenberg header stripped), at least 4096 tokens: the top-20 (token id, logit) at 12
positions (both sides of the 512-token sliding window among them) and the 32-token greedy
continuation after the whole excerpt, with llama.cpp's top-1 margin (top-1 minus top-2
logit) at each of its steps.

The token ids come from llama.cpp's own tokenizer on the same GGUF (`llamacpp_logits
--tokenize`, BOS added as the file's add_bos_token says); the test
(tests/test_model_gemma3_logits.cpp) first checks that cumulus's tokenizer gives exactly
these ids, then feeds the same ids to cumulus. The ids are given to llama.cpp in one batch
from position 0.

Build llama.cpp first: tools/reference/build_llamacpp.sh
Usage (from the repository root):
  python3 tools/reference/make_gemma3_llamacpp_fixture.py [--shared ../shared] \
      [--model models/gemma-3-270m-q4_k_m.gguf] > tests/data/gemma3_llamacpp_logits.json
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TOP_K = 20
TARGET_TOKENS = 4096
GREEDY = 32


def gutenberg_body(path):
    """The text between the START and END markers, as cumulus's text_strip_gutenberg."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n", text.index("*** START OF")) + 1
    end = text.index("*** END OF")
    return text[start:end].strip(" \r\n\t")


def run(args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--bin", default=os.path.join(
        os.environ.get("CUMULUS_REFERENCE_DIR", os.path.join(ROOT, ".reference")), "llamacpp-build", "bin",
        "llamacpp_logits"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    book = "data/text/pg1342_pride_and_prejudice.txt"
    body = gutenberg_body(os.path.join(args.shared, book))
    sep = "\r\n\r\n" if "\r\n\r\n" in body[:5000] else "\n\n"
    paragraphs = body.split(sep)

    def tokenize(text):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write(text)
            path = f.name
        try:
            return json.loads(run([args.bin, "--tokenize", args.model, path]))
        finally:
            os.unlink(path)

    # Whole paragraphs until the excerpt holds TARGET_TOKENS or more (about 4 characters a
    # token: grow by characters first, then check with the tokenizer).
    k = 1
    while len(sep.join(paragraphs[:k])) < TARGET_TOKENS * 4:
        k += 1
    while True:
        excerpt = sep.join(paragraphs[:k])
        ids = tokenize(excerpt)
        if len(ids) >= TARGET_TOKENS:
            break
        k += 1
    n = len(ids)
    assert TARGET_TOKENS <= n <= 6000, n
    positions = [0, 1, 7, 63, 510, 511, 512, 1500, 3000, n - 40, n - 10, n - 1]

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(" ".join(str(i) for i in ids))
        ids_path = f.name
    try:
        out = json.loads(run([args.bin, args.model, ids_path, ",".join(str(p) for p in positions), str(TOP_K),
                              str(args.threads), str(GREEDY)]))
    finally:
        os.unlink(ids_path)

    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    fixture = {
        "comment": "llama.cpp (vendored by llama-cpp-python, see tools/reference/build_llamacpp.sh) logits and greedy "
                   "continuation on Gemma 3 270M Q4_K_M; written by tools/reference/make_gemma3_llamacpp_fixture.py",
        "llama_cpp_python_version": os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36"),
        "model_sha256": sha,
        "source": book + " (Gutenberg header stripped), from its start",
        "excerpt": excerpt,
        "token_ids": ids,
        "top_k": TOP_K,
        "logits": out["logits"],
        "greedy": out["greedy"],
        "greedy_margin": out["greedy_margin"],
    }
    json.dump(fixture, sys.stdout, ensure_ascii=False, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
