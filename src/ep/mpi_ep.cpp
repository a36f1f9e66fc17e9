// CPU expert parallelism over MPI (built when CMake finds MPI).
#include <mpi.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "cpu/moe_cpu.h"
#include "moeinfer/ep.h"

namespace moeinfer {

bool ep_built_with_mpi() { return true; }

Status ep_init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return {};
  if (MPI_Init(argc, argv) != MPI_SUCCESS) return unavailable("MPI_Init failed");
  return {};
}

namespace {

// Initialised and not yet finalised: the only state in which MPI may be called.
bool mpi_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

}  // namespace

void ep_finalize() {
  if (mpi_running()) MPI_Finalize();
}

int ep_rank() {
  int rank = 0;
  if (mpi_running()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int ep_size() {
  int size = 1;
  if (mpi_running()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

int ep_local_rank() {
  if (!mpi_running()) return 0;
  static const int local = [] {
    MPI_Comm host;
    int rank = 0;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host) != MPI_SUCCESS) return 0;
    MPI_Comm_rank(host, &rank);
    MPI_Comm_free(&host);
    return rank;
  }();
  return local;
}

Status ep_broadcast(void* data, int64_t bytes) {
  if (!mpi_running()) return {};
  if (bytes < 0 || bytes > INT32_MAX) return invalid_argument(fmt::format("ep_broadcast of {} bytes", bytes));
  if (MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
    return Status(StatusCode::kInternal, "MPI_Bcast from rank 0 failed");
  }
  return {};
}

namespace {

double reduce_double(double v, MPI_Op op) {
  if (!mpi_running()) return v;
  double out = v;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, op, MPI_COMM_WORLD);
  return out;
}

}  // namespace

double ep_max(double v) { return reduce_double(v, MPI_MAX); }
double ep_min(double v) { return reduce_double(v, MPI_MIN); }
void ep_barrier() {
  if (mpi_running()) MPI_Barrier(MPI_COMM_WORLD);
}

void ep_sleeping_barrier() {
  if (!mpi_running()) return;
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  for (int done = 0;;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::unique_ptr<Backend>> make_cpu_ep_backend(EpStats* stats) {
  if (!mpi_running()) return unavailable("expert parallelism needs MPI initialised (ep_init) in every rank");
  CpuEpConfig ep;
  ep.rank = ep_rank();
  ep.ranks = ep_size();
  ep.reduce = [stats](std::span<float> out) -> Status {
    const double start = MPI_Wtime();
    if (MPI_Allreduce(MPI_IN_PLACE, out.data(), static_cast<int>(out.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) !=
        MPI_SUCCESS) {
      return Status(StatusCode::kInternal, "MPI_Allreduce of the partial outputs failed");
    }
    if (stats != nullptr) {
      stats->reduce_seconds += MPI_Wtime() - start;
      ++stats->reduces;
    }
    return {};
  };
  return make_cpu_backend(std::move(ep));
}

}  // namespace moeinfer
