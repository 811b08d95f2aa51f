// Errors of the native ops that are not argument errors: a failed C ABI call, a bad expert id
// reported by an earlier call, an allocation that torch refused. Each is thrown as
// std::runtime_error (Python: RuntimeError) and also kept, with its kind, as the calling
// thread's last error: fusemoe's Python entry points (python/fusemoe/_native.py) match a
// RuntimeError against it and re-raise FusemoeError or FusemoeOutOfMemoryError, the classes the
// ctypes path raises. A direct torch.ops.fusemoe.* call sees the RuntimeError.
#pragma once

#include <cstdint>
#include <string>

namespace fusemoe::torch_binding {

enum class ErrorKind : int32_t {
  kFusemoe = 1,      // FusemoeError
  kOutOfMemory = 2,  // FusemoeOutOfMemoryError (also a torch.OutOfMemoryError)
};

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message);

// status: what a fusemoe_c_* call returned; throws unless FUSEMOE_C_OK, with the library's
// message and the kind suffix the ctypes path adds ("... [error]").
void check_c_status(int32_t status);

// The library's message of a failed call (status != FUSEMOE_C_OK), as check_c_status words it.
std::string c_status_message(int32_t status);

}  // namespace fusemoe::torch_binding

extern "C" {
// The calling thread's last error of the native ops ("" if none) and its ErrorKind (0 if none).
__attribute__((visibility("default"))) const char* fusemoe_torch_last_error(int32_t* kind);
}
