// Status and Result<T>: the checked error type at every module boundary.
// Exceptions never cross a module boundary; a Status carries what failed,
// which id, and expected-vs-got in its message.
#pragma once

#include <fmt/format.h>

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace pd {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,    // bad input from a caller or the network
  kNotFound,           // unknown id, missing file
  kOutOfRange,         // index/offset/length outside a registered region or limit
  kFailedPrecondition, // right input, wrong state
  kResourceExhausted,  // no blocks, queue full, body too large
  kDeadlineExceeded,   // a wait ran past its deadline
  kUnavailable,        // peer gone, connection refused
  kAborted,            // cancelled by a caller
  kPermissionDenied,   // authentication failed
  kUnimplemented,      // a construct or mode we do not support (named in the message)
  kDataLoss,           // corrupt file or frame
  kInternal,           // a bug: an invariant broke
};

const char* error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message"
  std::string to_string() const;

  // Prefixes context ("while loading model.safetensors: ...") keeping the code.
  Status with_context(std::string_view context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

template <typename... Args>
Status make_error(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Status(code, fmt::format(format, std::forward<Args>(args)...));
}

#define PD_DEFINE_ERROR_FACTORY(Name, Code)                                    \
  template <typename... Args>                                                  \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {            \
    return Status(ErrorCode::Code, fmt::format(format, std::forward<Args>(args)...)); \
  }
PD_DEFINE_ERROR_FACTORY(invalid_argument, kInvalidArgument)
PD_DEFINE_ERROR_FACTORY(not_found, kNotFound)
PD_DEFINE_ERROR_FACTORY(out_of_range, kOutOfRange)
PD_DEFINE_ERROR_FACTORY(failed_precondition, kFailedPrecondition)
PD_DEFINE_ERROR_FACTORY(resource_exhausted, kResourceExhausted)
PD_DEFINE_ERROR_FACTORY(deadline_exceeded, kDeadlineExceeded)
PD_DEFINE_ERROR_FACTORY(unavailable, kUnavailable)
PD_DEFINE_ERROR_FACTORY(aborted, kAborted)
PD_DEFINE_ERROR_FACTORY(permission_denied, kPermissionDenied)
PD_DEFINE_ERROR_FACTORY(unimplemented, kUnimplemented)
PD_DEFINE_ERROR_FACTORY(data_loss, kDataLoss)
PD_DEFINE_ERROR_FACTORY(internal_error, kInternal)
#undef PD_DEFINE_ERROR_FACTORY

// Result<T>: a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : storage_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(storage_).ok() && "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(storage_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(storage_);
  }
  T& value() & { return std::get<T>(storage_); }
  const T& value() const& { return std::get<T>(storage_); }
  T&& value() && { return std::get<T>(std::move(storage_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace pd

#define PD_CONCAT_INNER(a, b) a##b
#define PD_CONCAT(a, b) PD_CONCAT_INNER(a, b)

#define PD_RETURN_IF_ERROR(expr)           \
  do {                                     \
    ::pd::Status pd_status_ = (expr);      \
    if (!pd_status_.ok()) return pd_status_; \
  } while (0)

#define PD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

#define PD_ASSIGN_OR_RETURN(lhs, expr) PD_ASSIGN_OR_RETURN_IMPL(PD_CONCAT(pd_result_, __LINE__), lhs, expr)
