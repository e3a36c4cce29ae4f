// libFuzzer target for the llama2.c `.bin` loader (src/model/model_weights_llama2c.cpp):
// format detection (model_format_of), the 7-int32 header, the size it implies and the
// float32 tensors. Any outcome but a cumulus::Error or success is a bug.
//
// Built and run by tools/fuzz/run.sh; seeds from make_seeds llama2c.
#include <cstddef>
#include <cstdint>

#include "cumulus/core/error.h"
#include "cumulus/model/model_weights.h"
#include "fuzz_file.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (size_t{1} << 20)) return 0;
  const std::string path = fuzz::fuzz_file(data, size);
  try {
    if (model_format_of(path) != ModelFormat::llama2c) return 0;
    const ModelWeights w = model_weights_from_llama2c(path);
    (void)w.bytes();
  } catch (const Error&) {
  }
  return 0;
}
