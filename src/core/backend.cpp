#include "moeinfer/backend.h"

#include <fmt/format.h>

#include "cpu/moe_cpu.h"
#include "cuda/device.h"
#include "moeinfer/cuda.h"
#include "moeinfer/reference.h"

namespace moeinfer {

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kReference: return "reference";
    case BackendKind::kCpu: return "cpu";
    case BackendKind::kCuda: return "cuda";
  }
  return "?";
}

Result<BackendKind> parse_backend(std::string_view name) {
  for (BackendKind kind : {BackendKind::kAuto, BackendKind::kReference, BackendKind::kCpu, BackendKind::kCuda}) {
    if (name == backend_name(kind)) return kind;
  }
  return invalid_argument(fmt::format("unknown backend '{}' (expected reference, cpu, cuda or auto)", name));
}

namespace {

class ReferenceBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kReference; }
  Status forward(const Layer& layer, std::span<const float> x, int64_t n, std::span<float> out,
                 ForwardInfo* info) override {
    MOEINFER_RETURN_IF_ERROR(moe_forward_reference(layer, x, n, out));
    if (info != nullptr) {
      info->path = "reference";
      info->detail = "token by token, double accumulation";
    }
    return {};
  }
};

}  // namespace

std::vector<BackendAvailability> backend_availability() {
  std::vector<BackendAvailability> list;
  // Best first. An absent backend is reported with the reason, never faked by another.
  const CudaProbe probe = probe_cuda();
  if (!probe.compiled) {
    list.push_back({BackendKind::kCuda, false, "this build has no CUDA support (nvcc was not found when it was configured)"});
  } else if (probe.device_count == 0) {
    list.push_back({BackendKind::kCuda, false, fmt::format("no CUDA device is visible ({})", probe.error)});
  } else if (!probe.kernels_runnable) {
    list.push_back({BackendKind::kCuda, false,
                    fmt::format("{} is sm_{}{}, and this build's kernels target sm_90a", probe.name, probe.sm_major,
                                probe.sm_minor)});
  } else {
    list.push_back({BackendKind::kCuda, true, ""});
  }
  list.push_back({BackendKind::kCpu, true, ""});
  list.push_back({BackendKind::kReference, true, ""});
  return list;
}

Result<std::unique_ptr<Backend>> make_backend(BackendKind kind, const BackendOptions& options) {
  if (kind == BackendKind::kAuto) {
    for (const BackendAvailability& b : backend_availability()) {
      if (b.available) return make_backend(b.kind, options);
    }
    return unavailable("no backend is available");
  }
  if (options.path && kind != BackendKind::kCuda) {
    return invalid_argument(fmt::format("backend '{}' has no path '{}' (paths are a CUDA choice)", backend_name(kind),
                                        path_name(*options.path)));
  }
  if (kind == BackendKind::kReference) return std::unique_ptr<Backend>(new ReferenceBackend());
  if (kind == BackendKind::kCpu) return make_cpu_backend();
  for (const BackendAvailability& b : backend_availability()) {
    if (b.kind == kind && b.available && kind == BackendKind::kCuda) return make_cuda_backend(options.path);
    if (b.kind == kind && !b.available) {
      return unavailable(fmt::format("backend '{}': {}", backend_name(kind), b.reason));
    }
  }
  return internal_error(fmt::format("backend '{}' is listed as available but cannot be made", backend_name(kind)));
}

}  // namespace moeinfer
