// When the CPU code splits a loop over threads (OpenMP). Forking a team costs microseconds
// and, under oversubscription (tests run in parallel), far more; loops over fewer elements
// than this run on the calling thread.
#pragma once

#include <cstdint>

namespace moeinfer {
inline constexpr int64_t kParallelMinElements = int64_t{1} << 18;
}  // namespace moeinfer
