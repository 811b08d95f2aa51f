// Host-side helpers of the sm90 launchers (see sm90_launch_common.h). The tensor-map encoder comes from
// the driver through the runtime's entry-point query, so nothing links -lcuda.
#include "launchers/sm90_launch_common.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <mutex>
#include <vector>

#include "fusemoe/error.h"

namespace fusemoe::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    FUSEMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                        cudaEnableDefault, &query));
    FUSEMOE_CHECK(query == cudaDriverEntryPointSuccess && fn != nullptr,
                  "cuTensorMapEncodeTiled not found in the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace

DeviceInfo device_info() {
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::vector<DeviceInfo> known;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const DeviceInfo& info : known) {
      if (info.device == device) return info;
    }
  }
  int major = 0, minor = 0;
  DeviceInfo info{device, 0, 0};
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  FUSEMOE_CHECK(major == 9 && minor == 0, "the sm90 kernels need a compute capability 9.0 GPU, device "
                                              << device << " is " << major << "." << minor);
  FUSEMOE_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
  FUSEMOE_CUDA_CHECK(
      cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  std::lock_guard<std::mutex> lock(mutex);
  known.push_back(info);
  return info;
}

void raise_smem_limit_once(const void* kernel, size_t limit_bytes, int device,
                           std::atomic<uint64_t>* configured) {
  const uint64_t device_bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (device_bit != 0 && (configured->load(std::memory_order_acquire) & device_bit)) return;
  FUSEMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(limit_bytes)));
  configured->fetch_or(device_bit, std::memory_order_acq_rel);
}

namespace {

// 2-D row-major map with boxes of [box_outer rows, box_inner elements].
// Rows are row_stride elements apart (inner for a dense matrix).
CUtensorMap encode_2d(const void* base, CUtensorMapDataType type, uint32_t element_bytes, uint64_t inner,
                      uint64_t outer, uint64_t row_stride, uint32_t box_inner, uint32_t box_outer,
                      CUtensorMapSwizzle swizzle, const char* name) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride * element_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FUSEMOE_CHECK(status == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed for " << name << " (CUresult "
                                                                            << status << ")");
  return map;
}

// 2-D row-major map with 128-byte-swizzled boxes of [box_outer rows, 128 bytes].
CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, uint32_t element_bytes,
                               uint64_t inner, uint64_t outer, uint32_t box_outer, const char* name) {
  return encode_2d(base, type, element_bytes, inner, outer, inner, kSwizzleBytes / element_bytes, box_outer,
                   CU_TENSOR_MAP_SWIZZLE_128B, name);
}

}  // namespace

CUtensorMap make_tensor_map_bf16(const void* base, uint64_t inner, uint64_t outer,
                                 uint32_t box_outer, const char* name) {
  static_assert(kTensorMapBoxInner * 2 == kSwizzleBytes, "a bf16 box row is one swizzle row");
  return make_tensor_map_2d(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, inner, outer, box_outer, name);
}

CUtensorMap make_tensor_map_bf16_rows(const void* base, uint64_t inner, uint64_t outer, uint64_t row_stride,
                                      uint32_t box_outer, const char* name) {
  return encode_2d(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, inner, outer, row_stride, kTensorMapBoxInner, box_outer,
                   CU_TENSOR_MAP_SWIZZLE_128B, name);
}

CUtensorMap make_store_tensor_map(const void* base, bool fp32, uint64_t inner, uint64_t outer,
                                  uint32_t box_outer, const char* name) {
  return fp32 ? make_tensor_map_2d(base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, inner, outer, box_outer, name)
              : make_tensor_map_2d(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, inner, outer, box_outer, name);
}

CUtensorMap make_tensor_map_fp8(const void* base, uint64_t inner, uint64_t outer, uint32_t box_outer,
                                const char* name) {
  return make_tensor_map_2d(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, inner, outer, box_outer, name);
}


}  // namespace fusemoe::sm90
