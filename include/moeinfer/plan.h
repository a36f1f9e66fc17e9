// Path selection (DESIGN.md section 5): a pure function from (layer, format, N, device) to the
// path that runs it, with the reasons, so it can be unit-tested and printed (--explain).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/format.h"
#include "moeinfer/layer.h"
#include "moeinfer/status.h"

namespace moeinfer {

enum class PathKind : uint8_t {
  kTokenMajor,   // router -> top-k -> gate/up of every route -> act/down of every route -> blend
  kPerRow,       // same routing; one thread per output row, scalar loads: any shape, slower
  kExpertMajor,  // same routing; routes grouped by expert on the device, tensor-core MMAs over
                 // each distinct expert's weights, read once per call
};
const char* path_name(PathKind path);  // "token-major", "per-row", "expert-major"
Result<PathKind> parse_path(std::string_view name);

struct DeviceDesc {
  int sm_major = 9;
  int sm_minor = 0;
};

struct Plan {
  PathKind path = PathKind::kTokenMajor;  // for calls of `crossover` tokens or more
  PathKind small_path = PathKind::kTokenMajor;  // for calls of fewer
  int64_t crossover = 1;
  int64_t max_tokens = 0;
  std::string config;                // the kernel configuration, one line
  std::vector<std::string> reasons;  // why this path, one line each

  PathKind path_for(int64_t tokens) const { return tokens < crossover ? small_path : path; }
  std::string explain() const;
};

// Limits of the CUDA paths that plan() checks.
inline constexpr int kCudaMaxRouterOutputs = 4096;  // router logits and keys live in shared memory
inline constexpr int kCudaMaxTopK = 64;
inline constexpr int kCudaMaxGroups = 64;
inline constexpr int64_t kTokenMajorVector = 8;    // token-major loads 8 weights at a time
inline constexpr int64_t kExpertMajorAlign = 16;   // expert-major: 16-row MMA tiles, 16-column steps
// Calls of fewer tokens than this run token-major where both paths can (measured: docs/PERF.md).
inline constexpr int64_t kExpertMajorCrossover = 1;

// Chooses the path for `max_tokens` tokens per call, or follows `forced` when it can run the
// layer; a forced path that cannot is a named refusal.
Result<Plan> plan_cuda(const LayerDesc& desc, QuantSpec spec, int64_t max_tokens, const DeviceDesc& device,
                       std::optional<PathKind> forced = std::nullopt);

}  // namespace moeinfer
