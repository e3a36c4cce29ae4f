// libFuzzer target for the tokenizer built from GGUF metadata (tokenizer.ggml.*: model,
// tokens, scores, token types, merges, special ids) and its encode/decode on fuzzed text.
// gguf_fuzzer reaches this code only after a whole model; here the seeds hold tokenizer
// metadata alone and the text varies too.
//
// Input: byte 0 is the length of a text to encode, taken from the end; the rest is the GGUF
// file. Seeds: make_seeds gguf_tokenizer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/tokenizer.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (size_t{1} << 20)) return 0;
  const size_t text_len = std::min<size_t>(data[0], size - 1);
  const std::string text(reinterpret_cast<const char*>(data + size - text_len), text_len);
  try {
    const GgufFile f = GgufFile::from_bytes("fuzz.gguf", std::vector<uint8_t>(data + 1, data + size - text_len));
    const auto tok = tokenizer_from_gguf(f);
    for (const std::string& t : {std::string("Hello world, caf\xC3\xA9 123\n"), text}) {
      const std::vector<int32_t> ids = tok->encode(t, true);
      (void)tok->decode(ids);
      for (int32_t id : ids) (void)tok->decode_piece(id);
    }
  } catch (const Error&) {
  }
  return 0;
}
