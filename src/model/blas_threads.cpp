// BlasSingleThreaded (blas_threads.h): OpenBLAS at one thread while any holder lives.
#include "model/blas_threads.h"

#include <mutex>

extern "C" {
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);
}

namespace cumulus {
namespace {

std::mutex g_mutex;
int g_holders = 0;      // guarded by g_mutex
int g_saved_threads = 1;  // the count before the first holder, restored after the last

}  // namespace

BlasSingleThreaded::BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (g_holders++ == 0) {
    g_saved_threads = openblas_get_num_threads();
    if (g_saved_threads != 1) openblas_set_num_threads(1);
  }
}

BlasSingleThreaded::~BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (--g_holders == 0 && g_saved_threads != 1) openblas_set_num_threads(g_saved_threads);
}

}  // namespace cumulus
