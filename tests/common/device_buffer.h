// One owning device allocation for tests and benchmarks: upload, download, and the NaN poison
// (0xFF bytes: NaN in bf16 and fp32) that every output and workspace gets before a call, so an
// element a call fails to write shows up in the comparison.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "fusemoe/error.h"

namespace fusemoe::harness {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) FUSEMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));  // 256-byte aligned
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void swap(DeviceBuffer& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }

  // Done before it returns (also for work queued next on a non-blocking stream).
  template <typename T>
  static DeviceBuffer from(const std::vector<T>& host) {
    DeviceBuffer buffer(host.size() * sizeof(T));
    if (buffer.bytes_ > 0) {
      FUSEMOE_CUDA_CHECK(cudaMemcpy(buffer.ptr_, host.data(), buffer.bytes_, cudaMemcpyHostToDevice));
      FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
    }
    return buffer;
  }
  template <typename T>
  std::vector<T> to_host() const {
    std::vector<T> out(bytes_ / sizeof(T));
    if (bytes_ > 0) FUSEMOE_CUDA_CHECK(cudaMemcpy(out.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return out;
  }
  // Copies all of `other` (same size) on the device; done before it returns.
  void copy_from(const DeviceBuffer& other) {
    FUSEMOE_CHECK(other.bytes_ == bytes_, "copy_from: " << other.bytes_ << " bytes into " << bytes_);
    if (bytes_ == 0) return;
    FUSEMOE_CUDA_CHECK(cudaMemcpy(ptr_, other.ptr_, bytes_, cudaMemcpyDeviceToDevice));
    FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Queued on `stream`, ordered with the calls that follow on it.
  void poison(cudaStream_t stream) const {
    if (bytes_ > 0) FUSEMOE_CUDA_CHECK(cudaMemsetAsync(ptr_, 0xFF, bytes_, stream));
  }
  // Done before it returns: safe before work on any stream.
  void poison() const {
    if (bytes_ == 0) return;
    FUSEMOE_CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes_));
    FUSEMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fusemoe::harness
