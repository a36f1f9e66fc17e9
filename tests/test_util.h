// Helpers shared by the tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <stdexcept>
#include <vector>

#include "moeinfer/format.h"
#include "moeinfer/status.h"

namespace moeinfer::testing {

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::moeinfer::Status assert_ok_status_ = (expr);       \
    ASSERT_TRUE(assert_ok_status_.ok()) << assert_ok_status_.to_string(); \
  } while (0)

// Unwraps a Result in a test, failing the test (fatally) when it holds an error.
template <class T>
T take(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) throw std::runtime_error(r.status().to_string());
  return std::move(r).value();
}

// A BF16 matrix holding exactly these (bf16-representable) values.
inline QuantMatrix bf16_matrix(const std::vector<float>& values, int64_t rows, int64_t cols) {
  return take(QuantMatrix::quantize(values, rows, cols, QuantSpec{WeightFormat::kBF16}));
}

// An n x n diagonal matrix with `diag` on the diagonal.
inline std::vector<float> diagonal(int64_t n, float diag) {
  std::vector<float> m(static_cast<size_t>(n * n), 0.0f);
  for (int64_t i = 0; i < n; ++i) m[static_cast<size_t>(i * n + i)] = diag;
  return m;
}

// ||a - b|| / ||b||, with ||b|| floored at 1e-30.
inline double rel_l2(std::span<const float> a, std::span<const float> b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
inline double silu(double v) { return v * sigmoid(v); }

}  // namespace moeinfer::testing
