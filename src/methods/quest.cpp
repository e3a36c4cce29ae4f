// STUB
#include "cumulus/methods/registry.h"
namespace cumulus {
void register_quest(Registry&) {}
}  // namespace cumulus
