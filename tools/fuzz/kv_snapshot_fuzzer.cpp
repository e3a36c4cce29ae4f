// libFuzzer target for the KV snapshot reader (src/kv/kv_snapshot.cpp): magic, version, every
// header field and its bounds, the file's size against what the fields imply, the checksum,
// the setup text, token ids, finite logits, queries, keys and values; then, for a snapshot
// that opens, its check against its own info and its restore into a cache of its shape (with
// the sliding windows its version 2 first tokens imply, then without).
// Any outcome but a cumulus::Error or success is a bug, and so is memory beyond libFuzzer's
// -rss_limit_mb (nothing may be allocated from a size the file merely claims).
//
// Input: one flag byte, then the file. An odd flag rewrites the file's trailing checksum
// before reading, so mutations reach the checks behind the checksum instead of all stopping
// at it; an even flag reads the bytes as they are.
//
// Built and run by tools/fuzz/run.sh; seeds from make_seeds kv_snapshot.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_snapshot.h"
#include "fuzz_file.h"

using namespace cumulus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (size_t{1} << 20)) return 0;
  std::vector<uint8_t> file(data + 1, data + size);
  if ((data[0] & 1) != 0 && file.size() >= 8) {
    uint32_t version = 0;
    if (file.size() >= 12) std::memcpy(&version, file.data() + 8, 4);
    const uint64_t h = kv_snapshot_checksum(file.data(), file.size() - 8, version);
    std::memcpy(file.data() + file.size() - 8, &h, 8);
  }
  try {
    const KvSnapshot snap = KvSnapshot::open(fuzz::fuzz_file(file.data(), file.size()));
    const KvSnapshotInfo& i = snap.info();
    snap.check(i);
    // The cache rounds every (layer, kv head) up to whole pages: skip restores whose pages
    // would pass 64 MiB (a 1 MiB file of one-token heads in 256-token pages).
    const uint64_t pages = (static_cast<uint64_t>(i.n_tokens) + i.page_size - 1) / i.page_size;
    const uint64_t cache_bytes =
        2 * static_cast<uint64_t>(i.n_layers) * i.n_kv_heads * pages * i.page_size * i.head_dim * 4;
    if (cache_bytes > (uint64_t{64} << 20)) return 0;
    // A cache whose sliding-window layers read what the file holds (a layer from token f > 0:
    // window n_tokens - f + 1), then one that keeps every token (which a file with such a
    // layer must refuse).
    std::vector<int> window;
    for (int f : i.first_token) window.push_back(f > 0 ? i.n_tokens - f + 1 : 0);
    KvCache windowed(Shape{i.n_layers, i.n_heads, i.n_kv_heads, i.head_dim},
                     {.page_size = i.page_size, .dtype = i.dtype, .max_tokens = i.n_tokens}, window);
    snap.restore(windowed);
    KvCache kv(Shape{i.n_layers, i.n_heads, i.n_kv_heads, i.head_dim},
               {.page_size = i.page_size, .dtype = i.dtype, .max_tokens = i.n_tokens});
    snap.restore(kv);
    float sum = 0;
    for (float x : snap.logits()) sum += x;
    for (int l = 0; l < i.n_layers; ++l)
      for (float x : snap.prompt_q(l)) sum += x;
    volatile float sink = sum;
    (void)sink;
  } catch (const Error&) {
  }
  return 0;
}
