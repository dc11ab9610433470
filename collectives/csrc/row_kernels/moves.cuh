// The moves: gather, scatter and gather_sum's kernels and launches (moves.cu: their handlers).
#pragma once

#include "common.cuh"

namespace ep_comm::rows {
namespace {

// ---- gather -------------------------------------------------------------------------------------

template <typename V>
__global__ void __launch_bounds__(kThreads)
gather_kernel(const V* __restrict__ table, const int32_t* __restrict__ idx, V* __restrict__ out,
              int64_t n_table, int64_t m, int64_t units, int lanes) {
  const int rows_per_block = kThreads / lanes;
  const int lane = threadIdx.x % lanes;
  for (int64_t i = int64_t{blockIdx.x} * rows_per_block + threadIdx.x / lanes; i < m;
       i += int64_t{gridDim.x} * rows_per_block) {
    const int64_t r = idx[i];
    V* dst = out + i * units;
    if (r >= 0 && r < n_table) {
      const V* src = table + r * units;
      int64_t c = lane;
      for (; c + 3 * lanes < units; c += 4 * lanes) {  // four loads in flight, then four stores
        const V a = load_nc(src + c), b = load_nc(src + c + lanes),
                d = load_nc(src + c + 2 * lanes), e = load_nc(src + c + 3 * lanes);
        dst[c] = a;
        dst[c + lanes] = b;
        dst[c + 2 * lanes] = d;
        dst[c + 3 * lanes] = e;
      }
      for (; c < units; c += lanes) dst[c] = load_nc(src + c);
    } else if (r < 0) {
      for (int64_t c = lane; c < units; c += lanes) dst[c] = V{};
    }
  }
}

template <typename V>
cudaError_t launch_gather(cudaStream_t s, const void* table, const int32_t* idx, void* out,
                          int64_t n_table, int64_t m, int64_t row_bytes) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(V));
  const int lanes = lanes_for(units);
  gather_kernel<V><<<grid_for(m, kThreads / lanes), kThreads, 0, s>>>(
      static_cast<const V*>(table), idx, static_cast<V*>(out), n_table, m, units, lanes);
  return cudaGetLastError();
}

// ---- scatter ------------------------------------------------------------------------------------
// out[pos[n, k]] = table[n] for every k with pos[n, k] in [0, M); out[fill[f]] = 0 for fill[f] in
// [0, M); every other row left unwritten. Each table row is read once and written to each of its
// destinations (dispatch's expand: a received token row into its expert rows), so the traffic is
// the compulsory bytes: N rows read, the destination rows written.

template <typename V>
__global__ void __launch_bounds__(kThreads)
scatter_kernel(const V* __restrict__ table, const int32_t* __restrict__ pos,
               const int32_t* __restrict__ fill, V* __restrict__ out, int64_t n, int K,
               int64_t n_fill, int64_t m, int64_t units, int64_t stride, int lanes) {
  const int rows_per_block = kThreads / lanes;
  const int lane = threadIdx.x % lanes;
  for (int64_t i = int64_t{blockIdx.x} * rows_per_block + threadIdx.x / lanes; i < n + n_fill;
       i += int64_t{gridDim.x} * rows_per_block) {
    if (i >= n) {  // a row to zero
      const int64_t r = fill[i - n];
      if (r < 0 || r >= m) continue;
      V* dst = out + r * units;
      for (int64_t c = lane; c < units; c += lanes) dst[c] = V{};
      continue;
    }
    const int32_t* p = pos + i * K;
    if (!any_target(p, K, m)) continue;
    const V* src = table + i * stride;
    int64_t c = lane;
    for (; c + 3 * lanes < units; c += 4 * lanes) {  // four loads in flight, then K x four stores
      const V a = load_nc(src + c), b = load_nc(src + c + lanes),
              d = load_nc(src + c + 2 * lanes), e = load_nc(src + c + 3 * lanes);
      for (int k = 0; k < K; ++k) {
        const int64_t r = p[k];
        if (r < 0 || r >= m) continue;
        V* dst = out + r * units;
        dst[c] = a;
        dst[c + lanes] = b;
        dst[c + 2 * lanes] = d;
        dst[c + 3 * lanes] = e;
      }
    }
    for (; c < units; c += lanes) {
      const V a = load_nc(src + c);
      for (int k = 0; k < K; ++k) {
        const int64_t r = p[k];
        if (r >= 0 && r < m) out[r * units + c] = a;
      }
    }
  }
}

// row_bytes: bytes of an output row, read from byte `offset` of each `stride`-byte table row.
template <typename V>
cudaError_t launch_scatter(cudaStream_t s, const void* table, const int32_t* pos,
                           const int32_t* fill, void* out, int64_t n, int K, int64_t n_fill,
                           int64_t m, int64_t row_bytes, int64_t stride, int64_t offset) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(V));
  const int lanes = lanes_for(units);
  scatter_kernel<V><<<grid_for(n + n_fill, kThreads / lanes), kThreads, 0, s>>>(
      static_cast<const V*>(table) + offset / static_cast<int64_t>(sizeof(V)), pos, fill,
      static_cast<V*>(out), n, K, n_fill, m, units, stride / static_cast<int64_t>(sizeof(V)),
      lanes);
  return cudaGetLastError();
}

// ---- gather_sum --------------------------------------------------------------------------------

// One block per output row (grid-stride); each thread owns VEC consecutive columns at a time and
// adds the K slots in order: acc = w0*r0 + w1*r1 + ... exactly as the XLA reference sums them.
template <typename Tin, typename Tout, int VEC>
__global__ void __launch_bounds__(kThreads)
gather_sum_kernel(const Tin* __restrict__ table, const int32_t* __restrict__ idx,
                  const float* __restrict__ w, Tout* __restrict__ out, int64_t n_table, int64_t m,
                  int K, int64_t packs) {
  using In = Pack<Tin, VEC>;
  using Out = Pack<Tout, VEC>;
  const In* tab = reinterpret_cast<const In*>(table);
  Out* dst = reinterpret_cast<Out*>(out);
  for (int64_t row = blockIdx.x; row < m; row += gridDim.x) {
    const int32_t* ix = idx + row * K;
    const float* wr = w + row * K;
    for (int64_t c = threadIdx.x; c < packs; c += kThreads) {
      float acc[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
      for (int k = 0; k < K; ++k) {
        const int64_t r = ix[k];
        if (r < 0 || r >= n_table) continue;
        const float wk = wr[k];
        const In v = tab[r * packs + c];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += wk * to_f32(v.v[j]);
      }
      Out o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_f32<Tout>(acc[j]);
      dst[row * packs + c] = o;
    }
  }
}

template <typename Tin, typename Tout>
cudaError_t launch_gather_sum(cudaStream_t s, const void* table, const int32_t* idx,
                              const float* w, void* out, int64_t n_table, int64_t m, int K,
                              int64_t H) {
  constexpr int kVec = 16 / sizeof(Tin);  // 16-byte loads of the table
  const bool vec = H % kVec == 0 && aligned(table, 16) &&
                   aligned(out, sizeof(Tout) * kVec);
  if (vec) {
    gather_sum_kernel<Tin, Tout, kVec><<<grid_for(m, 1), kThreads, 0, s>>>(
        static_cast<const Tin*>(table), idx, w, static_cast<Tout*>(out), n_table, m, K, H / kVec);
  } else {
    gather_sum_kernel<Tin, Tout, 1><<<grid_for(m, 1), kThreads, 0, s>>>(
        static_cast<const Tin*>(table), idx, w, static_cast<Tout*>(out), n_table, m, K, H);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace ep_comm::rows
