#!/usr/bin/env python3
"""Writes tests/data/smollm2_tokens.json: token ids that Hugging Face `tokenizers`
(pip install tokenizers) gives for varied texts with SmolLM2's real tokenizer.json. The
C++ test encodes the same texts with cumulus's byte-level BPE and compares exactly.

Usage (from the repository root):
  python3 tools/reference/make_tokenizer_fixture.py [--shared ../shared] > tests/data/smollm2_tokens.json
"""
import argparse
import hashlib
import json
import os
import sys

import tokenizers
from tokenizers import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\r\n",
    "mixed \t \n whitespace  \n\t end",
    "word \n next and x  \t  y",
    "1234567",
    "Pi is 3.14159 and e is 2.71828; 1,000,000 people in 2024.",
    "abc123def 4ever v2.0.1 0x1F 1e-5 -42 +7",
    "Unicode: caf\u00e9, na\u00efve, r\u00e9sum\u00e9, Z\u00fcrich, \u00c6r\u00f8sk\u00f8bing",
    "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "Emoji \U0001F600\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flags \U0001F1EF\U0001F1F5 \u2764\ufe0f",
    "def f(x):\n    return x**2 + 1  # square\n\n\nprint(f(3))\n",
    "int main() { std::vector<int> v{1,2,3}; for (auto& x : v) x *= 2; return 0; }",
    "I'm sure you've seen it; they'll say we'd done it, isn't it? DON'T SHOUT. She's here.",
    "'s 's'S 'll'LL 're've'd'm't it\u2019s curly",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5. \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0661\u0662\u0663 \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e, \u092f\u0939 \u090f\u0915 \u092a\u0930\u0940\u0915\u094d\u0937\u0923 \u0939\u0948\u0964 \u09e7\u09e8\u09e9",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start no close <|endoftext|>text<|im_end|",
    "Wait... what?!?! (yes) [no] {maybe} -- 'quoted' \"double\" `back` ;;; ...",
    "Visit https://example.com/path?q=1&x=y or mail me@example.org.",
    "\u2211 x\u00b2 + \u221ay \u2264 \u221e, \u03b1\u2192\u03b2, \u00bd \u00be \u216b \u00b2\u00b3",
    "bell\x07 \x1b[31mred\x1b[0m \x1c\x1c sep \x7f del",
    "a\u00a0b\u2003c\u3000\u3000d \u200bzero-width \u0085next",
    "",
    " ",
    "\n\n\n",
    "Pneumonoultramicroscopicsilicovolcanoconiosis aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "# Title\n\n- item one\n- item two\n\n**bold** _italic_ > quote",
]


def gutenberg_body(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n", text.index("*** START OF")) + 1
    end = text.index("*** END OF")
    return text[start:end]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))
    args = ap.parse_args()
    tok_path = os.path.join(args.shared, "data/models/smollm2-135m-instruct-meta/tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    texts = list(TEXTS)
    pride = gutenberg_body(os.path.join(args.shared, "data/text/pg1342_pride_and_prejudice.txt"))
    at = pride.index("It is a truth universally acknowledged")
    texts.append(pride[at:at + 4000])
    moby = gutenberg_body(os.path.join(args.shared, "data/text/pg2701_moby_dick.txt"))
    at = moby.index("Call me Ishmael")
    texts.append(moby[at:at + 1500])
    with open(os.path.join(args.shared, "data/text/tinyshakespeare_input.txt"), encoding="utf-8") as f:
        texts.append(f.read()[:1000])

    cases = [{"text": t, "ids": tok.encode(t).ids} for t in texts]
    with open(tok_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    json.dump({
        "generator": "tools/reference/make_tokenizer_fixture.py",
        "reference": f"huggingface tokenizers {tokenizers.__version__}, Tokenizer.encode(text).ids",
        "tokenizer_json_sha256": sha,
        "cases": cases,
    }, sys.stdout, ensure_ascii=True, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
