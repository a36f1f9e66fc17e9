// Built when CMake finds no MPI: expert parallelism reports itself unavailable.
#include "moeinfer/ep.h"

namespace moeinfer {

namespace {
Status no_mpi() { return unavailable("this build has no MPI (install libopenmpi-dev and reconfigure)"); }
}  // namespace

bool ep_built_with_mpi() { return false; }
Status ep_init(int*, char***) { return no_mpi(); }
void ep_finalize() {}
int ep_rank() { return 0; }
int ep_size() { return 1; }
int ep_local_rank() { return 0; }
Status ep_broadcast(void*, int64_t) { return {}; }
Result<std::unique_ptr<Backend>> make_cpu_ep_backend(EpStats*) { return no_mpi(); }
double ep_max(double v) { return v; }
double ep_min(double v) { return v; }
void ep_barrier() {}
void ep_sleeping_barrier() {}

}  // namespace moeinfer
