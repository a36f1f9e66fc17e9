// safetensors files: a memory-mapped reader with lazy access by tensor name, and a writer.
//
// Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping each tensor name
// to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the end of the header),
// optionally "__metadata__", then the data. A damaged file is refused with a named error.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moeinfer/status.h"

namespace moeinfer {

enum class Dtype : uint8_t { kF32, kF16, kBF16, kF8E4M3, kU8, kI32, kI64 };
const char* dtype_name(Dtype dtype);  // as safetensors spells it: "F32", "F8_E4M3", ...
int64_t dtype_size(Dtype dtype);

struct TensorView {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;

  int64_t numel() const;
  std::string shape_string() const;  // "[4, 16]"
  // The values converted to float (F32, F16, BF16, F8_E4M3, U8, I32, I64).
  std::vector<float> to_floats() const;
};

class SafetensorsFile {
 public:
  // Maps the file; every tensor's bytes stay valid while this object (or a copy) lives.
  static Result<SafetensorsFile> open(const std::string& path);
  // Parses an in-memory image (the fuzz target's entry); `bytes` must outlive the result.
  static Result<SafetensorsFile> parse(std::span<const uint8_t> bytes, std::string name);

  const std::string& path() const { return path_; }
  bool has(std::string_view name) const;
  Result<TensorView> get(std::string_view name) const;
  std::vector<std::string> names() const;

 private:
  struct Entry {
    Dtype dtype;
    std::vector<int64_t> shape;
    uint64_t begin;
    uint64_t end;
  };
  std::string path_;
  std::shared_ptr<const void> mapping_;  // keeps the mapped file alive
  std::span<const uint8_t> data_;        // the data section
  std::map<std::string, Entry, std::less<>> entries_;
};

// One tensor to write: raw little-endian bytes of `dtype` in row-major order.
struct TensorData {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
TensorData tensor_from_floats(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                              Dtype dtype = Dtype::kF32);  // F32 or BF16

// Writes the tensors (in the given order) to path, replacing it atomically.
Status write_safetensors(const std::string& path, const std::vector<TensorData>& tensors);

}  // namespace moeinfer
