// libFuzzer target for the GGUF reader and everything that consumes its output: the
// parser (header, metadata, tensor infos, alignment), the llama config and weight loader
// (dequantisation of every tensor type) and the tokenizer built from metadata. A file is
// untrusted input: any outcome but a cumulus::Error or success is a bug (ASan and UBSan
// turn out-of-bounds reads, overflows and leaks into crashes).
//
// Built and run by tools/fuzz/run.sh (clang, -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/tokenizer.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Larger inputs only slow the search down; real files are exercised by the tests.
  if (size > (size_t{1} << 20)) return 0;
  try {
    const GgufFile f = GgufFile::from_bytes("fuzz.gguf", std::vector<uint8_t>(data, data + size));
    try {
      const ModelWeights w = model_weights_from_gguf(f);
      (void)w;
    } catch (const Error&) {
    }
    try {
      const auto tok = tokenizer_from_gguf(f);
      const std::vector<int32_t> ids = tok->encode("Hello world, caf\xC3\xA9 123\n", true);
      (void)tok->decode(ids);
    } catch (const Error&) {
    }
  } catch (const Error&) {
  }
  return 0;
}
