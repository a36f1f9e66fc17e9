#include "moeinfer/backend.h"

#include <fmt/format.h>

#include "cuda/device.h"
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
  // Best first. The CUDA and fast CPU backends are their own issues; until they land they are
  // reported as absent with the reason, never faked by another backend.
  const CudaProbe probe = probe_cuda();
  std::string cuda_reason;
  if (!probe.compiled) {
    cuda_reason = "this build has no CUDA support (nvcc was not found when it was configured)";
  } else if (probe.device_count == 0) {
    cuda_reason = fmt::format("no CUDA device is visible ({})", probe.error);
  } else {
    cuda_reason = fmt::format("{} CUDA device(s) found ({}, sm_{}{}), but the CUDA forward path is "
                              "not implemented yet",
                              probe.device_count, probe.name, probe.sm_major, probe.sm_minor);
  }
  list.push_back({BackendKind::kCuda, false, cuda_reason});
  list.push_back({BackendKind::kCpu, false, "the fast CPU backend is not implemented yet"});
  list.push_back({BackendKind::kReference, true, ""});
  return list;
}

Result<std::unique_ptr<Backend>> make_backend(BackendKind kind) {
  if (kind == BackendKind::kAuto) {
    for (const BackendAvailability& b : backend_availability()) {
      if (b.available) return make_backend(b.kind);
    }
    return unavailable("no backend is available");
  }
  if (kind == BackendKind::kReference) return std::unique_ptr<Backend>(new ReferenceBackend());
  for (const BackendAvailability& b : backend_availability()) {
    if (b.kind == kind && !b.available) {
      return unavailable(fmt::format("backend '{}': {}", backend_name(kind), b.reason));
    }
  }
  return internal_error(fmt::format("backend '{}' is listed as available but cannot be made", backend_name(kind)));
}

}  // namespace moeinfer
