// STUB
#include "cumulus/methods/registry.h"
namespace cumulus {
void register_dense(Registry&) {}
}  // namespace cumulus
