// STUB: replaced by the KV cache implementation.
#include "cumulus/kv/kv_cache.h"
#include "cumulus/core/error.h"
namespace cumulus {
struct KvCache::HeadStore {};
KvCache::KvCache(const Shape& shape, const KvCacheOptions& options) : shape_(shape), options_(options) { CUMULUS_FAIL("not implemented"); }
KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;
int KvCache::n_tokens(int) const { CUMULUS_FAIL("not implemented"); }
void KvCache::append(int, const float*, const float*, int) { CUMULUS_FAIL("not implemented"); }
void KvCache::clear() {}
PagedHeadView KvCache::view(int, int) const { CUMULUS_FAIL("not implemented"); }
void KvCache::key_f32(int, int, int, float*) const { CUMULUS_FAIL("not implemented"); }
void KvCache::value_f32(int, int, int, float*) const { CUMULUS_FAIL("not implemented"); }
}  // namespace cumulus
