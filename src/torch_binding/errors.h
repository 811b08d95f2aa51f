// Errors of the native ops: a bad argument (tensor_checks.h), a failed C ABI call, a bad expert
// id reported by an earlier call, an allocation that torch refused. Each is thrown as a C++
// exception and also kept, with its kind, as the calling thread's last error, because what
// Python sees of the exception depends on the PyTorch release: 2.11 raises std::invalid_argument
// as ValueError and the rest as RuntimeError, 2.15 raises every exception of a stable-ABI
// kernel as RuntimeError. fusemoe's Python entry points (ops._call) match a RuntimeError against
// the last error and re-raise the class the ctypes path raises: ValueError, FusemoeError or
// FusemoeOutOfMemoryError. A direct torch.ops.fusemoe.* call sees what PyTorch raised.
#pragma once

#include <cstdint>
#include <string>

namespace fusemoe::torch_binding {

enum class ErrorKind : int32_t {
  kFusemoe = 1,      // FusemoeError
  kOutOfMemory = 2,  // FusemoeOutOfMemoryError (also a torch.OutOfMemoryError)
  kArgument = 3,     // ValueError: thrown as std::invalid_argument
};

// Keeps (kind, message) as the thread's last error and throws it: std::invalid_argument for
// kArgument, else std::runtime_error.
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
