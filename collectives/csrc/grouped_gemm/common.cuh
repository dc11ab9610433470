// What the grouped GEMM's kernels share (impl.cuh's pointer-array passes and
// gather.cuh's fused forward): the architecture check, the fused kernels' CTA order
// and the zeroing of the rows past the groups.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep_comm::gemm::detail {

// The module holds sm_90a code only (CMake: CUDA_ARCHITECTURES 90a): whether this GPU runs it.
inline bool hopper() {
  static const bool yes = [] {
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
               cudaSuccess &&
           major == 9;
  }();
  return yes;
}

// The SMs of this process's first device (its Hopper GPUs alike): the persistent kernels'
// grids. 0 where it cannot be read.
inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
                   cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) ==
                       cudaSuccess
               ? sms
               : 0;
  }();
  return count;
}

// Group size `s` as every pass takes it, the groups before it holding `off` of the M rows: a
// negative size is 0, and the groups end at row M at the latest.
__host__ __device__ inline int64_t clamp_size(int64_t s, int64_t M, int64_t off) {
  return s < 0 ? 0 : (s > M - off ? M - off : s);
}

// The fused kernels' CTA order over their (row tile, column tile) grid: strips of kStrip row
// tiles, each strip walked one column tile at a time (its kStrip row tiles of column 0, then of
// column 1, ...), so the CTAs resident at once share a few A row tiles and each B column tile in
// L2, rather than each row tile streaming through the whole of B (A read once per strip, not once
// per column tile). CTA `cta` of tiles_m * tiles_n computes row tile m, column tile n.
constexpr int64_t kStrip = 8;
__host__ __device__ inline void strip_tile(int64_t cta, int64_t tiles_m, int64_t tiles_n,
                                           int64_t& m, int64_t& n) {
  const int64_t per_strip = kStrip * tiles_n;
  const int64_t first = cta / per_strip * kStrip;
  const int64_t height = tiles_m - first < kStrip ? tiles_m - first : kStrip;
  const int64_t r = cta % per_strip;
  m = first + r % height;
  n = r / height;
}

// Rows [the sum of the clamped group sizes, M) of a row-major (M, units * 16 bytes) output to
// zero, 16 bytes at a time; the sizes clamped as fill_groups does (a negative size is 0, the
// groups end at row M at the latest).
static __global__ void zero_past_groups_kernel(uint4* out, const int32_t* sizes, int64_t G,
                                               int64_t M, int64_t units) {
  __shared__ int64_t first;
  if (threadIdx.x == 0) {
    int64_t off = 0;
    for (int64_t i = 0; i < G; ++i) {
      off += clamp_size(sizes[i], M, off);
    }
    first = off;
  }
  __syncthreads();
  for (int64_t r = first + blockIdx.x; r < M; r += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) out[r * units + u] = uint4{0, 0, 0, 0};
  }
}

static void zero_past_groups(cudaStream_t stream, void* out, const int32_t* sizes, int64_t G,
                             int64_t M, int64_t row_bytes) {
  const int64_t units = row_bytes / 16;
  if (M <= 0 || units <= 0) return;
  zero_past_groups_kernel<<<unsigned(M < 4096 ? M : 4096), 128, 0, stream>>>(
      static_cast<uint4*>(out), sizes, G, M, units);
}

}  // namespace ep_comm::gemm::detail
