// Layers.WrongWayIncludeFails compiles this with the kernels layer's include path and
// expects the layer rule's #error (CMakeLists.txt, cumulus_layer): kernels may not use
// methods.
#include "cumulus/methods/method.h"
