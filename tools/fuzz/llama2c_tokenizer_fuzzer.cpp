// libFuzzer target for the llama2.c tokenizer file (tok*.bin: int32 max_token_length, then
// per token f32 score, int32 length, bytes) and the sentencepiece-style tokenizer built
// from it: encode a fixed text and the input's own tail, decode every id.
//
// Input: byte 0 picks vocab_size (4 + byte, as the model would give it); byte 1 the length
// of a text to encode, taken from the end; the rest is the file. Seeds: make_seeds
// llama2c_tokenizer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/model/tokenizer.h"
#include "fuzz_file.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2 || size > (size_t{1} << 20)) return 0;
  const int32_t vocab = 4 + data[0];
  const size_t text_len = std::min<size_t>(data[1], size - 2);
  const std::string text(reinterpret_cast<const char*>(data + size - text_len), text_len);
  const std::string path = fuzz::fuzz_file(data + 2, size - 2 - text_len);
  try {
    const auto tok = tokenizer_from_llama2c(path, vocab);
    for (const std::string& t : {std::string("Hello world, caf\xC3\xA9 123\n"), text}) {
      const std::vector<int32_t> ids = tok->encode(t, true);
      (void)tok->decode(ids);
    }
    for (int32_t id = 0; id < vocab; ++id) (void)tok->decode_piece(id);
  } catch (const Error&) {
  }
  return 0;
}
