// Status and Result: how every moeinfer call reports failure.
//
// Nothing in moeinfer asserts or aborts on bad input. A call that cannot do what was asked
// returns a Status whose message names the problem in the user's terms, for example
// "top_k (12) > num_experts (8)".
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace moeinfer {

enum class StatusCode {
  kOk,
  kInvalidArgument,  // the request itself is wrong (shape, range, inconsistent fields)
  kUnsupported,      // valid, but no code path here implements it
  kNotFound,         // a named thing (preset, tensor, file) does not exist
  kIoError,          // the operating system refused a read or write
  kCorruptData,      // a file or tensor is damaged
  kUnavailable,      // the backend or device is absent from this build or machine
  kInternal,         // a bug in moeinfer
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "invalid argument: top_k (12) > num_experts (8)"
  std::string to_string() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string message) {
  return {StatusCode::kInvalidArgument, std::move(message)};
}
inline Status unsupported(std::string message) {
  return {StatusCode::kUnsupported, std::move(message)};
}
inline Status not_found(std::string message) { return {StatusCode::kNotFound, std::move(message)}; }
inline Status unavailable(std::string message) {
  return {StatusCode::kUnavailable, std::move(message)};
}
inline Status internal_error(std::string message) {
  return {StatusCode::kInternal, std::move(message)};
}

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : state_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(state_).ok()) {
      state_ = Status(StatusCode::kInternal, "Result constructed from an ok Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  Status status() const { return ok() ? Status() : std::get<Status>(state_); }

  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }

  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace moeinfer

// Early return on failure, for functions that return Status or Result<T>.
#define MOEINFER_RETURN_IF_ERROR(expr)              \
  do {                                              \
    ::moeinfer::Status moeinfer_status_ = (expr);   \
    if (!moeinfer_status_.ok()) return moeinfer_status_; \
  } while (0)
