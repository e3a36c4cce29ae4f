// libFuzzer target for the tokenizers' running time and their encode_prefix, over real
// vocabularies (SmolLM2's byte-level BPE from tokenizer.json, stories260K's tok512.bin,
// read once from CUMULUS_SHARED_DIR) and long fuzzed text. run.sh runs it with a short
// per-input time limit (-timeout), so an input that tokenizes slowly -- a merge loop
// quadratic in a pre-token's length -- fails as a timeout, as a crash would.
//
// Input: byte 0 picks the tokenizer (bit 0) and the prefix length n for encode_prefix
// (the other bits); bytes 1-2 (little-endian) a repeat count r: the text is the rest of
// the input repeated r + 1 times, capped at 256 KiB, so long runs of one character are a
// few bytes away from any seed (a quadratic merge takes minutes on 256 KiB of one
// character; the tokenizers about a second of CPU there, sanitized). Checks:
// encode_prefix(text, n) is the first n ids of encode(text), and byte-level BPE decodes to
// the text.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/model/tokenizer.h"

using namespace cumulus;

namespace {

const std::vector<std::unique_ptr<Tokenizer>>& tokenizers() {
  static const std::vector<std::unique_ptr<Tokenizer>> toks = [] {
    std::vector<std::unique_ptr<Tokenizer>> t;
    const std::string shared = CUMULUS_SHARED_DIR;
    t.push_back(tokenizer_from_hf_json(shared + "/data/models/smollm2-135m-instruct-meta/tokenizer.json", 1, 2));
    t.push_back(tokenizer_from_llama2c(shared + "/data/models/stories260K/tok512.bin", 512));
    return t;
  }();
  return toks;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const Tokenizer& tok = *tokenizers()[data[0] & 1];
  const size_t n = data[0] >> 1;
  const size_t repeat = 1 + (data[1] | (size_t{data[2]} << 8));
  const std::string unit(reinterpret_cast<const char*>(data + 3), size - 3);
  std::string text;
  const size_t cap = size_t{256} << 10;
  for (size_t i = 0; i < repeat && text.size() < cap; ++i) text += unit;
  if (text.size() > cap) text.resize(cap);
  try {
    const std::vector<int32_t> ids = tok.encode(text, true);
    const std::vector<int32_t> prefix = tok.encode_prefix(text, true, n);
    if (!std::equal(prefix.begin(), prefix.end(), ids.begin(), ids.begin() + std::min(n, ids.size())) ||
        prefix.size() != std::min(n, ids.size()))
      std::abort();  // encode_prefix disagrees with encode
    if (tok.kind() == TokenizerKind::gpt2_bpe && tok.decode(std::vector<int32_t>(ids.begin() + 1, ids.end())) != text)
      std::abort();  // byte-level BPE is lossless
  } catch (const Error&) {
  }
  return 0;
}
