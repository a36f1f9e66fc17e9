// The fast CPU backend (internal; reached through make_backend(BackendKind::kCpu)).
#pragma once

#include <memory>

#include "moeinfer/backend.h"

namespace moeinfer {
std::unique_ptr<Backend> make_cpu_backend();
}  // namespace moeinfer
