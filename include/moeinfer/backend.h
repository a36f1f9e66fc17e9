// Backends: the routes from a Layer and its inputs to the layer's output (DESIGN.md section 5).
// All of them compute what moe_forward_reference computes, within the tolerance of their
// arithmetic.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/plan.h"
#include "moeinfer/status.h"
#include "moeinfer/weights.h"

namespace moeinfer {

enum class BackendKind : uint8_t {
  kAuto,       // the best available
  kReference,  // CPU, double accumulation, the oracle
  kCpu,        // CPU, SIMD + threads
  kCuda,       // NVIDIA GPU
};
const char* backend_name(BackendKind kind);
Result<BackendKind> parse_backend(std::string_view name);

// What a forward call did, for display (`moeinfer run` prints it).
struct ForwardInfo {
  std::string path;    // e.g. "reference"
  std::string detail;  // e.g. "double accumulation, 9 experts touched"
  std::string plan;    // Plan::explain() where the backend plans
};

struct BackendOptions {
  std::optional<PathKind> path;  // force a path (CUDA); nullopt lets plan() choose
};

// One backend object serves one caller at a time: forward() keeps buffers and state (the
// prepared layer, workspaces) from call to call. Use one object per thread that calls.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  // Readies the layer for calls of up to max_tokens tokens (a GPU backend uploads it here),
  // reporting progress. forward() does this itself when it was not done.
  virtual Status prepare(const Layer& layer, int64_t max_tokens, const ProgressFn& progress) {
    (void)layer, (void)max_tokens, (void)progress;
    return {};
  }
  // x: [n, H] floats, out: [n, H]; both in host memory.
  virtual Status forward(const Layer& layer, std::span<const float> x, int64_t n,
                         std::span<float> out, ForwardInfo* info) = 0;
};

struct BackendAvailability {
  BackendKind kind;
  bool available;
  std::string reason;  // why not, when unavailable
};
// Every concrete backend, in order of preference for kAuto (best first).
std::vector<BackendAvailability> backend_availability();

// The backend of that kind, or a named refusal when this build or machine lacks it.
Result<std::unique_ptr<Backend>> make_backend(BackendKind kind, const BackendOptions& options = {});

}  // namespace moeinfer
