// The native ops' errors (errors.h).
#include "torch_binding/errors.h"

#include <stdexcept>

#include "fusemoe/fusemoe_c.h"

namespace fusemoe::torch_binding {
namespace {

struct LastError {
  ErrorKind kind{};
  std::string message;
};

LastError& last_error() {
  thread_local LastError error;
  return error;
}

// _capi._STATUS_NAMES.
const char* status_name(int32_t status) {
  switch (status) {
    case FUSEMOE_C_ERROR: return "error";
    case FUSEMOE_C_OUT_OF_MEMORY: return "out of memory";
    case FUSEMOE_C_INTERNAL: return "internal error";
  }
  return nullptr;
}

}  // namespace

void throw_error(ErrorKind kind, const std::string& message) {
  last_error() = LastError{kind, message};
  if (kind == ErrorKind::kArgument) throw std::invalid_argument(message);
  throw std::runtime_error(message);
}

std::string c_status_message(int32_t status) {
  const char* name = status_name(status);
  return std::string(fusemoe_c_last_error()) + " [" +
         (name != nullptr ? std::string(name) : "status " + std::to_string(status)) + "]";
}

void check_c_status(int32_t status) {
  if (status != FUSEMOE_C_OK) throw_error(ErrorKind::kFusemoe, c_status_message(status));
}

}  // namespace fusemoe::torch_binding

extern "C" const char* fusemoe_torch_last_error(int32_t* kind) {
  const auto& error = fusemoe::torch_binding::last_error();
  if (kind != nullptr) *kind = static_cast<int32_t>(error.kind);
  return error.message.c_str();
}
