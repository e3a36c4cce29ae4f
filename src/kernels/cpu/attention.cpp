// STUB
#include "cumulus/kernels/attention.h"
#include "cumulus/core/error.h"
namespace cumulus::cpu {
void attention_decode_dense(const DecodeAttnArgs&, ThreadPool&) { CUMULUS_FAIL("not implemented"); }
void attention_decode_sparse(const DecodeAttnArgs&, const Selection&, ThreadPool&) { CUMULUS_FAIL("not implemented"); }
}  // namespace cumulus::cpu
