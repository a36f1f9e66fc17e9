// The test binary's main: backend-ops cases are registered at run time, once it is known which
// backends this machine has (a GPU may or may not be present).
#include <gtest/gtest.h>

#include "test_main.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  moeinfer::register_backend_ops_tests();
  return RUN_ALL_TESTS();
}
