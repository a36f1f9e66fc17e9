#pragma once

namespace moeinfer {
// Adds the backend-ops cases for every backend available at run time (test_backend_ops.cpp).
void register_backend_ops_tests();
}  // namespace moeinfer
