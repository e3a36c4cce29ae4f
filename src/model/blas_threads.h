// OpenBLAS has one thread count for the whole process. A Session runs its matrix products
// inside its own ThreadPool's tasks (weight_matrix.h), so each OpenBLAS call must run on the
// thread that makes it: a session's prefill and decode hold a BlasSingleThreaded while they
// run. Nothing is set at construction, and the caller's count comes back when the last
// holder in the process ends (holders on several threads are counted together), so a
// program that uses OpenBLAS with its own thread count between session calls keeps it.
#pragma once

namespace cumulus {

class BlasSingleThreaded {
 public:
  BlasSingleThreaded();
  ~BlasSingleThreaded();
  BlasSingleThreaded(const BlasSingleThreaded&) = delete;
  BlasSingleThreaded& operator=(const BlasSingleThreaded&) = delete;
};

}  // namespace cumulus
