// The row kernels' shared pieces: launch sizing, error text, the float conversions and the
// vector packs the families' kernels use. Each family's kernels and launches live in its header
// (moves.cuh, layouts.cuh), included by the family's translation unit, which defines its XLA FFI
// handlers (handlers.def lists them), and by the selftest when a test build asks for it.
//
// Every kernel reads its indices on the device (no host round trip) and never reads or writes
// outside its buffers whatever the indices hold. Handlers return ffi::Error; nothing throws
// across the C ABI.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "call_shape.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ep_comm::rows {
namespace {

constexpr int kThreads = 256;

std::string cuda_str(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Blocks for a grid-stride loop over `work` units of `per_block`: enough to fill the GPU, no more.
int grid_for(int64_t work, int per_block) {
  static int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  const int64_t need = (work + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(need, int64_t{sms} * 16)));
}

// Threads that copy one row together: a warp for short rows, up to the whole block for long ones.
int lanes_for(int64_t units) {
  int lanes = 32;
  while (lanes < kThreads && int64_t{lanes} * 4 < units) lanes *= 2;
  return lanes;
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};


// A row's bytes read through the read-only cache.
template <typename V>
__device__ __forceinline__ V load_nc(const V* p) { return __ldg(p); }

// Whether a table row has a destination inside [0, m) among its K targets.
__device__ __forceinline__ bool any_target(const int32_t* p, int K, int64_t m) {
  bool any = false;
  for (int k = 0; k < K; ++k) any |= p[k] >= 0 && p[k] < m;
  return any;
}

// The operands every scatter's handler takes (scatter, scatter_dequant, scatter_fake_quant,
// scatter_quant): the table rows, each row's K target rows and the rows to zero.
inline auto scatter_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // table (N, ...): rows (FP8 wire rows: uint8 bytes)
      .Arg<ffi::Buffer<ffi::S32>>()   // pos (N, K)
      .Arg<ffi::Buffer<ffi::S32>>();  // fill (F,)
}

}  // namespace
}  // namespace ep_comm::rows
