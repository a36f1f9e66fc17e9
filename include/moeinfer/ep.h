// Expert parallelism (DESIGN.md section 6): each rank owns a contiguous slice of the routed
// experts; routing runs on every rank; a route to another rank's expert contributes zero here;
// the shared expert and the identity (zero) experts are added once, by rank 0; an all-reduce
// sums the partial outputs. The ranks are MPI processes (launched by mpirun): on CPUs MPI sums
// the outputs, on GPUs NCCL (cuda.h), one GPU per rank.
#pragma once

#include <memory>

#include "moeinfer/backend.h"
#include "moeinfer/status.h"

namespace moeinfer {

struct ExpertSlice {
  int begin = 0;  // first owned expert
  int end = 0;    // one past the last
  bool owns(int e) const { return e >= begin && e < end; }
};
// Rank r of `ranks`: contiguous, as even as possible; the first E % ranks ranks own one more.
ExpertSlice expert_slice(int num_experts, int rank, int ranks);

// MPI, when this build has it. ep_init may be called once per process; a build without MPI
// returns "unavailable" from ep_init and make_cpu_ep_backend.
bool ep_built_with_mpi();
Status ep_init(int* argc, char*** argv);
void ep_finalize();
int ep_rank();  // 0 before ep_init
int ep_size();  // 1 before ep_init
// This rank's index among the ranks on its host (0 before ep_init): which GPU it takes.
int ep_local_rank();
// Copies `bytes` bytes at `data` from rank 0 to every rank (collective); without MPI, or before
// ep_init, nothing to do.
Status ep_broadcast(void* data, int64_t bytes);

// Time this rank spent in the all-reduce of the partial outputs, over all calls so far.
struct EpStats {
  double reduce_seconds = 0;
  int64_t reduces = 0;
};

// The CPU backend running this rank's slice of every layer, with the partial outputs summed
// over MPI_COMM_WORLD: every rank returns the whole layer output. With `stats`, the all-reduce
// is timed into it (stats must outlive the backend).
Result<std::unique_ptr<Backend>> make_cpu_ep_backend(EpStats* stats = nullptr);

// Collectives over all ranks for the benchmark's bookkeeping; without MPI (or before ep_init)
// the identity.
double ep_max(double v);
double ep_min(double v);
void ep_barrier();
// A barrier whose waiting ranks sleep instead of spinning (MPI's own barrier polls a core),
// for waiting out another rank's measurement on a shared host.
void ep_sleeping_barrier();

}  // namespace moeinfer
