// STUB
#include "cumulus/methods/registry.h"
namespace cumulus {
void register_streaming(Registry&) {}
}  // namespace cumulus
