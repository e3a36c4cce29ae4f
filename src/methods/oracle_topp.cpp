// STUB
#include "cumulus/methods/registry.h"
namespace cumulus {
void register_oracle_topp(Registry&) {}
}  // namespace cumulus
