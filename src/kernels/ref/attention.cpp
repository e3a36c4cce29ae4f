// STUB
#include "cumulus/kernels/attention.h"
#include "cumulus/core/error.h"
namespace cumulus {
void attention_decode_validate(const DecodeAttnArgs&, const Selection*) { CUMULUS_FAIL("not implemented"); }
namespace ref {
void attention_decode_dense(const DecodeAttnArgs&) { CUMULUS_FAIL("not implemented"); }
void attention_decode_sparse(const DecodeAttnArgs&, const Selection&) { CUMULUS_FAIL("not implemented"); }
}
}  // namespace cumulus
