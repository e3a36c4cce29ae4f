// libFuzzer target for the trace reader (src/eval/trace.cpp): magic, version, the JSON
// header, its sizes against the file's real size, the records; and the KV cache built from
// record 0. Any outcome but a cumulus::Error or success is a bug, and so is memory beyond
// libFuzzer's -rss_limit_mb (the reader must not allocate what a header merely claims).
//
// Built and run by tools/fuzz/run.sh; seeds from make_seeds trace.
#include <cstddef>
#include <cstdint>

#include "cumulus/core/error.h"
#include "cumulus/eval/trace.h"
#include "fuzz_file.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (size_t{1} << 20)) return 0;
  try {
    const TraceFile t = trace_read(fuzz::fuzz_file(data, size));
    const KvCache kv = t.cache(0);
    (void)kv;
  } catch (const Error&) {
  }
  return 0;
}
