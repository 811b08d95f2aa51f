// Lays out 256-byte-aligned regions of one caller-owned workspace. With a null base it only
// counts bytes, so the same code sizes a workspace (workspace_bytes) and lays it out (the
// call), and the two cannot disagree.
#pragma once

#include <cstddef>

namespace fusemoe {

// 256 bytes: every region starts aligned for TMA (16 B) and for full memory transactions.
constexpr size_t align_workspace(size_t bytes) { return (bytes + 255) & ~size_t(255); }

class WorkspaceCarver {
 public:
  // Regions start after `reserved_bytes` (e.g. the routing plan, carved separately).
  WorkspaceCarver(void* base, size_t reserved_bytes)
      : base_(static_cast<char*>(base)), offset_(align_workspace(reserved_bytes)) {}

  // The next region of `bytes` bytes (nullptr when only counting).
  template <typename T = void>
  T* take(size_t bytes) {
    char* region = base_ ? base_ + offset_ : nullptr;
    offset_ += align_workspace(bytes);
    return reinterpret_cast<T*>(region);
  }

  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_;
};

}  // namespace fusemoe
