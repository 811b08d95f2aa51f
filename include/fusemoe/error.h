// fusemoe's single exception type and the checks that raise it.
// FUSEMOE_CHECK(cond, msg) for argument/state checks; FUSEMOE_CUDA_CHECK for the CUDA runtime
// (a failure also names a device wait that timed out, if a kernel recorded one); messages carry
// file and line so a user's log points at the failing check.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fusemoe {

class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message)
      : std::runtime_error(format(file, line, message)) {}

 private:
  static std::string format(const char* file, int line, const std::string& message) {
    std::ostringstream out;
    out << "fusemoe error at " << file << ":" << line << ": " << message;
    return out.str();
  }
};

namespace detail {
// The description of a device wait that timed out since the last call (empty if none), for
// failed CUDA calls to name what the failed kernel waited for. Defined in the library.
std::string take_device_wait_report();
}  // namespace detail

}  // namespace fusemoe

// `message` is a stream expression: FUSEMOE_CHECK(k > 0, "top_k must be > 0, got " << k).
#define FUSEMOE_CHECK(cond, message)                              \
  do {                                                            \
    if (!(cond)) {                                                \
      std::ostringstream fusemoe_check_stream_;                   \
      fusemoe_check_stream_ << message;                           \
      throw ::fusemoe::Error(__FILE__, __LINE__, fusemoe_check_stream_.str()); \
    }                                                             \
  } while (0)

#define FUSEMOE_CUDA_CHECK(expr)                                                        \
  do {                                                                                  \
    cudaError_t fusemoe_cuda_status_ = (expr);                                          \
    if (fusemoe_cuda_status_ != cudaSuccess) {                                          \
      std::ostringstream fusemoe_check_stream_;                                         \
      fusemoe_check_stream_ << #expr << " failed: " << cudaGetErrorName(fusemoe_cuda_status_) \
                            << " (" << cudaGetErrorString(fusemoe_cuda_status_) << ")";  \
      const std::string fusemoe_wait_report_ = ::fusemoe::detail::take_device_wait_report(); \
      if (!fusemoe_wait_report_.empty()) fusemoe_check_stream_ << "; " << fusemoe_wait_report_; \
      throw ::fusemoe::Error(__FILE__, __LINE__, fusemoe_check_stream_.str());          \
    }                                                                                   \
  } while (0)
