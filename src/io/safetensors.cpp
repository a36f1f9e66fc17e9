#include "moeinfer/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "moeinfer/format.h"

namespace moeinfer {

namespace {

using json = nlohmann::json;

// Limits that keep a hostile header from costing memory or time.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxJsonDepth = 4;          // {name: {shape: [dims]}} is depth 3
constexpr uint64_t kMaxDim = uint64_t{1} << 40;

struct DtypeInfo {
  const char* name;
  Dtype dtype;
  int64_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {"F32", Dtype::kF32, 4}, {"F16", Dtype::kF16, 2}, {"BF16", Dtype::kBF16, 2}, {"F8_E4M3", Dtype::kF8E4M3, 1},
    {"U8", Dtype::kU8, 1},   {"I32", Dtype::kI32, 4}, {"I64", Dtype::kI64, 8},
};

Status corrupt(const std::string& file, const std::string& message) {
  return Status(StatusCode::kCorruptData, fmt::format("{}: {}", file, message));
}

// Returns the offset of the first byte that breaks UTF-8, or -1.
int64_t invalid_utf8_at(std::span<const uint8_t> s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = s[i];
    size_t len;
    uint32_t min;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { len = 2; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { len = 3; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { len = 4; min = 0x10000; }
    else return static_cast<int64_t>(i);
    if (i + len > s.size()) return static_cast<int64_t>(i);
    uint32_t cp = c & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return static_cast<int64_t>(i);
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return static_cast<int64_t>(i);
    i += len;
  }
  return -1;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(mant), -24);
  else if (exp == 31) v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

}  // namespace

const char* dtype_name(Dtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

int64_t dtype_size(Dtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_string() const { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::vector<float> TensorView::to_floats() const {
  const auto n = static_cast<size_t>(numel());
  std::vector<float> out(n);
  const uint8_t* p = bytes.data();
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case Dtype::kF32: std::memcpy(&out[i], p + 4 * i, 4); break;
      case Dtype::kF16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[i] = half_to_float(h); break; }
      case Dtype::kBF16: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); out[i] = bf16_to_float(b); break; }
      case Dtype::kF8E4M3: out[i] = e4m3_to_float(p[i]); break;
      case Dtype::kU8: out[i] = p[i]; break;
      case Dtype::kI32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); out[i] = static_cast<float>(v); break; }
      case Dtype::kI64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); out[i] = static_cast<float>(v); break; }
    }
  }
  return out;
}

Result<SafetensorsFile> SafetensorsFile::parse(std::span<const uint8_t> bytes, std::string name) {
  if (bytes.size() < 8) {
    return corrupt(name, fmt::format("truncated: {} bytes, but a safetensors file starts with an 8-byte header length",
                                     bytes.size()));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<size_t>(i)];
  if (header_len > bytes.size() - 8) {
    return corrupt(name, fmt::format("header length {} runs past the end of the file ({} bytes)", header_len, bytes.size()));
  }
  if (header_len > kMaxHeaderBytes) {
    return corrupt(name, fmt::format("header length {} exceeds the {} byte limit", header_len, kMaxHeaderBytes));
  }
  const std::span<const uint8_t> header = bytes.subspan(8, header_len);
  if (const int64_t bad = invalid_utf8_at(header); bad >= 0) {
    return corrupt(name, fmt::format("header is not valid UTF-8 (byte {} of the header)", bad));
  }
  bool too_deep = false;
  json root = json::parse(header.begin(), header.end(),
                          [&](int depth, json::parse_event_t, json&) {
                            if (depth > kMaxJsonDepth) too_deep = true;
                            return !too_deep;
                          },
                          /*allow_exceptions=*/false);
  if (too_deep) return corrupt(name, fmt::format("header JSON nests deeper than {} levels", kMaxJsonDepth));
  if (root.is_discarded()) return corrupt(name, "header is not valid JSON");
  if (!root.is_object()) return corrupt(name, "header JSON is not an object");

  SafetensorsFile file;
  file.path_ = std::move(name);
  file.data_ = bytes.subspan(8 + header_len);
  const std::string& fname = file.path_;
  for (const auto& item : root.items()) {
    const std::string& key = item.key();  // named, not a structured binding: lambdas capture it
    const json& value = item.value();
    if (key == "__metadata__") {
      if (!value.is_object()) return corrupt(fname, "__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return corrupt(fname, fmt::format("__metadata__ entry '{}' is not a string", mk));
      }
      continue;
    }
    const auto bad = [&](const std::string& what) { return corrupt(fname, fmt::format("tensor '{}': {}", key, what)); };
    if (!value.is_object()) return bad("entry is not an object");
    const auto dtype_it = value.find("dtype");
    const auto shape_it = value.find("shape");
    const auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string()) return bad("missing or non-string dtype");
    if (shape_it == value.end() || !shape_it->is_array()) return bad("missing or non-array shape");
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      return bad("data_offsets must be an array of two integers");
    }
    Entry e{};
    const std::string dtype = dtype_it->get<std::string>();
    const DtypeInfo* info = nullptr;
    for (const DtypeInfo& d : kDtypes) {
      if (dtype == d.name) info = &d;
    }
    if (info == nullptr) return bad(fmt::format("unknown dtype '{}'", dtype));
    e.dtype = info->dtype;
    uint64_t numel = 1;
    for (const json& dim : *shape_it) {
      if (!dim.is_number_unsigned()) return bad("shape holds a value that is not a non-negative integer");
      const uint64_t d = dim.get<uint64_t>();
      if (d > kMaxDim || (d > 0 && numel > (uint64_t{1} << 62) / d)) return bad("shape is too large");
      numel *= d;
      e.shape.push_back(static_cast<int64_t>(d));
    }
    for (const json& o : *offsets_it) {
      if (!o.is_number_unsigned()) return bad("data_offsets holds a value that is not a non-negative integer");
    }
    e.begin = (*offsets_it)[0].get<uint64_t>();
    e.end = (*offsets_it)[1].get<uint64_t>();
    if (e.begin > e.end || e.end > file.data_.size()) {
      return bad(fmt::format("data_offsets [{}, {}] fall outside the data section ({} bytes)", e.begin, e.end,
                             file.data_.size()));
    }
    const uint64_t need = numel * static_cast<uint64_t>(info->size);
    if (need != e.end - e.begin) {
      return bad(fmt::format("shape [{}] of {} needs {} bytes, but data_offsets span {}", fmt::join(e.shape, ", "),
                             dtype, need, e.end - e.begin));
    }
    file.entries_.emplace(key, std::move(e));
  }
  // No two tensors may share bytes.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [k, e] : file.entries_) order.emplace_back(&k, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < order.size(); ++i) {
    const Entry& prev = *order[i - 1].second;
    const Entry& cur = *order[i].second;
    if (cur.begin < prev.end && cur.begin != cur.end) {
      return corrupt(fname, fmt::format("tensors '{}' and '{}' overlap (bytes [{}, {}) and [{}, {}))", *order[i - 1].first,
                                        *order[i].first, prev.begin, prev.end, cur.begin, cur.end));
    }
  }
  return file;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return Status(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                  fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(StatusCode::kIoError, fmt::format("{}: not a regular file", path));
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return corrupt(path, fmt::format("truncated: {} bytes, but a safetensors file starts with an 8-byte header length", size));
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return Status(StatusCode::kIoError, fmt::format("{}: mmap failed: {}", path, std::strerror(errno)));
  std::shared_ptr<const void> mapping(p, [size](const void* q) { munmap(const_cast<void*>(q), size); });
  Result<SafetensorsFile> file = parse(std::span<const uint8_t>(static_cast<const uint8_t*>(p), size), path);
  if (!file.ok()) return file.status();
  file->mapping_ = std::move(mapping);
  return file;
}

bool SafetensorsFile::has(std::string_view name) const { return entries_.find(name) != entries_.end(); }

Result<TensorView> SafetensorsFile::get(std::string_view name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) return not_found(fmt::format("{}: no tensor named '{}'", path_, name));
  const Entry& e = it->second;
  return TensorView{it->first, e.dtype, e.shape, data_.subspan(e.begin, e.end - e.begin)};
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [k, e] : entries_) out.push_back(k);
  return out;
}

TensorData tensor_from_floats(std::string name, std::vector<int64_t> shape, std::span<const float> values, Dtype dtype) {
  TensorData t{std::move(name), dtype, std::move(shape), {}};
  if (dtype == Dtype::kBF16) {
    t.bytes.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t b = bf16_from_float(values[i]);
      std::memcpy(&t.bytes[2 * i], &b, 2);
    }
  } else {
    t.dtype = Dtype::kF32;
    t.bytes.resize(values.size() * 4);
    std::memcpy(t.bytes.data(), values.data(), values.size() * 4);
  }
  return t;
}

Status write_safetensors(const std::string& path, const std::vector<TensorData>& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  for (const TensorData& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (static_cast<int64_t>(t.bytes.size()) != numel * dtype_size(t.dtype)) {
      return invalid_argument(fmt::format("tensor '{}': {} bytes for shape [{}] of {}", t.name, t.bytes.size(),
                                          fmt::join(t.shape, ", "), dtype_name(t.dtype)));
    }
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return Status(StatusCode::kIoError, fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const TensorData& t : tensors) ok = ok && std::fwrite(t.bytes.data(), 1, t.bytes.size(), f) == t.bytes.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status(StatusCode::kIoError, fmt::format("{}: write failed: {}", path, std::strerror(errno)));
  }
  return {};
}

}  // namespace moeinfer
