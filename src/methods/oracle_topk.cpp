// STUB
#include "cumulus/methods/registry.h"
namespace cumulus {
void register_oracle_topk(Registry&) {}
}  // namespace cumulus
