// Row kernels of dispatch and combine (GPU): the gathers that move token rows by index, as XLA FFI
// handlers. Python: collectives/row_kernels.py, which lowers the same ops to XLA elsewhere (the
// CPU reference these kernels must equal).
//
//   ep_comm_rows_gather      out[i] = table[idx[i]] for idx[i] in [0, N); zero for idx[i] < 0; left
//                            unwritten for idx[i] >= N (rows the caller calls unspecified: no
//                            memset of a worst-case buffer). Rows are bytes: any dtype, FP8 rows
//                            with their scales included.
//   ep_comm_rows_gather_sum  out[m] = sum_k w[m, k] * table[idx[m, k]], accumulated in float32 in
//                            k order, slots with an index outside [0, N) skipped (they add exactly
//                            nothing, even where the table holds NaN); written once in out's dtype.
//   ep_comm_rows_scatter     out[pos[n, k]] = table[n] (or its bytes [offset, offset + out's row
//                            width)) for pos[n, k] in [0, M), out[fill[f]] = 0
//                            for fill[f] in [0, M); other rows unwritten (dispatch's expand:
//                            each received row read once, written to each of its expert rows).
//   ep_comm_rows_scatter_dequant  scatter's FP8 form: each FP8 row (values, then block scales)
//                            read once, dequantized and written to its rows (the FP8 wire's
//                            receive side); rows as scatter's.
//   ep_comm_rows_scatter_fake_quant  scatter's rows after the FP8 wire's round trip (quantized
//                            and dequantized in registers; one rank, where nothing crosses a wire).
//   ep_comm_rows_scatter_quant  the same rows kept quantized: e4m3 codes and block scales written
//                            apart (return_quantized with one rank).
//   ep_comm_rows_empty       a buffer left uninitialised (an exchange's receive buffer).
//   ep_comm_rows_key_count   counts[c, k]: entries of chunk c (kRankChunk entries each) with key k
//                            (a key outside [0, num_keys) counts as num_keys - 1).
//   ep_comm_rows_key_rank    rank[i] = base[c, k] + the entries before i in chunk c with key k,
//                            order[rank[i]] = i: with base from the counts' scans, a stable
//                            counting sort (dispatch's expert-major layout, no radix sort).
//   ep_comm_rows_token_routes  dispatch's sender-side layout in one kernel: each token's routing
//                            row, destination ranks and the per-rank counts.
//   ep_comm_rows_local_layout  one rank's token routes and expert layout in one launch (decode
//                            sizes: T K <= 1024 and fewer than 1024 experts).
//   ep_comm_rows_expert_layout  dispatch's receive-side layout in three kernels: the counting
//                            sort of the received (row, expert) pairs into expert-major rows and
//                            every index the expand and the handle need (see below).
//
// Both read every index on the device (no host round trip) and never read or write outside their
// buffers whatever the indices hold. Handlers return ffi::Error; nothing throws across the C ABI.
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
#include "row_kernels.h"
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

// ---- gather -------------------------------------------------------------------------------------

template <typename V>
__device__ __forceinline__ V load_nc(const V* p) { return __ldg(p); }

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

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

ffi::Error Gather(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> idx,
                  ffi::Result<ffi::AnyBuffer> out) {
  const int64_t row_bytes = row_bytes_of(table), n_table = rows_of(table);
  const int64_t m = idx.element_count();
  if (row_bytes_of(*out) != row_bytes || rows_of(*out) != m ||
      out->element_type() != table.element_type()) {
    return ffi::Error::InvalidArgument(
        "ep_comm rows gather: the result must have one row of the table's type and width per "
        "index; got " + std::to_string(m) + " indices, table rows of " + std::to_string(row_bytes) +
        " bytes, result of " + std::to_string(rows_of(*out)) + " rows of " +
        std::to_string(row_bytes_of(*out)) + " bytes");
  }
  if (m == 0 || row_bytes == 0) return ffi::Error::Success();
  const void* t = table.untyped_data();
  void* o = out->untyped_data();
  const int32_t* ix = idx.typed_data();
  cudaError_t e;
  if (row_bytes % 16 == 0 && aligned(t, 16) && aligned(o, 16)) {
    e = launch_gather<uint4>(stream, t, ix, o, n_table, m, row_bytes);
  } else if (row_bytes % 8 == 0 && aligned(t, 8) && aligned(o, 8)) {
    e = launch_gather<uint2>(stream, t, ix, o, n_table, m, row_bytes);
  } else if (row_bytes % 4 == 0 && aligned(t, 4) && aligned(o, 4)) {
    e = launch_gather<uint32_t>(stream, t, ix, o, n_table, m, row_bytes);
  } else {
    e = launch_gather<uint8_t>(stream, t, ix, o, n_table, m, row_bytes);
  }
  if (e != cudaSuccess) return ffi::Error::Internal("ep_comm rows gather: launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- scatter ------------------------------------------------------------------------------------
// out[pos[n, k]] = table[n] for every k with pos[n, k] in [0, M); out[fill[f]] = 0 for fill[f] in
// [0, M); every other row left unwritten. Each table row is read once and written to each of its
// destinations (dispatch's expand: a received token row into its expert rows), so the traffic is
// the compulsory bytes: N rows read, the destination rows written.

// Whether a table row has a destination inside [0, m) among its K targets.
__device__ __forceinline__ bool any_target(const int32_t* p, int K, int64_t m) {
  bool any = false;
  for (int k = 0; k < K; ++k) any |= p[k] >= 0 && p[k] < m;
  return any;
}

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

ffi::Error Scatter(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> pos,
                   ffi::Buffer<ffi::S32> fill, ffi::Result<ffi::AnyBuffer> out, int64_t offset) {
  const std::string where = "ep_comm rows scatter: ";
  const int64_t stride = row_bytes_of(table), n = rows_of(table), m = rows_of(*out);
  const int64_t row_bytes = row_bytes_of(*out);
  const auto pdims = pos.dimensions();
  if (pdims.size() != 2 || pdims[0] != n) {
    return ffi::Error::InvalidArgument(where + "pos must be (N, K) for a table of " +
                                       std::to_string(n) + " rows");
  }
  if (out->element_type() != table.element_type() || offset < 0 ||
      offset + row_bytes > stride) {
    return ffi::Error::InvalidArgument(where + "the result must have the table's element type "
                                       "and its rows bytes [offset, offset + width) of a table "
                                       "row; got rows of " + std::to_string(row_bytes) +
                                       " bytes at offset " + std::to_string(offset) +
                                       " of table rows of " + std::to_string(stride));
  }
  const int K = static_cast<int>(pdims[1]);
  const int64_t n_fill = fill.element_count();
  if (row_bytes == 0 || m == 0 || (n * K == 0 && n_fill == 0)) return ffi::Error::Success();
  const void* t = table.untyped_data();
  void* o = out->untyped_data();
  const int32_t* p = pos.typed_data();
  const int32_t* f = fill.typed_data();
  auto fits = [&](int64_t a) {
    return row_bytes % a == 0 && stride % a == 0 && offset % a == 0 && aligned(t, a) &&
           aligned(o, a);
  };
  cudaError_t e;
  if (fits(16)) {
    e = launch_scatter<uint4>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, stride, offset);
  } else if (fits(8)) {
    e = launch_scatter<uint2>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, stride, offset);
  } else if (fits(4)) {
    e = launch_scatter<uint32_t>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, stride, offset);
  } else {
    e = launch_scatter<uint8_t>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, stride, offset);
  }
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- key_count / key_rank: a stable counting sort in two passes -----------------------------------
// Entries are cut into chunks of kRankChunk. key_count: per chunk, how many entries hold each key.
// The caller scans those counts (XLA: a cumsum over chunks and over keys) into base[c, k], the
// sorted position of chunk c's first entry with key k. key_rank: one warp per chunk walks its
// entries in order, 32 at a time; lanes with equal keys find each other (__match_any_sync), so an
// entry's rank is its key's running position plus its peers on lower lanes: stable, no atomics.
// A key outside [0, num_keys) counts as num_keys - 1. Nothing is read or written outside the
// buffers whatever key and base hold (a rank outside [0, M) writes no order entry).

constexpr int kRankChunk = 256;

// Chunks of kRankChunk entries covering m.
int64_t rank_chunks(int64_t m) { return (m + kRankChunk - 1) / kRankChunk; }

__device__ __forceinline__ int32_t clamp_key(int32_t k, int32_t num_keys) {
  return k >= 0 && k < num_keys ? k : num_keys - 1;
}

__global__ void __launch_bounds__(kThreads)
key_count_kernel(const int32_t* __restrict__ key, int32_t* __restrict__ counts, int64_t m,
                 int32_t num_keys) {
  extern __shared__ int32_t hist[];
  for (int32_t k = threadIdx.x; k < num_keys; k += blockDim.x) hist[k] = 0;
  __syncthreads();
  const int64_t first = int64_t{blockIdx.x} * kRankChunk;
  for (int j = threadIdx.x; j < kRankChunk; j += blockDim.x) {
    if (first + j < m) atomicAdd(&hist[clamp_key(key[first + j], num_keys)], 1);
  }
  __syncthreads();
  int32_t* row = counts + int64_t{blockIdx.x} * num_keys;
  for (int32_t k = threadIdx.x; k < num_keys; k += blockDim.x) row[k] = hist[k];
}

__global__ void __launch_bounds__(32)
key_rank_kernel(const int32_t* __restrict__ key, const int32_t* __restrict__ base,
                int32_t* __restrict__ rank, int32_t* __restrict__ order, int64_t m,
                int32_t num_keys) {
  extern __shared__ int32_t next_pos[];
  const int lane = threadIdx.x;
  const int32_t* row = base + int64_t{blockIdx.x} * num_keys;
  for (int32_t k = lane; k < num_keys; k += 32) next_pos[k] = row[k];
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
  const int64_t first = int64_t{blockIdx.x} * kRankChunk;
  for (int step = 0; step < kRankChunk; step += 32) {
    const int64_t i = first + step + lane;
    const bool valid = i < m;
    const int32_t k = valid ? clamp_key(key[i], num_keys) : num_keys;  // num_keys: no entry
    const unsigned peers = __match_any_sync(0xffffffffu, k);
    // (unsigned: a malformed base wraps instead of overflowing, as the XLA reference's int32)
    int32_t r = 0;
    if (valid) r = static_cast<int32_t>(static_cast<uint32_t>(next_pos[k]) + __popc(peers & below));
    __syncwarp();
    if (valid && lane == __ffs(peers) - 1) {
      next_pos[k] = static_cast<int32_t>(static_cast<uint32_t>(next_pos[k]) + __popc(peers));
    }
    __syncwarp();
    if (valid) {
      rank[i] = r;
      if (r >= 0 && r < m) order[r] = static_cast<int32_t>(i);
    }
  }
}

cudaError_t launch_key_count(cudaStream_t s, const int32_t* key, int32_t* counts, int64_t m,
                             int32_t num_keys) {
  const int64_t chunks = rank_chunks(m);
  if (chunks == 0) return cudaSuccess;
  key_count_kernel<<<static_cast<unsigned>(chunks), kThreads, num_keys * sizeof(int32_t), s>>>(
      key, counts, m, num_keys);
  return cudaGetLastError();
}

cudaError_t launch_key_rank(cudaStream_t s, const int32_t* key, const int32_t* base,
                            int32_t* rank, int32_t* order, int64_t m, int32_t num_keys) {
  const int64_t chunks = rank_chunks(m);
  if (chunks == 0) return cudaSuccess;
  key_rank_kernel<<<static_cast<unsigned>(chunks), 32, num_keys * sizeof(int32_t), s>>>(
      key, base, rank, order, m, num_keys);
  return cudaGetLastError();
}

// Keys whose running counts fit a block's shared memory (48 KiB without opting in).
constexpr int64_t kMaxRankKeys = 48 * 1024 / sizeof(int32_t);

ffi::Error KeyCount(cudaStream_t stream, ffi::Buffer<ffi::S32> key,
                    ffi::Result<ffi::Buffer<ffi::S32>> counts) {
  const std::string where = "ep_comm rows key_count: ";
  const int64_t m = key.element_count();
  const auto dims = counts->dimensions();
  const int64_t chunks = rank_chunks(m);
  if (key.dimensions().size() != 1 || dims.size() != 2 || dims[0] != chunks || dims[1] < 1 ||
      dims[1] > kMaxRankKeys) {
    return ffi::Error::InvalidArgument(
        where + "key must be 1-D and counts (ceil(M / " + std::to_string(kRankChunk) +
        "), num_keys) with 1 <= num_keys <= " + std::to_string(kMaxRankKeys) + " for M = " +
        std::to_string(m));
  }
  const cudaError_t e = launch_key_count(stream, key.typed_data(), counts->typed_data(), m,
                                         static_cast<int32_t>(dims[1]));
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

ffi::Error KeyRank(cudaStream_t stream, ffi::Buffer<ffi::S32> key, ffi::Buffer<ffi::S32> base,
                   ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const std::string where = "ep_comm rows key_rank: ";
  const int64_t m = key.element_count();
  const auto bdims = base.dimensions();
  const auto odims = out->dimensions();
  const int64_t chunks = rank_chunks(m);
  if (key.dimensions().size() != 1 || bdims.size() != 2 || bdims[0] != chunks || bdims[1] < 1 ||
      bdims[1] > kMaxRankKeys || odims.size() != 2 || odims[0] != 2 || odims[1] != m) {
    return ffi::Error::InvalidArgument(
        where + "key must be 1-D, base (ceil(M / " + std::to_string(kRankChunk) +
        "), num_keys) with 1 <= num_keys <= " + std::to_string(kMaxRankKeys) +
        " and the result (2, M) for M = " + std::to_string(m));
  }
  int32_t* o = out->typed_data();
  const cudaError_t e = launch_key_rank(stream, key.typed_data(), base.typed_data(), o, o + m, m,
                                        static_cast<int32_t>(bdims[1]));
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- expert_layout: dispatch's receive-side layout, fused ---------------------------------------
// From the routing of the received token rows (route (R, 2K) float32: K weights, then K global
// expert ids, -1 for none), rows [0, num_recv) received: each (row, k) pair's local expert (its id
// when L * me <= id < L * (me + 1), else none; a slot repeating an earlier slot's expert has none
// of its own and shares that slot's row), then a stable counting sort of the pairs by local
// expert (key L: none) into the first C rows of expert_x. Three kernels, where XLA needs two
// dozen fusions, each a few dependent memory round trips (no thread walks a loop of loads):
//   layout_count: a block per chunk of kLayoutChunk pairs; every thread loads one id (the row
//     straddling the chunk's start read into a halo), finds its slot's first slot with the same
//     expert in shared memory, and one warp ranks the chunk's keys in order (lanes with equal keys
//     find each other, __match_any_sync); counts per key stored key-major (key * chunks + chunk);
//   layout_scan: one block; the exclusive scan of the key-major counts, in shared-memory tiles,
//     is each (key, chunk)'s first sorted position (key-major order is the sorted order); then the
//     group sizes and the pairs routed here;
//   layout_place: a thread per pair; its expert row (its first slot's), expert_token, weights;
//     and the rows past the groups (expert_token R, the fill list).
// Scratch (an output XLA allocates): keys, ranks in chunk and first slots (M each), then the
// counts (later the bases) per key. Every write is bounded by its buffer whatever route holds.

constexpr int kLayoutChunk = 1024;  // pairs per chunk: the count kernel's block
constexpr int kScanThreads = 1024;
constexpr int kScanTile = 8 * kScanThreads;

struct LayoutArgs {
  const float* route;
  const int32_t* num_recv;
  const int32_t* me;
  int32_t* recv_pos;      // (R, K)
  int32_t* targets;       // (R, K)
  float* recv_w;          // (R, K)
  int32_t* expert_token;  // (C,)
  int32_t* sizes;         // (L,): group sizes
  int32_t* num_pairs;     // (1,): the pairs routed here (uncapped)
  int32_t* fill;          // (F,)
  int32_t* keys;          // scratch (M,): local expert of a first slot, else L
  int32_t* in_chunk;      // scratch (M,): rank among the chunk's pairs with the same key
  int32_t* first;         // scratch (M,): pair index of the slot's first slot, -1: no expert
  int32_t* counts;        // scratch (L + 1, chunks)
  int64_t rows, C, F, chunks;
  int32_t K, L;
  bool zero_fill;
};

int64_t layout_chunks(int64_t m) { return (m + kLayoutChunk - 1) / kLayoutChunk; }

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

// Local expert of pair i (row i / K, slot i % K), or -1 (not received, no expert, another rank's).
__device__ __forceinline__ int32_t local_expert(const LayoutArgs& a, int64_t i, int32_t recv,
                                                int32_t me) {
  const int64_t r = i / a.K;
  if (r >= recv) return -1;
  const int32_t gid = static_cast<int32_t>(a.route[r * 2 * a.K + a.K + i % a.K]);
  return gid >= 0 && gid / a.L == me ? gid % a.L : -1;
}

// One chunk of pairs (a block of kLayoutChunk threads, thread t: pair chunk * kLayoutChunk + t):
// the pair's key (its local expert if it is its row's first slot with it, L: another slot's or no
// expert here, L + 1: no pair), its rank among the chunk's pairs with that key, and the index of
// its row's first slot with its expert (-1: none); seen[k]: the chunk's pairs with key k.
struct PairCount {
  int32_t key, rank, src;
};

__device__ __forceinline__ PairCount layout_count_chunk(const LayoutArgs& a, int64_t chunk,
                                                      int32_t recv, int32_t me) {
  extern __shared__ int32_t smem[];  // seen (L + 1) | ids (K - 1 halo + chunk)
  const int32_t Kp = a.L + 1, halo = a.K - 1;
  int32_t* seen = smem;
  int32_t* ids = seen + Kp;
  const int t = threadIdx.x;
  const int64_t m = a.rows * a.K, first = chunk * kLayoutChunk, i = first + t;
  for (int32_t k = t; k < Kp; k += kLayoutChunk) seen[k] = 0;
  ids[halo + t] = i < m ? local_expert(a, i, recv, me) : -1;
  if (t < halo) ids[t] = first - halo + t >= 0 ? local_expert(a, first - halo + t, recv, me) : -1;
  __syncthreads();
  int32_t key = Kp, src = -1;  // Kp: no pair
  if (i < m) {
    const int32_t id = ids[halo + t];
    key = a.L;
    if (id >= 0) {
      int j = 0;
      const int k = static_cast<int>(i % a.K);
      while (j < k && ids[halo + t - k + j] != id) ++j;  // the row's slots before this one
      src = static_cast<int32_t>(i - k + j);
      if (j == k) key = id;
    }
  }
  // rank among the chunk's pairs with this key: lanes with equal keys find each other
  // (__match_any_sync, every warp at once), then the warps add their counts in order
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  const int lane = t % 32, warp = t / 32, leader = __ffs(peers) - 1;
  int32_t before = 0;
  for (int w = 0; w < kLayoutChunk / 32; ++w) {
    if (warp == w) {
      int32_t b = 0;
      if (key < Kp && lane == leader) {
        b = seen[key];
        seen[key] = b + __popc(peers);
      }
      before = __shfl_sync(0xffffffffu, b, leader);
    }
    __syncthreads();
  }
  const int32_t rank = before + __popc(peers & ((1u << lane) - 1u));
  __syncthreads();
  return PairCount{key, rank, src};
}

__global__ void __launch_bounds__(kLayoutChunk) layout_count_kernel(LayoutArgs a) {
  extern __shared__ int32_t smem[];  // (seen: layout_count_chunk's)
  const PairCount c = layout_count_chunk(a, blockIdx.x, *a.num_recv, *a.me);
  const int64_t i = int64_t{blockIdx.x} * kLayoutChunk + threadIdx.x;
  if (i < a.rows * a.K) {
    a.keys[i] = c.key;
    a.in_chunk[i] = c.rank;
    a.first[i] = c.src;
  }
  for (int32_t k = threadIdx.x; k <= a.L; k += kLayoutChunk) {
    a.counts[int64_t{k} * a.chunks + blockIdx.x] = smem[k];
  }
}

// Exclusive scan of v over the block (1024 threads); *total: the block's sum.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t v, int32_t* warp_sums,
                                                        int32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t incl = v;
  for (int d = 1; d < 32; d *= 2) {
    const int32_t u = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += u;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = warp_sums[lane];
    int32_t wi = w;
    for (int d = 1; d < 32; d *= 2) {
      const int32_t u = __shfl_up_sync(0xffffffffu, wi, d);
      if (lane >= d) wi += u;
    }
    warp_sums[lane] = wi - w;
    if (lane == 31) *total = wi;
  }
  __syncthreads();
  const int32_t out = warp_sums[warp] + incl - v;
  __syncthreads();  // (warp_sums reused by the next call)
  return out;
}

// A tile index skewed by one word per 32 (thread t's eight consecutive entries hit eight banks).
__device__ __forceinline__ int skew(int e) { return e + (e >> 5); }

// From the scanned counts: the group sizes (capped at expert_x's rows) and the pair count.
__device__ __forceinline__ void layout_sizes(const LayoutArgs& a) {
  for (int32_t k = threadIdx.x; k <= a.L; k += blockDim.x) {
    const int64_t start = a.counts[int64_t{k} * a.chunks];
    if (k == a.L) {
      *a.num_pairs = static_cast<int32_t>(start);  // pairs with an expert here
    } else {
      const int64_t room = min64(a.C - start, a.counts[int64_t{k + 1} * a.chunks] - start);
      a.sizes[k] = static_cast<int32_t>(room > 0 ? room : 0);
    }
  }
}

__global__ void __launch_bounds__(kScanThreads) layout_scan_kernel(LayoutArgs a) {
  __shared__ int32_t tile[kScanTile + kScanTile / 32];
  __shared__ int32_t warp_sums[32];
  __shared__ int32_t tile_total;
  constexpr int per = kScanTile / kScanThreads;
  const int t = threadIdx.x;
  const int64_t n = int64_t{a.L + 1} * a.chunks;
  int32_t carry = 0;
  for (int64_t base = 0; base < n; base += kScanTile) {
#pragma unroll
    for (int j = 0; j < per; ++j) {  // coalesced: every load in flight at once
      const int64_t e = base + j * kScanThreads + t;
      tile[skew(j * kScanThreads + t)] = e < n ? a.counts[e] : 0;
    }
    __syncthreads();
    int32_t sum = 0;
#pragma unroll
    for (int j = 0; j < per; ++j) sum += tile[skew(t * per + j)];
    int32_t run = carry + block_exclusive_scan(sum, warp_sums, &tile_total);
#pragma unroll
    for (int j = 0; j < per; ++j) {
      const int32_t c = tile[skew(t * per + j)];
      tile[skew(t * per + j)] = run;
      run += c;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < per; ++j) {
      const int64_t e = base + j * kScanThreads + t;
      if (e < n) a.counts[e] = tile[skew(j * kScanThreads + t)];
    }
    carry += tile_total;
    __syncthreads();
  }
  layout_sizes(a);  // (this block's writes: visible after the loop's last barrier)
}

// Expert row of pair i, a first slot (C: dropped, or past expert_x).
__device__ __forceinline__ int64_t layout_row(const LayoutArgs& a, int64_t i) {
  const int32_t key = a.keys[i];
  if (key < 0 || key >= a.L) return a.C;
  const int64_t pos = int64_t{a.counts[int64_t{key} * a.chunks + i / kLayoutChunk]} + a.in_chunk[i];
  return pos >= 0 && pos < a.C ? pos : a.C;
}

// Pair i's results: pos, the expert row of its row's first slot with its expert (C: none, or
// past expert_x), src that slot's pair index, w its weight here.
__device__ __forceinline__ void layout_put(const LayoutArgs& a, int64_t i, int32_t src,
                                           int64_t pos, float w) {
  a.recv_pos[i] = static_cast<int32_t>(pos);
  a.targets[i] = static_cast<int32_t>(src == i ? pos : a.C);
  a.recv_w[i] = w;
  if (src == i && pos < a.C) a.expert_token[pos] = static_cast<int32_t>(i / a.K);
}

// expert_token past the filled rows (the row past the tokens) and the fill list, from start by
// stride.
__device__ __forceinline__ void layout_tail(const LayoutArgs& a, int64_t filled, int64_t start,
                                            int64_t stride) {
  for (int64_t q = filled + start; q < a.C; q += stride) {
    a.expert_token[q] = static_cast<int32_t>(a.rows);
  }
  for (int64_t f = start; f < a.F; f += stride) {
    a.fill[f] = static_cast<int32_t>(a.zero_fill ? (f >= filled ? f : -1) : filled + f);
  }
}

// Placement of pairs start, start + stride, ... (and of expert_token's tail and the fill list).
__device__ __forceinline__ void layout_place(const LayoutArgs& a, int64_t start, int64_t stride) {
  const int64_t m = a.rows * a.K, filled = min64(*a.num_pairs, a.C);
  for (int64_t i = start; i < m; i += stride) {
    const int32_t src = a.first[i];
    const bool here = src >= 0 && src <= i;
    layout_put(a, i, src, here ? layout_row(a, src) : a.C,
               here ? a.route[(i / a.K) * 2 * a.K + i % a.K] : 0.0f);
  }
  layout_tail(a, filled, start, stride);
}

__global__ void __launch_bounds__(kThreads) layout_place_kernel(LayoutArgs a) {
  layout_place(a, int64_t{blockIdx.x} * blockDim.x + threadIdx.x, int64_t{gridDim.x} * blockDim.x);
}

// All three steps in one block when the pairs are one chunk and the keys fit the block (decode
// sizes: one launch, not three): the pairs' keys, ranks and first slots and the scanned counts
// stay in shared memory (the scratch output is not written).
__device__ __forceinline__ void layout_one_chunk(const LayoutArgs& a, int32_t recv, int32_t me) {
  extern __shared__ int32_t smem[];  // seen (L + 1) | ids (K - 1 + chunk): layout_count_chunk's
  __shared__ int32_t key[kLayoutChunk], start[kLayoutChunk + 1], warp_sums[32], total;
  const int t = threadIdx.x;
  const int64_t m = a.rows * a.K, i = t;
  const float w = i < m ? a.route[(i / a.K) * 2 * a.K + i % a.K] : 0.0f;  // (in flight early)
  const PairCount c = layout_count_chunk(a, 0, recv, me);
  // key k's first expert row: the exclusive scan of the counts (a pair's row: its key's start
  // plus its rank, kept in place of the key)
  const int32_t n_k = t <= a.L ? smem[t] : 0;
  const int32_t first_row = block_exclusive_scan(n_k, warp_sums, &total);
  if (t <= a.L) start[t] = first_row;
  __syncthreads();
  key[t] = c.key < a.L ? start[c.key] + c.rank : -1;  // the pair's expert row if it has one
  const int64_t num_pairs = start[a.L];
  const int64_t filled = min64(num_pairs, a.C);
  if (t < a.L) {
    const int64_t room = min64(a.C - start[t], int64_t{start[t + 1]} - start[t]);
    a.sizes[t] = static_cast<int32_t>(room > 0 ? room : 0);
  }
  if (t == 0) *a.num_pairs = static_cast<int32_t>(num_pairs);
  __syncthreads();
  if (i < m) {
    const bool here = c.src >= 0 && c.src <= i;
    const int64_t row = here ? key[c.src] : -1;
    layout_put(a, i, c.src, row >= 0 && row < a.C ? row : a.C, here ? w : 0.0f);
  }
  layout_tail(a, filled, t, kLayoutChunk);
}

__global__ void __launch_bounds__(kLayoutChunk) layout_one_chunk_kernel(LayoutArgs a) {
  layout_one_chunk(a, *a.num_recv, *a.me);
}

size_t layout_count_smem(int32_t K, int32_t L) {
  return (int64_t{L} + K + kLayoutChunk) * sizeof(int32_t);
}

cudaError_t launch_layout(cudaStream_t s, const LayoutArgs& a) {
  const int64_t m = a.rows * a.K;
  if (a.chunks == 1 && a.L < kLayoutChunk) {
    layout_one_chunk_kernel<<<1, kLayoutChunk, layout_count_smem(a.K, a.L), s>>>(a);
    return cudaGetLastError();
  }
  if (a.chunks > 0) {
    layout_count_kernel<<<static_cast<unsigned>(a.chunks), kLayoutChunk,
                          layout_count_smem(a.K, a.L), s>>>(a);
  }
  layout_scan_kernel<<<1, kScanThreads, 0, s>>>(a);
  layout_place_kernel<<<grid_for(std::max(m, std::max(a.C, a.F)), kThreads), kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

using S32Result = ffi::Result<ffi::Buffer<ffi::S32>>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

// The layout's results (R rows of K slots) into `a`, checked; the scratch is the caller's.
ffi::Error layout_results(const std::string& where, int64_t R, int64_t K, S32Result& recv_pos,
                          S32Result& targets, F32Result& recv_w, S32Result& expert_token,
                          S32Result& sizes, S32Result& num_pairs, S32Result& fill,
                          int64_t zero_fill, LayoutArgs& a) {
  a.rows = R;
  a.K = static_cast<int32_t>(K);
  const int64_t m = R * K;
  a.C = expert_token->element_count();
  a.L = static_cast<int32_t>(sizes->element_count());
  a.F = fill->element_count();
  a.chunks = layout_chunks(m);
  if (a.L < 1 || num_pairs->element_count() != 1 || K > kLayoutChunk ||
      layout_count_smem(a.K, a.L) > 48 * 1024 || recv_pos->element_count() != m ||
      targets->element_count() != m || recv_w->element_count() != m || a.C > INT32_MAX ||
      m > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        where + "results must be recv_pos, targets, recv_w (R, K), expert_token (C,), sizes "
        "(L,), num_pairs (1,) and fill (F,) for R K = " + std::to_string(m) + ", with K <= " +
        std::to_string(kLayoutChunk) + " and L + K + " + std::to_string(kLayoutChunk) +
        " <= 12288");
  }
  a.recv_pos = recv_pos->typed_data();
  a.targets = targets->typed_data();
  a.recv_w = recv_w->typed_data();
  a.expert_token = expert_token->typed_data();
  a.sizes = sizes->typed_data();
  a.num_pairs = num_pairs->typed_data();
  a.fill = fill->typed_data();
  a.zero_fill = zero_fill != 0;
  return ffi::Error::Success();
}

ffi::Error ExpertLayout(cudaStream_t stream, ffi::Buffer<ffi::F32> route,
                        ffi::Buffer<ffi::S32> num_recv, ffi::Buffer<ffi::S32> me,
                        S32Result recv_pos, S32Result targets, F32Result recv_w,
                        S32Result expert_token, S32Result sizes, S32Result num_pairs,
                        S32Result fill, S32Result scratch, int64_t zero_fill) {
  const std::string where = "ep_comm rows expert_layout: ";
  const auto rd = route.dimensions();
  if (rd.size() != 2 || rd[1] % 2 != 0 || rd[1] == 0 || num_recv.element_count() != 1 ||
      me.element_count() != 1) {
    return ffi::Error::InvalidArgument(where + "route must be (R, 2K) with K >= 1 and num_recv, "
                                       "me one value each");
  }
  LayoutArgs a{};
  ffi::Error err = layout_results(where, rd[0], rd[1] / 2, recv_pos, targets, recv_w,
                                  expert_token, sizes, num_pairs, fill, zero_fill, a);
  if (err.failure()) return err;
  const int64_t m = a.rows * a.K;
  if (scratch->element_count() != 3 * m + (int64_t{a.L} + 1) * a.chunks) {
    return ffi::Error::InvalidArgument(where + "scratch must be (3 M + (L + 1) ceil(M / " +
                                       std::to_string(kLayoutChunk) + "),) for M = R K = " +
                                       std::to_string(m));
  }
  a.route = route.typed_data();
  a.num_recv = num_recv.typed_data();
  a.me = me.typed_data();
  a.keys = scratch->typed_data();
  a.in_chunk = a.keys + m;
  a.first = a.in_chunk + m;
  a.counts = a.first + m;
  const cudaError_t e = launch_layout(stream, a);
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- token_routes: dispatch's sender-side layout, one kernel -----------------------------------
// Per token (ids (T, K) int32, weights (T, K) float32; E experts in contiguous blocks of L = E / n
// over n ranks): route (T, 2K) float32 = the weights then the ids of its valid slots (0 and -1
// elsewhere), dest (T, K) = the rank of each valid slot (n elsewhere), in_rank (T, n), first (T, K):
// a valid slot whose rank no earlier slot of the token has, counts (2n,): tokens per rank, then
// distinct (token, expert) pairs per rank, and invalid (1,): ids outside [-1, E). A block per
// chunk of whole tokens, a thread per slot.

constexpr int kRoutesThreads = 1024;

struct RoutesArgs {
  const int32_t* ids;  // (T, K)
  const float* w;      // (T, K)
  float* route;        // (T, 2K)
  int32_t* dest;       // (T, K)
  bool* in_rank;       // (T, n)
  bool* first;         // (T, K)
  int32_t* counts;     // (2n,)
  int32_t* invalid;    // (1,)
  int64_t T;
  int K;
  int32_t E, n;
};

// Block `block` of the token routes (tokens [block * per, (block + 1) * per), per = kRoutesThreads
// / K; thread s: slot s % K of token s / K); `only`: the only block, which writes the counts
// instead of adding them to zeroed sums.
__device__ __forceinline__ void token_routes_block(const RoutesArgs& r, int64_t block, bool only) {
  // one load round trip, the token's earlier slots from shared memory; the block's counts in
  // shared memory, then added to the (zeroed) global ones
  extern __shared__ int32_t smem[];  // tokens (n) | pairs (n) | chunk's ids
  const int32_t E = r.E, n = r.n;
  const int K = r.K;
  int32_t* cnt = smem;
  int32_t* sid = smem + 2 * n;
  for (int32_t q = threadIdx.x; q < 2 * n; q += blockDim.x) cnt[q] = 0;
  const int32_t L = E / n;
  const int64_t per = kRoutesThreads / K, slots = per * K;  // whole tokens per chunk
  const int64_t t0 = block * per;
  const int s = threadIdx.x;
  const int64_t t = t0 + s / K, i = t * K + s % K;
  const bool live = s < slots && t < r.T;
  const int32_t e = live ? r.ids[i] : -1;
  const float w = live ? r.w[i] : 0.0f;
  sid[s] = e;
  for (int64_t j = s; j < per * n; j += blockDim.x) {  // this chunk's tokens: no rank yet
    if (t0 + j / n < r.T) r.in_rank[(t0 + j / n) * n + j % n] = false;
  }
  __syncthreads();
  const int k = s % K;
  const bool valid = live && e >= 0 && e < E;
  const int32_t d = valid ? e / L : n;
  bool new_rank = valid, new_expert = valid;
  for (int j = 0; live && j < k; ++j) {
    const int32_t f = sid[s - k + j];
    new_expert &= f != e;
    new_rank &= !(f >= 0 && f < E && f / L == d);
  }
  if (live) {
    r.route[t * 2 * K + k] = valid ? w : 0.0f;
    r.route[t * 2 * K + K + k] = valid ? static_cast<float>(e) : -1.0f;
    r.dest[i] = d;
    r.first[i] = new_rank;
    if (new_rank) r.in_rank[t * n + d] = true;
  }
  // warp-aggregated shared counts (with one rank every slot adds to the same counter): the
  // lanes of one key elect a leader that adds their number; every thread takes part
  const unsigned lane = threadIdx.x & 31;
  const int32_t keys[2] = {new_rank ? d : -1, new_expert ? n + d : -1};
  for (const int32_t key : keys) {
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    if (key >= 0 && lane == static_cast<unsigned>(__ffs(peers) - 1)) {
      atomicAdd(&cnt[key], __popc(peers));
    }
  }
  const int bad = __syncthreads_count(live && e != -1 && !(e >= 0 && e < E));
  if (only) {  // its counts are the sums (no memset was needed)
    for (int32_t q = threadIdx.x; q < 2 * n; q += blockDim.x) r.counts[q] = cnt[q];
    if (threadIdx.x == 0) *r.invalid = bad;
    return;
  }
  for (int32_t q = threadIdx.x; q < 2 * n; q += blockDim.x) {
    if (cnt[q]) atomicAdd(&r.counts[q], cnt[q]);
  }
  if (threadIdx.x == 0 && bad) atomicAdd(r.invalid, bad);
}

__global__ void __launch_bounds__(kRoutesThreads) token_routes_kernel(RoutesArgs r) {
  token_routes_block(r, blockIdx.x, gridDim.x == 1);
}

size_t routes_smem(int32_t n) { return (2 * int64_t{n} + kRoutesThreads) * sizeof(int32_t); }

cudaError_t launch_routes(cudaStream_t s, const RoutesArgs& r) {
  // (sums over several blocks: zeroed first, then every block adds its counts; memsets are
  // stream work XLA can capture like the kernel. One block writes them: no memset)
  const int64_t per = kRoutesThreads / r.K, blocks = (r.T + per - 1) / per;
  if (blocks != 1) {
    cudaError_t z = cudaMemsetAsync(r.counts, 0, 2 * r.n * sizeof(int32_t), s);
    if (z == cudaSuccess) z = cudaMemsetAsync(r.invalid, 0, sizeof(int32_t), s);
    if (z != cudaSuccess || r.T == 0) return z;
  }
  token_routes_kernel<<<static_cast<unsigned>(blocks), kRoutesThreads, routes_smem(r.n), s>>>(r);
  return cudaGetLastError();
}

using PredResult = ffi::Result<ffi::Buffer<ffi::PRED>>;

// The token routes' operands and results into `r`, checked (n ranks: counts' length / 2).
ffi::Error routes_args(const std::string& where, ffi::Buffer<ffi::S32>& ids,
                       ffi::Buffer<ffi::F32>& weights, F32Result& route, S32Result& dest,
                       PredResult& in_rank, PredResult& first, S32Result& counts,
                       S32Result& invalid, int64_t num_experts, RoutesArgs& r) {
  const auto d = ids.dimensions();
  if (d.size() != 2 || weights.dimensions().size() != 2 || weights.dimensions()[0] != d[0] ||
      weights.dimensions()[1] != d[1]) {
    return ffi::Error::InvalidArgument(where + "ids and weights must be (T, K) each");
  }
  const int64_t T = d[0], K = d[1], n = counts->element_count() / 2;
  if (n < 1 || num_experts < n || num_experts % n != 0 || route->element_count() != 2 * T * K ||
      dest->element_count() != T * K || first->element_count() != T * K ||
      in_rank->element_count() != T * n || invalid->element_count() != 1 ||
      K < 1 || K > kRoutesThreads || (2 * n + kRoutesThreads) * 4 > 48 * 1024 ||
      num_experts > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        where + "results must be route (T, 2K), dest (T, K), in_rank (T, n), first (T, K), "
        "counts (2n,) and invalid (1,), with n dividing num_experts = " +
        std::to_string(num_experts) + ", n <= 5631 and 1 <= K <= " +
        std::to_string(kRoutesThreads));
  }
  r = RoutesArgs{ids.typed_data(), weights.typed_data(), route->typed_data(), dest->typed_data(),
                 in_rank->typed_data(), first->typed_data(), counts->typed_data(),
                 invalid->typed_data(), T, static_cast<int>(K),
                 static_cast<int32_t>(num_experts), static_cast<int32_t>(n)};
  return ffi::Error::Success();
}

ffi::Error TokenRoutes(cudaStream_t stream, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::F32> weights, F32Result route, S32Result dest,
                       PredResult in_rank, PredResult first, S32Result counts,
                       S32Result invalid, int64_t num_experts) {
  const std::string where = "ep_comm rows token_routes: ";
  RoutesArgs r{};
  ffi::Error err = routes_args(where, ids, weights, route, dest, in_rank, first, counts, invalid,
                               num_experts, r);
  if (err.failure()) return err;
  const cudaError_t e = launch_routes(stream, r);
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- local_layout: one rank's token routes and expert layout in one block ----------------------
// With one rank (no exchange: the receive buffer is x, row t token t) and one block's worth of
// pairs (T K <= kLayoutChunk, E < kLayoutChunk), the token routes then the layout of their route
// (received rows: all T, this rank: 0) in one launch (decode sizes: one kernel, not two).

__global__ void __launch_bounds__(kLayoutChunk) local_layout_kernel(RoutesArgs r, LayoutArgs a) {
  token_routes_block(r, 0, true);
  __syncthreads();  // (the route: visible to the block after the barrier)
  layout_one_chunk(a, static_cast<int32_t>(r.T), 0);
}

bool local_layout_fits(int64_t T, int64_t K, int64_t E) {
  return T * K <= kLayoutChunk && E < kLayoutChunk && K >= 1;
}

cudaError_t launch_local_layout(cudaStream_t s, const RoutesArgs& r, const LayoutArgs& a) {
  const size_t smem = std::max(routes_smem(r.n), layout_count_smem(a.K, a.L));
  local_layout_kernel<<<1, kLayoutChunk, smem, s>>>(r, a);
  return cudaGetLastError();
}

ffi::Error LocalLayout(cudaStream_t stream, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::F32> weights, F32Result route, S32Result dest,
                       PredResult in_rank, PredResult first, S32Result counts,
                       S32Result invalid, S32Result recv_pos, S32Result targets,
                       F32Result recv_w, S32Result expert_token, S32Result sizes,
                       S32Result num_pairs, S32Result fill, int64_t zero_fill) {
  const std::string where = "ep_comm rows local_layout: ";
  RoutesArgs r{};
  ffi::Error err = routes_args(where, ids, weights, route, dest, in_rank, first, counts, invalid,
                               sizes->element_count(), r);
  if (err.failure()) return err;
  LayoutArgs a{};
  err = layout_results(where, r.T, r.K, recv_pos, targets, recv_w, expert_token, sizes,
                       num_pairs, fill, zero_fill, a);
  if (err.failure()) return err;
  if (r.n != 1 || !local_layout_fits(r.T, r.K, r.E)) {
    return ffi::Error::InvalidArgument(
        where + "one rank with T K <= " + std::to_string(kLayoutChunk) + " and num_experts < " +
        std::to_string(kLayoutChunk) + ", got " + std::to_string(r.n) + " ranks, T K = " +
        std::to_string(r.T * r.K) + " and " + std::to_string(r.E) + " experts");
  }
  a.route = r.route;
  const cudaError_t e = launch_local_layout(stream, r, a);
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- gather_sum ---------------------------------------------------------------------------------

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

template <typename Tin>
cudaError_t gather_sum_out(ffi::DataType out_type, cudaStream_t s, const void* table,
                           const int32_t* idx, const float* w, void* out, int64_t n_table,
                           int64_t m, int K, int64_t H) {
  switch (out_type) {
    case ffi::DataType::F32: return launch_gather_sum<Tin, float>(s, table, idx, w, out, n_table, m, K, H);
    case ffi::DataType::BF16: return launch_gather_sum<Tin, __nv_bfloat16>(s, table, idx, w, out, n_table, m, K, H);
    case ffi::DataType::F16: return launch_gather_sum<Tin, __half>(s, table, idx, w, out, n_table, m, K, H);
    default: return cudaErrorInvalidValue;
  }
}

bool summable(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

ffi::Error GatherSum(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> idx,
                     ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  const auto idims = idx.dimensions();
  const auto tdims = table.dimensions();
  const auto odims = out->dimensions();
  const std::string where = "ep_comm rows gather_sum: ";
  if (idims.size() != 2 || weights.dimensions().size() != 2 ||
      weights.dimensions()[0] != idims[0] || weights.dimensions()[1] != idims[1]) {
    return ffi::Error::InvalidArgument(where + "idx and weights must both be (M, K)");
  }
  if (tdims.size() != 2 || odims.size() != 2 || odims[0] != idims[0] || odims[1] != tdims[1]) {
    return ffi::Error::InvalidArgument(where + "table must be (N, H) and the result (M, H)");
  }
  if (!summable(table.element_type()) || !summable(out->element_type())) {
    return ffi::Error::InvalidArgument(where + "table and result must be float32, bfloat16 or "
                                       "float16");
  }
  const int64_t m = idims[0], H = tdims[1], n_table = tdims[0];
  const int K = static_cast<int>(idims[1]);
  if (m == 0 || H == 0) return ffi::Error::Success();
  const void* t = table.untyped_data();
  void* o = out->untyped_data();
  const int32_t* ix = idx.typed_data();
  const float* w = weights.typed_data();
  cudaError_t e;
  switch (table.element_type()) {
    case ffi::DataType::F32: e = gather_sum_out<float>(out->element_type(), stream, t, ix, w, o, n_table, m, K, H); break;
    case ffi::DataType::BF16: e = gather_sum_out<__nv_bfloat16>(out->element_type(), stream, t, ix, w, o, n_table, m, K, H); break;
    default: e = gather_sum_out<__half>(out->element_type(), stream, t, ix, w, o, n_table, m, K, H); break;
  }
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- scatter_dequant ----------------------------------------------------------------------------
// FP8 rows as dispatch sends them (ep_comm.wire.pack_rows): H e4m3 bytes, then the row's block
// scales (float32, 4 bytes each: "e4m3"; one E8M0 byte each: "mxfp8", 255 = NaN). One pass, as
// scatter's: read a row once, dequantize it (value * scale in float32, NaN for the whole block
// where the scale is NaN, one rounding to the output dtype) and write it to each of its rows.

template <bool kMx>
__device__ __forceinline__ float block_scale(const uint8_t* scales, int64_t b) {
  if constexpr (kMx) {
    const int e = scales[b];
    return e == 255 ? __int_as_float(0x7fc00000) : ldexpf(1.0f, e - 127);
  } else {
    float v;
    memcpy(&v, scales + 4 * b, 4);
    return v;
  }
}

// value * scale in float32; a product below 2**-126 is signed zero (as ep_comm.wire says: no
// step depends on whether a platform flushes subnormals)
__device__ __forceinline__ float dequant1(uint8_t byte, float s) {
  __nv_fp8_e4m3 f;
  f.__x = byte;
  const float r = static_cast<float>(f) * s;
  return isnan(s) ? __int_as_float(0x7fc00000)
                  : fabsf(r) < 1.1754943508222875e-38f ? copysignf(0.0f, r) : r;
}

template <typename Tout, bool kMx>
__global__ void __launch_bounds__(kThreads)
scatter_dequant_kernel(const uint8_t* __restrict__ table, const int32_t* __restrict__ pos,
                       const int32_t* __restrict__ fill, Tout* __restrict__ out, int64_t n, int K,
                       int64_t n_fill, int64_t m, int64_t row_bytes, int64_t H, int block,
                       bool vec) {
  for (int64_t i = blockIdx.x; i < n + n_fill; i += gridDim.x) {
    if (i >= n) {  // a row to zero
      const int64_t r = fill[i - n];
      if (r < 0 || r >= m) continue;
      for (int64_t j = threadIdx.x; j < H; j += kThreads) out[r * H + j] = from_f32<Tout>(0.0f);
      continue;
    }
    const int32_t* p = pos + i * K;
    if (!any_target(p, K, m)) continue;
    const uint8_t* src = table + i * row_bytes;
    if (vec) {  // kV values (16 output bytes) per thread and chunk, never straddling a block:
      // consecutive lanes store consecutive 16-byte pieces of each destination row
      constexpr int kV = 16 / sizeof(Tout);
      using Raw = Pack<uint8_t, kV>;
      for (int64_t c = threadIdx.x; c < H / kV; c += kThreads) {
        const Raw raw = reinterpret_cast<const Raw*>(src)[c];
        const float sc = block_scale<kMx>(src + H, c * kV / block);
        Pack<Tout, kV> o;
#pragma unroll
        for (int j = 0; j < kV; ++j) o.v[j] = from_f32<Tout>(dequant1(raw.v[j], sc));
        for (int k = 0; k < K; ++k) {
          const int64_t r = p[k];
          if (r >= 0 && r < m) reinterpret_cast<Pack<Tout, kV>*>(out + r * H)[c] = o;
        }
      }
    } else {
      for (int64_t j = threadIdx.x; j < H; j += kThreads) {
        const Tout v = from_f32<Tout>(dequant1(src[j], block_scale<kMx>(src + H, j / block)));
        for (int k = 0; k < K; ++k) {
          const int64_t r = p[k];
          if (r >= 0 && r < m) out[r * H + j] = v;
        }
      }
    }
  }
}

template <typename Tout>
cudaError_t launch_scatter_dequant(cudaStream_t s, const uint8_t* table, const int32_t* pos,
                                   const int32_t* fill, void* out, int64_t n, int K,
                                   int64_t n_fill, int64_t m, int64_t row_bytes, int64_t H,
                                   int block, bool mx) {
  const bool vec = H % 16 == 0 && row_bytes % 16 == 0 && block % 16 == 0 && aligned(table, 16) &&
                   aligned(out, 16);
  Tout* o = static_cast<Tout*>(out);
  if (mx) {
    scatter_dequant_kernel<Tout, true><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        table, pos, fill, o, n, K, n_fill, m, row_bytes, H, block, vec);
  } else {
    scatter_dequant_kernel<Tout, false><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        table, pos, fill, o, n, K, n_fill, m, row_bytes, H, block, vec);
  }
  return cudaGetLastError();
}

ffi::Error ScatterDequant(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> pos,
                          ffi::Buffer<ffi::S32> fill, ffi::Result<ffi::AnyBuffer> out,
                          int64_t block, int64_t mx) {
  const std::string where = "ep_comm rows scatter_dequant: ";
  const auto odims = out->dimensions();
  const auto pdims = pos.dimensions();
  const int64_t n = rows_of(table), row_bytes = row_bytes_of(table);
  if (table.element_type() != ffi::DataType::U8 || table.dimensions().size() != 2 ||
      odims.size() != 2 || pdims.size() != 2 || pdims[0] != n) {
    return ffi::Error::InvalidArgument(where + "table must be (N, row bytes) uint8, pos (N, K) "
                                       "and the result (M, H)");
  }
  const int64_t m = odims[0], H = odims[1];
  const int64_t nb = block > 0 ? (H + block - 1) / block : 0;
  if (block <= 0 || row_bytes < H + nb * (mx ? 1 : 4)) {
    return ffi::Error::InvalidArgument(where + "rows of " + std::to_string(row_bytes) +
                                       " bytes cannot hold " + std::to_string(H) +
                                       " values and their scales (block " +
                                       std::to_string(block) + ")");
  }
  const int K = static_cast<int>(pdims[1]);
  const int64_t n_fill = fill.element_count();
  if (m == 0 || H == 0 || (n * K == 0 && n_fill == 0)) return ffi::Error::Success();
  const uint8_t* t = static_cast<const uint8_t*>(table.untyped_data());
  const int32_t* p = pos.typed_data();
  const int32_t* f = fill.typed_data();
  void* o = out->untyped_data();
  const int blk = static_cast<int>(block);
  cudaError_t e;
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      e = launch_scatter_dequant<__nv_bfloat16>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, H,
                                                blk, mx);
      break;
    case ffi::DataType::F16:
      e = launch_scatter_dequant<__half>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, H, blk,
                                         mx);
      break;
    case ffi::DataType::F32:
      e = launch_scatter_dequant<float>(stream, t, p, f, o, n, K, n_fill, m, row_bytes, H, blk,
                                        mx);
      break;
    default:
      return ffi::Error::InvalidArgument(where + "the result must be bfloat16, float16 or float32");
  }
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- scatter_fake_quant -------------------------------------------------------------------------
// The FP8 wire's round trip without a wire (one rank: the receive buffer is x itself): each row of
// x read once, quantized per block exactly as the sender's XLA math does (ep_comm.wire: subnormal
// inputs as signed zero; e4m3: scale = max(amax * fl(1/448), 2**-126), x * (1 / scale) with IEEE
// division; mxfp8: exponent floor(log2 amax) - 8 clamped to [-126, 127] (-127: an all-zero
// block), x * 2**-e exactly;
// saturation at 448 keeping NaN; round to nearest even; a block holding Inf or NaN all NaN),
// dequantized as scatter_dequant does (value * scale in float32, one rounding to T) and written to
// each of its rows: the values dispatch delivers, with the traffic of a plain scatter. A thread
// owns 16 bytes (V values) of a row; the G = block / V threads of a block reduce its amax with
// shuffles.

// One thread's V values of a row quantized with the G - 1 lanes that share their block (every
// lane of the warp calls it in step; `valid` false: a lane past the row, which contributes
// nothing): the e4m3 codes, the block's scale (float32; NaN for a non-finite block) and, for MX,
// its biased exponent byte.
template <typename T, bool kMx, int V>
__device__ __forceinline__ void quantize_piece(const Pack<T, V>& raw, bool valid, int G,
                                               uint8_t (&codes)[V], float& scale,
                                               uint8_t& e8m0) {
  const float nan = __int_as_float(0x7fc00000), tiny = 1.1754943508222875e-38f;  // 2**-126
  float v[V];
  bool finite = true;
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float f = valid ? to_f32(raw.v[j]) : 0.0f;
    if (fabsf(f) < tiny) f = copysignf(0.0f, f);
    v[j] = f;
    const bool fin = isfinite(f);
    finite &= fin;
    amax = fmaxf(amax, fin ? fabsf(f) : 0.0f);
  }
  for (int o = G / 2; o > 0; o /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    finite = __shfl_xor_sync(0xffffffffu, static_cast<int>(finite), o) && finite;
  }
  float inv = 0.0f;
  int exponent = 0;
  if constexpr (!kMx) {
    scale = amax > 0.0f ? fmaxf(amax * (1.0f / 448.0f), tiny) : 1.0f;
    if (!finite) scale = nan;
    inv = 1.0f / scale;
  } else {
    int k = 0;
    frexpf(amax > 0.0f ? amax : 1.0f, &k);
    exponent = amax > 0.0f ? max(k - 1 - 8, -126) : -127;  // normal unless all zero
    exponent = min(exponent, 127);
    scale = finite ? ldexpf(1.0f, exponent) : nan;
    e8m0 = finite ? static_cast<uint8_t>(exponent + 127) : 255;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float q = kMx ? (finite ? ldexpf(v[j], -exponent) : nan) : v[j] * inv;
    if (!isnan(q)) q = fminf(fmaxf(q, -448.0f), 448.0f);
    codes[j] = __nv_fp8_e4m3(q).__x;
  }
}

template <typename T, bool kMx>
__global__ void __launch_bounds__(kThreads)
scatter_fake_quant_kernel(const T* __restrict__ table, const int32_t* __restrict__ pos,
                          const int32_t* __restrict__ fill, T* __restrict__ out, int64_t n, int K,
                          int64_t n_fill, int64_t m, int64_t H, int block) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  const int G = block / V;  // threads per quantization block: a power of two <= 32
  const int64_t units = H / V;
  for (int64_t i = blockIdx.x; i < n + n_fill; i += gridDim.x) {
    if (i >= n) {  // a row to zero
      const int64_t r = fill[i - n];
      if (r < 0 || r >= m) continue;
      for (int64_t c = threadIdx.x; c < units; c += kThreads) reinterpret_cast<P*>(out + r * H)[c] = P{};
      continue;
    }
    const int32_t* p = pos + i * K;
    if (!any_target(p, K, m)) continue;
    const uint4* src = reinterpret_cast<const uint4*>(table + i * H);
    for (int64_t base = 0; base < units; base += kThreads) {  // every lane of a warp in step
      const int64_t c = base + threadIdx.x;
      const bool valid = c < units;
      P raw{};
      if (valid) {
        const uint4 bits = load_nc(src + c);
        memcpy(&raw, &bits, sizeof(P));
      }
      uint8_t codes[V];
      float scale;
      uint8_t e8m0 = 0;
      quantize_piece<T, kMx, V>(raw, valid, G, codes, scale, e8m0);
      if (!valid) continue;
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = from_f32<T>(dequant1(codes[j], scale));
      for (int k = 0; k < K; ++k) {
        const int64_t r = p[k];
        if (r >= 0 && r < m) reinterpret_cast<P*>(out + r * H)[c] = o;
      }
    }
  }
}

// The same rows kept quantized (return_quantized with one rank): the e4m3 codes into `values`
// (M, H) bytes and each block's scale (float32 bytes, or the E8M0 byte) into `scales`
// (M, scale bytes), as the wire row's two column ranges scattered apart.
template <typename T, bool kMx>
__global__ void __launch_bounds__(kThreads)
scatter_quant_kernel(const T* __restrict__ table, const int32_t* __restrict__ pos,
                     const int32_t* __restrict__ fill, uint8_t* __restrict__ values,
                     uint8_t* __restrict__ scales, int64_t n, int K, int64_t n_fill, int64_t m,
                     int64_t H, int block) {
  constexpr int V = 16 / sizeof(T);
  using Codes = Pack<uint8_t, V>;
  const int G = block / V;
  const int64_t units = H / V, sb = (H / block) * (kMx ? 1 : 4);
  for (int64_t i = blockIdx.x; i < n + n_fill; i += gridDim.x) {
    if (i >= n) {  // a row to zero
      const int64_t r = fill[i - n];
      if (r < 0 || r >= m) continue;
      for (int64_t c = threadIdx.x; c < units; c += kThreads) reinterpret_cast<Codes*>(values + r * H)[c] = Codes{};
      for (int64_t b = threadIdx.x; b < sb; b += kThreads) scales[r * sb + b] = 0;
      continue;
    }
    const int32_t* p = pos + i * K;
    if (!any_target(p, K, m)) continue;
    const uint4* src = reinterpret_cast<const uint4*>(table + i * H);
    for (int64_t base = 0; base < units; base += kThreads) {
      const int64_t c = base + threadIdx.x;
      const bool valid = c < units;
      Pack<T, V> raw{};
      if (valid) {
        const uint4 bits = load_nc(src + c);
        memcpy(&raw, &bits, sizeof(raw));
      }
      Codes codes;
      float scale;
      uint8_t e8m0 = 0;
      quantize_piece<T, kMx, V>(raw, valid, G, codes.v, scale, e8m0);
      if (!valid) continue;
      const bool first = threadIdx.x % G == 0;  // the block's first lane writes its scale
      const int64_t b = c / G;
      for (int k = 0; k < K; ++k) {
        const int64_t r = p[k];
        if (r < 0 || r >= m) continue;
        reinterpret_cast<Codes*>(values + r * H)[c] = codes;
        if (first) {
          if constexpr (kMx) {
            scales[r * sb + b] = e8m0;
          } else {
            memcpy(scales + r * sb + 4 * b, &scale, 4);
          }
        }
      }
    }
  }
}

// Whether a table of rows of H values fits the quantizing scatters: whole blocks of `block`
// values, each 1 to 32 (a power of two) 16-byte pieces, the table 16-byte aligned.
bool quantizing_shape(const ffi::AnyBuffer& table, int64_t H, int64_t block) {
  const int64_t V = 16 / static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  const int64_t G = V > 0 && block > 0 && block % V == 0 ? block / V : 0;
  return G >= 1 && G <= 32 && (G & (G - 1)) == 0 && H % block == 0 &&
         aligned(table.untyped_data(), 16);
}

std::string quantizing_shape_rule(int64_t H, int64_t block) {
  return "rows of " + std::to_string(H) + " values in blocks of " + std::to_string(block) +
         " need whole blocks of 1 to 32 16-byte pieces, 16-byte aligned";
}

template <typename T>
cudaError_t launch_scatter_fake_quant(cudaStream_t s, const void* table, const int32_t* pos,
                                      const int32_t* fill, void* out, int64_t n, int K,
                                      int64_t n_fill, int64_t m, int64_t H, int block, bool mx) {
  const T* t = static_cast<const T*>(table);
  T* o = static_cast<T*>(out);
  if (mx) {
    scatter_fake_quant_kernel<T, true><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        t, pos, fill, o, n, K, n_fill, m, H, block);
  } else {
    scatter_fake_quant_kernel<T, false><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        t, pos, fill, o, n, K, n_fill, m, H, block);
  }
  return cudaGetLastError();
}

ffi::Error ScatterFakeQuant(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> pos,
                            ffi::Buffer<ffi::S32> fill, ffi::Result<ffi::AnyBuffer> out,
                            int64_t block, int64_t mx) {
  const std::string where = "ep_comm rows scatter_fake_quant: ";
  const auto tdims = table.dimensions(), odims = out->dimensions(), pdims = pos.dimensions();
  if (tdims.size() != 2 || odims.size() != 2 || pdims.size() != 2 || pdims[0] != tdims[0] ||
      odims[1] != tdims[1] || out->element_type() != table.element_type()) {
    return ffi::Error::InvalidArgument(where + "table must be (N, H), pos (N, K) and the result "
                                       "(M, H) of the table's type");
  }
  const int64_t n = tdims[0], H = tdims[1], m = odims[0];
  if (!quantizing_shape(table, H, block) || !aligned(out->untyped_data(), 16)) {
    return ffi::Error::InvalidArgument(where + quantizing_shape_rule(H, block));
  }
  const int K = static_cast<int>(pdims[1]);
  const int64_t n_fill = fill.element_count();
  if (m == 0 || H == 0 || (n * K == 0 && n_fill == 0)) return ffi::Error::Success();
  const void* t = table.untyped_data();
  const int32_t* p = pos.typed_data();
  const int32_t* f = fill.typed_data();
  void* o = out->untyped_data();
  const int blk = static_cast<int>(block);
  cudaError_t e;
  switch (table.element_type()) {
    case ffi::DataType::BF16:
      e = launch_scatter_fake_quant<__nv_bfloat16>(stream, t, p, f, o, n, K, n_fill, m, H, blk, mx);
      break;
    case ffi::DataType::F16:
      e = launch_scatter_fake_quant<__half>(stream, t, p, f, o, n, K, n_fill, m, H, blk, mx);
      break;
    case ffi::DataType::F32:
      e = launch_scatter_fake_quant<float>(stream, t, p, f, o, n, K, n_fill, m, H, blk, mx);
      break;
    default:
      return ffi::Error::InvalidArgument(where + "rows must be bfloat16, float16 or float32");
  }
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

template <typename T>
cudaError_t launch_scatter_quant(cudaStream_t s, const void* table, const int32_t* pos,
                                 const int32_t* fill, uint8_t* values, uint8_t* scales, int64_t n,
                                 int K, int64_t n_fill, int64_t m, int64_t H, int block, bool mx) {
  const T* t = static_cast<const T*>(table);
  if (mx) {
    scatter_quant_kernel<T, true><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        t, pos, fill, values, scales, n, K, n_fill, m, H, block);
  } else {
    scatter_quant_kernel<T, false><<<grid_for(n + n_fill, 1), kThreads, 0, s>>>(
        t, pos, fill, values, scales, n, K, n_fill, m, H, block);
  }
  return cudaGetLastError();
}

ffi::Error ScatterQuant(cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> pos,
                        ffi::Buffer<ffi::S32> fill, ffi::Result<ffi::Buffer<ffi::U8>> values,
                        ffi::Result<ffi::Buffer<ffi::U8>> scales, int64_t block, int64_t mx) {
  const std::string where = "ep_comm rows scatter_quant: ";
  const auto tdims = table.dimensions(), vdims = values->dimensions(),
             sdims = scales->dimensions(), pdims = pos.dimensions();
  if (tdims.size() != 2 || vdims.size() != 2 || sdims.size() != 2 || pdims.size() != 2 ||
      pdims[0] != tdims[0] || vdims[1] != tdims[1] || sdims[0] != vdims[0]) {
    return ffi::Error::InvalidArgument(where + "table must be (N, H), pos (N, K), values (M, H) "
                                       "and scales (M, scale bytes)");
  }
  const int64_t n = tdims[0], H = tdims[1], m = vdims[0];
  if (!quantizing_shape(table, H, block) || sdims[1] != (H / block) * (mx ? 1 : 4) ||
      !aligned(values->untyped_data(), 16) || !aligned(scales->untyped_data(), 4)) {
    return ffi::Error::InvalidArgument(where + quantizing_shape_rule(H, block) + ", and " +
                                       (mx ? "one scale byte" : "four scale bytes") +
                                       " a block in a row");
  }
  const int K = static_cast<int>(pdims[1]);
  const int64_t n_fill = fill.element_count();
  if (m == 0 || H == 0 || (n * K == 0 && n_fill == 0)) return ffi::Error::Success();
  const void* t = table.untyped_data();
  const int32_t* p = pos.typed_data();
  const int32_t* f = fill.typed_data();
  uint8_t* v = values->typed_data();
  uint8_t* sc = scales->typed_data();
  const int blk = static_cast<int>(block);
  cudaError_t e;
  switch (table.element_type()) {
    case ffi::DataType::BF16:
      e = launch_scatter_quant<__nv_bfloat16>(stream, t, p, f, v, sc, n, K, n_fill, m, H, blk, mx);
      break;
    case ffi::DataType::F16:
      e = launch_scatter_quant<__half>(stream, t, p, f, v, sc, n, K, n_fill, m, H, blk, mx);
      break;
    case ffi::DataType::F32:
      e = launch_scatter_quant<float>(stream, t, p, f, v, sc, n, K, n_fill, m, H, blk, mx);
      break;
    default:
      return ffi::Error::InvalidArgument(where + "rows must be bfloat16, float16 or float32");
  }
  if (e != cudaSuccess) return ffi::Error::Internal(where + "launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// ---- empty --------------------------------------------------------------------------------------

// A buffer for an exchange to write into, not initialised: the rows no segment covers are
// unspecified, and nothing reads them (no memset of a worst-case receive buffer).
ffi::Error Empty(ffi::Result<ffi::AnyBuffer> /*out*/, int64_t /*id: keeps calls distinct*/) {
  return ffi::Error::Success();
}

}  // namespace

// The scatter on malformed targets and fill rows: N table rows (already on the device) into C
// rows; slot (n, k) targets a distinct row, every fifth slot an out-of-range one instead. Returns
// the wrong values (targets against the table, filled rows against zero, the others against the
// untouched memset), or -1 when CUDA fails.
template <typename Next>
int64_t scatter_selftest(cudaStream_t s, const void* d_table, int64_t N, int64_t H, Next& next) {
  const int K = 8;
  const int64_t C = 600;  // > N * K distinct targets: (n * K + k) * 7 mod C (7 is prime to C)
  const int32_t odd[] = {-1, INT32_MIN, INT32_MAX, static_cast<int32_t>(C), -7};
  std::vector<int32_t> pos(N * K), owner(C, -1), fill;
  for (int64_t i = 0; i < N * K; ++i) {
    pos[i] = i % 5 == 4 ? odd[next() % 5] : static_cast<int32_t>(i * 7 % C);
    if (pos[i] >= 0 && pos[i] < C) owner[pos[i]] = static_cast<int32_t>(i / K);
  }
  for (int64_t r = 0; r < C; ++r) {
    if (owner[r] < 0 && next() % 2) fill.push_back(static_cast<int32_t>(r));
  }
  const size_t n_fill = fill.size();
  fill.push_back(-3);
  fill.push_back(INT32_MAX);
  std::vector<uint16_t> table(N * H), out(C * H);
  void *d_pos = nullptr, *d_fill = nullptr, *d_out = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  int64_t wrong = -1;
  if (ok(cudaMalloc(&d_pos, pos.size() * 4)) && ok(cudaMalloc(&d_fill, fill.size() * 4)) &&
      ok(cudaMalloc(&d_out, C * H * 2)) && ok(cudaMemset(d_out, 0xff, C * H * 2)) &&
      ok(cudaMemcpy(d_pos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_fill, fill.data(), fill.size() * 4, cudaMemcpyHostToDevice)) &&
      ok(launch_scatter<uint4>(s, d_table, static_cast<const int32_t*>(d_pos),
                               static_cast<const int32_t*>(d_fill), d_out, N, K,
                               static_cast<int64_t>(fill.size()), C, H * 2, H * 2, 0)) &&
      ok(cudaStreamSynchronize(s)) &&
      ok(cudaMemcpy(table.data(), d_table, N * H * 2, cudaMemcpyDeviceToHost)) &&
      ok(cudaMemcpy(out.data(), d_out, C * H * 2, cudaMemcpyDeviceToHost))) {
    wrong = 0;
    std::vector<bool> filled(C, false);
    for (size_t f = 0; f < n_fill; ++f) filled[fill[f]] = true;
    for (int64_t r = 0; r < C; ++r) {
      for (int64_t j = 0; j < H; ++j) {
        const uint16_t got = out[r * H + j];
        if (owner[r] >= 0) wrong += got != table[owner[r] * H + j];
        else wrong += got != (filled[r] ? 0 : 0xffff);
      }
    }
  }
  for (void* p : {d_pos, d_fill, d_out}) {
    if (p) cudaFree(p);
  }
  return wrong;
}

// The counting sort on keys outside [0, num_keys) (every int32 extreme) and a partial last chunk,
// against a stable sort on the host; then key_rank once more on a malformed base (ranks outside
// [0, M), repeated ranks) for the sanitizer to watch. Returns the wrong values, or -1.
template <typename Next>
int64_t rank_selftest(cudaStream_t s, Next& next) {
  const int64_t M = 3 * kRankChunk + 77;
  const int32_t NK = 37;
  const int32_t odd[] = {-1, INT32_MIN, INT32_MAX, NK, NK + 5};
  std::vector<int32_t> key(M), clamped(M);
  for (int64_t i = 0; i < M; ++i) {
    key[i] = next() % 7 ? static_cast<int32_t>(next() % NK) : odd[next() % 5];
    clamped[i] = key[i] >= 0 && key[i] < NK ? key[i] : NK - 1;
  }
  const int64_t chunks = rank_chunks(M);
  std::vector<int32_t> counts(chunks * NK), base(chunks * NK), out(2 * M);
  void *d_key = nullptr, *d_counts = nullptr, *d_base = nullptr, *d_out = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  int64_t wrong = -1;
  if (ok(cudaMalloc(&d_key, M * 4)) && ok(cudaMalloc(&d_counts, chunks * NK * 4)) &&
      ok(cudaMalloc(&d_base, chunks * NK * 4)) && ok(cudaMalloc(&d_out, 2 * M * 4)) &&
      ok(cudaMemcpy(d_key, key.data(), M * 4, cudaMemcpyHostToDevice)) &&
      ok(launch_key_count(s, static_cast<const int32_t*>(d_key), static_cast<int32_t*>(d_counts),
                          M, NK)) &&
      ok(cudaStreamSynchronize(s)) &&
      ok(cudaMemcpy(counts.data(), d_counts, chunks * NK * 4, cudaMemcpyDeviceToHost))) {
    int32_t start = 0;  // base[c, k]: entries with a smaller key, then those of key k before c
    for (int32_t k = 0; k < NK; ++k) {
      for (int64_t c = 0; c < chunks; ++c) {
        base[c * NK + k] = start;
        start += counts[c * NK + k];
      }
    }
    int32_t* r = static_cast<int32_t*>(d_out);
    if (ok(cudaMemcpy(d_base, base.data(), chunks * NK * 4, cudaMemcpyHostToDevice)) &&
        ok(launch_key_rank(s, static_cast<const int32_t*>(d_key),
                           static_cast<const int32_t*>(d_base), r, r + M, M, NK)) &&
        ok(cudaStreamSynchronize(s)) &&
        ok(cudaMemcpy(out.data(), d_out, 2 * M * 4, cudaMemcpyDeviceToHost))) {
      std::vector<int32_t> want(M);
      int32_t at = 0;
      for (int32_t k = 0; k < NK; ++k) {
        for (int64_t i = 0; i < M; ++i) {
          if (clamped[i] == k) want[i] = at++;
        }
      }
      wrong = 0;
      for (int64_t i = 0; i < M; ++i) {
        wrong += out[i] != want[i];
        wrong += out[M + want[i]] != i;
      }
      for (auto& b : base) b = static_cast<int32_t>(next()) >> (next() % 31);  // malformed
      const bool ran =
          ok(cudaMemcpy(d_base, base.data(), chunks * NK * 4, cudaMemcpyHostToDevice)) &&
          ok(launch_key_rank(s, static_cast<const int32_t*>(d_key),
                             static_cast<const int32_t*>(d_base), r, r + M, M, NK)) &&
          ok(cudaStreamSynchronize(s));
      if (!ran) wrong = -1;
    }
  }
  for (void* p : {d_key, d_counts, d_base, d_out}) {
    if (p) cudaFree(p);
  }
  return wrong;
}

// The layout kernels on a malformed routing (ids NaN, +-Inf, huge, negative, other ranks';
// garbage past num_recv): every index they write must stay in range and the groups must hold
// each routed pair once. Returns the out-of-range values, or -1 when CUDA fails.
// The layout's int32 results and scratch one after another from p (the selftests' buffers), for
// a's rows, K, C, L, F and chunks: recv_pos, targets (M each), expert_token (C), sizes (L),
// num_pairs (1), fill (F), keys, ranks, first slots (M each), counts ((L + 1) chunks). Returns
// the end.
int32_t* carve_layout(LayoutArgs& a, int32_t* p) {
  const int64_t m = a.rows * a.K;
  a.recv_pos = p;
  a.targets = p + m;
  a.expert_token = a.targets + m;
  a.sizes = a.expert_token + a.C;
  a.num_pairs = a.sizes + a.L;
  a.fill = a.num_pairs + 1;
  a.keys = a.fill + a.F;
  a.in_chunk = a.keys + m;
  a.first = a.in_chunk + m;
  a.counts = a.first + m;
  return a.counts + (int64_t{a.L} + 1) * a.chunks;
}

template <typename Next>
int64_t layout_selftest(cudaStream_t s, Next& next, int64_t R) {
  const int64_t C = 500, F = 40;
  const int32_t K = 8, L = 13, me = 2, recv = static_cast<int32_t>(R - 11);
  const float odd[] = {NAN, INFINITY, -INFINITY, 3e9f, -2.0f, -1.0f, 1e30f};
  std::vector<float> route(R * 2 * K);
  for (int64_t r = 0; r < R; ++r) {
    for (int k = 0; k < K; ++k) {
      route[r * 2 * K + k] = static_cast<float>(next() % 1000) / 1000.0f;
      const uint32_t u = next() % 10;
      route[r * 2 * K + K + k] = u < 5 ? static_cast<float>(me * L + next() % L)
                                 : u < 8 ? static_cast<float>(next() % (5 * L)) : odd[next() % 7];
    }
  }
  const int64_t m = R * K, chunks = layout_chunks(m);
  const int64_t ints = 3 * m + C + (L + 1) + F + 3 * m + (L + 1) * chunks;
  void *d_route = nullptr, *d_ints = nullptr, *d_w = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  std::vector<int32_t> out(ints);
  int64_t wrong = -1;
  if (ok(cudaMalloc(&d_route, route.size() * 4)) && ok(cudaMalloc(&d_ints, (ints + 2) * 4)) &&
      ok(cudaMalloc(&d_w, m * 4)) &&
      ok(cudaMemcpy(d_route, route.data(), route.size() * 4, cudaMemcpyHostToDevice))) {
    int32_t* p = static_cast<int32_t*>(d_ints);
    const int32_t scalars[] = {recv, me};
    LayoutArgs a{};
    a.route = static_cast<const float*>(d_route);
    a.num_recv = p + ints;
    a.me = p + ints + 1;
    a.recv_w = static_cast<float*>(d_w);
    a.rows = R, a.C = C, a.F = F, a.chunks = chunks, a.K = K, a.L = L, a.zero_fill = false;
    carve_layout(a, p);
    if (ok(cudaMemcpy(p + ints, scalars, 8, cudaMemcpyHostToDevice)) &&
        ok(launch_layout(s, a)) && ok(cudaStreamSynchronize(s)) &&
        ok(cudaMemcpy(out.data(), d_ints, ints * 4, cudaMemcpyDeviceToHost))) {
      wrong = 0;
      std::vector<int> hits(C, 0);
      for (int64_t i = 0; i < m; ++i) {
        wrong += out[i] < 0 || out[i] > C;          // recv_pos
        wrong += out[m + i] < 0 || out[m + i] > C;  // targets
        if (out[m + i] < C) ++hits[out[m + i]];
      }
      const int32_t* sizes = out.data() + 2 * m + C;
      int64_t grouped = 0;
      for (int32_t k = 0; k < L; ++k) grouped += sizes[k];
      for (int64_t q = 0; q < C; ++q) {
        wrong += out[2 * m + q] < 0 || out[2 * m + q] > R;  // expert_token
        wrong += hits[q] != (q < grouped ? 1 : 0);         // each grouped row filled once
      }
    }
  }
  for (void* q : {d_route, d_ints, d_w}) {
    if (q) cudaFree(q);
  }
  return wrong;
}

// Top-K expert ids of T tokens over E experts for the selftests: valid ids, repeats of an earlier
// slot's expert, and malformed ones (-1, every int32 extreme, negative, past the experts).
template <typename Next>
std::vector<int32_t> malformed_routing(Next& next, int64_t T, int32_t K, int32_t E) {
  const int32_t odd[] = {-1, INT32_MIN, INT32_MAX, E, E + 1000, -7};
  std::vector<int32_t> ids(T * K);
  for (int64_t i = 0; i < T * K; ++i) {
    const uint32_t u = next() % 10;
    ids[i] = u < 6 ? static_cast<int32_t>(next() % E)
             : u < 8 && i % K ? ids[i - 1 - next() % (i % K)] : odd[next() % 6];
  }
  return ids;
}

// token_routes on malformed ids (every int32 extreme, negative, past the experts, repeats) over
// blocks of whole tokens with a last one cut short: dest, first and the counts against the host.
template <typename Next>
int64_t routes_selftest(cudaStream_t s, Next& next, int64_t T) {
  const int32_t K = 8, E = 256, n = 8, L = E / n;
  const std::vector<int32_t> ids = malformed_routing(next, T, K, E);
  std::vector<float> w(T * K, 0.5f);
  void *d_ids = nullptr, *d_w = nullptr, *d_route = nullptr, *d_ints = nullptr, *d_b = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  const int64_t ints = T * K + 2 * n + 1;  // dest | counts | invalid
  std::vector<int32_t> got(ints);
  std::vector<uint8_t> flags(T * n + T * K);  // in_rank | first
  int64_t wrong = -1;
  if (ok(cudaMalloc(&d_ids, T * K * 4)) && ok(cudaMalloc(&d_w, T * K * 4)) &&
      ok(cudaMalloc(&d_route, T * 2 * K * 4)) && ok(cudaMalloc(&d_ints, ints * 4)) &&
      ok(cudaMalloc(&d_b, flags.size())) &&
      ok(cudaMemcpy(d_ids, ids.data(), T * K * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_w, w.data(), T * K * 4, cudaMemcpyHostToDevice))) {
    int32_t* p = static_cast<int32_t*>(d_ints);
    bool* b = static_cast<bool*>(d_b);
    const RoutesArgs r{static_cast<const int32_t*>(d_ids), static_cast<const float*>(d_w),
                       static_cast<float*>(d_route), p, b, b + T * n, p + T * K,
                       p + T * K + 2 * n, T, K, E, n};
    if (ok(launch_routes(s, r)) &&
        ok(cudaStreamSynchronize(s)) &&
        ok(cudaMemcpy(got.data(), d_ints, ints * 4, cudaMemcpyDeviceToHost)) &&
        ok(cudaMemcpy(flags.data(), d_b, flags.size(), cudaMemcpyDeviceToHost))) {
      std::vector<int64_t> want(2 * n + 1, 0);
      wrong = 0;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<bool> seen_rank(n, false);
        for (int k = 0; k < K; ++k) {
          const int32_t e = ids[t * K + k];
          const bool valid = e >= 0 && e < E;
          want[2 * n] += e != -1 && !valid;
          const int32_t d = valid ? e / L : n;
          const bool new_rank = valid && !seen_rank[d];
          bool new_expert = valid;
          for (int j = 0; j < k; ++j) new_expert &= ids[t * K + j] != e;
          if (new_rank) seen_rank[d] = true, ++want[d];
          if (new_expert) ++want[n + d];
          wrong += got[t * K + k] != d;
          wrong += flags[T * n + t * K + k] != (new_rank ? 1 : 0);
        }
        for (int32_t r = 0; r < n; ++r) wrong += flags[t * n + r] != (seen_rank[r] ? 1 : 0);
      }
      for (int32_t r = 0; r <= 2 * n; ++r) wrong += got[T * K + r] != want[r];
    }
  }
  for (void* q : {d_ids, d_w, d_route, d_ints, d_b}) {
    if (q) cudaFree(q);
  }
  return wrong;
}

// local_layout (one launch) against token_routes then expert_layout (two), on one rank's malformed
// ids (every int32 extreme, negative, past the experts, repeats): every output byte.
template <typename Next>
int64_t local_selftest(cudaStream_t s, Next& next) {
  const int32_t K = 8, E = 61;
  const int64_t T = 100, C = 700, F = 40, m = T * K;
  const std::vector<int32_t> ids = malformed_routing(next, T, K, E);
  std::vector<float> w(m);
  for (auto& v : w) v = static_cast<float>(next() % 1000) / 1000.0f;
  // per run: route (2m floats) | ints: dest m, counts 2, invalid 1, recv_pos m, targets m,
  // expert_token C, sizes E, num_pairs 1, fill F, scratch (3m + (E + 1)), num_recv, me | recv_w m
  // floats | flags: in_rank T, first m
  const int64_t ints = m + 3 + 2 * m + C + E + 1 + F + 3 * m + (E + 1) + 2;
  const int64_t bytes = (2 * m + ints + m) * 4 + T + m;
  void *d_ids = nullptr, *d_w = nullptr, *d_out = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  std::vector<uint8_t> got[2] = {std::vector<uint8_t>(bytes), std::vector<uint8_t>(bytes)};
  int64_t wrong = -1;
  if (ok(cudaMalloc(&d_ids, m * 4)) && ok(cudaMalloc(&d_w, m * 4)) &&
      ok(cudaMalloc(&d_out, 2 * bytes)) && ok(cudaMemset(d_out, 0, 2 * bytes)) &&
      ok(cudaMemcpy(d_ids, ids.data(), m * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_w, w.data(), m * 4, cudaMemcpyHostToDevice))) {
    bool fine = true;
    for (int run = 0; run < 2 && fine; ++run) {
      char* base = static_cast<char*>(d_out) + run * bytes;
      float* route = reinterpret_cast<float*>(base);
      int32_t* p = reinterpret_cast<int32_t*>(route + 2 * m);
      float* recv_w = reinterpret_cast<float*>(p + ints);
      bool* flags = reinterpret_cast<bool*>(recv_w + m);
      const RoutesArgs r{static_cast<const int32_t*>(d_ids), static_cast<const float*>(d_w),
                         route, p, flags, flags + T, p + m, p + m + 2, T, K, E, 1};
      LayoutArgs a{};
      a.route = route;
      a.recv_w = recv_w;
      a.rows = T, a.C = C, a.F = F, a.chunks = layout_chunks(m), a.K = K, a.L = E;
      a.zero_fill = false;
      int32_t* scalars = carve_layout(a, p + m + 3);
      a.num_recv = scalars;
      a.me = scalars + 1;
      const int32_t host_scalars[] = {static_cast<int32_t>(T), 0};
      fine = ok(cudaMemcpy(scalars, host_scalars, 8, cudaMemcpyHostToDevice)) &&
             (run == 0 ? ok(launch_routes(s, r)) && ok(launch_layout(s, a))
                       : ok(launch_local_layout(s, r, a))) &&
             ok(cudaStreamSynchronize(s)) &&
             ok(cudaMemcpy(got[run].data(), base, bytes, cudaMemcpyDeviceToHost));
    }
    if (fine) {
      // every byte but the scratch (the one-launch kernel keeps it in shared memory)
      const int64_t scratch_from = (2 * m + m + 3 + 2 * m + C + E + 1 + F) * 4;
      const int64_t scratch_to = scratch_from + (3 * m + (E + 1)) * 4;
      wrong = 0;
      for (int64_t q = 0; q < bytes; ++q) {
        if (q < scratch_from || q >= scratch_to) wrong += got[0][q] != got[1][q];
      }
    }
  }
  for (void* q : {d_ids, d_w, d_out}) {
    if (q) cudaFree(q);
  }
  return wrong;
}

// The kernels on malformed indices (every int32 extreme, negative, past the table), outside XLA,
// so that compute-sanitizer can watch them without a JAX process: a gather of 7392-byte rows
// (16-byte path), of 3-byte rows (byte path) and a weighted bf16 sum into float32. Returns the
// number of wrong output values (defined rows against the table, zero rows), or -1 when CUDA
// fails. Then the scatter (scatter_selftest), the counting sort (rank_selftest), the layout
// (layout_selftest), the token routes (routes_selftest) and both in one launch (local_selftest).
int64_t selftest() {
  const int64_t N = 64, M = 300, K = 8, H = 3696;  // 7392-byte rows = H bf16
  std::vector<int32_t> idx(M), idx2(M * K);
  uint32_t seed = 12345;
  auto next = [&]() { seed = seed * 1664525u + 1013904223u; return seed; };
  const int32_t odd[] = {-1, INT32_MIN, INT32_MAX, static_cast<int32_t>(N),
                         static_cast<int32_t>(N + 1000), -7};
  for (auto* v : {&idx, &idx2}) {
    for (auto& i : *v) i = next() % 3 ? static_cast<int32_t>(next() % N) : odd[next() % 6];
  }
  std::vector<uint16_t> table(N * H);
  for (auto& t : table) t = static_cast<uint16_t>(0x3c00 + next() % 512);  // finite bf16
  std::vector<float> w(M * K);
  for (auto& x : w) x = static_cast<float>(next() % 1000) / 1000.0f;
  void *d_table = nullptr, *d_out = nullptr, *d_idx = nullptr, *d_idx2 = nullptr, *d_w = nullptr;
  float* d_sum = nullptr;
  int64_t wrong = -1;
  cudaStream_t s = nullptr;
  auto ok = [](cudaError_t e) { return e == cudaSuccess; };
  if (ok(cudaStreamCreate(&s)) && ok(cudaMalloc(&d_table, N * H * 2)) &&
      ok(cudaMalloc(&d_out, M * H * 2)) && ok(cudaMalloc(&d_idx, M * 4)) &&
      ok(cudaMalloc(&d_idx2, M * K * 4)) && ok(cudaMalloc(&d_w, M * K * 4)) &&
      ok(cudaMalloc(reinterpret_cast<void**>(&d_sum), M * H * 4)) &&
      ok(cudaMemcpy(d_table, table.data(), N * H * 2, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_idx, idx.data(), M * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_idx2, idx2.data(), M * K * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemcpy(d_w, w.data(), M * K * 4, cudaMemcpyHostToDevice)) &&
      ok(cudaMemset(d_out, 0xff, M * H * 2))) {
    std::vector<uint16_t> out(M * H);
    std::vector<float> sum(M * H);
    const int32_t* ix = static_cast<const int32_t*>(d_idx);
    bool launched = ok(launch_gather<uint4>(s, d_table, ix, d_out, N, M, H * 2)) &&
                    ok(launch_gather<uint8_t>(s, d_table, ix, d_sum, N, M, 3)) &&
                    ok(cudaStreamSynchronize(s)) &&
                    ok(cudaMemcpy(out.data(), d_out, M * H * 2, cudaMemcpyDeviceToHost)) &&
                    ok(launch_gather_sum<__nv_bfloat16, float>(
                        s, d_table, static_cast<const int32_t*>(d_idx2),
                        static_cast<const float*>(d_w), d_sum, N, M, K, H)) &&
                    ok(cudaStreamSynchronize(s)) &&
                    ok(cudaMemcpy(sum.data(), d_sum, M * H * 4, cudaMemcpyDeviceToHost));
    if (launched) {
      wrong = 0;
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < H; ++j) {
          const uint16_t got = out[i * H + j];
          if (idx[i] >= 0 && idx[i] < N) wrong += got != table[idx[i] * H + j];
          else if (idx[i] < 0) wrong += got != 0;
          else wrong += got != 0xffff;  // past the table: not written
          float want = 0.0f;
          for (int64_t k = 0; k < K; ++k) {
            const int32_t r = idx2[i * K + k];
            if (r < 0 || r >= N) continue;
            uint32_t bits = static_cast<uint32_t>(table[r * H + j]) << 16;
            float v;
            std::memcpy(&v, &bits, 4);
            want += w[i * K + k] * v;
          }
          const float g = sum[i * H + j];
          wrong += std::fabs(g - want) > 1e-5f * (1.0f + std::fabs(want));
        }
      }
    }
  }
  if (wrong >= 0) {
    const int64_t w2 = scatter_selftest(s, d_table, N, H, next);
    const int64_t w3 = w2 < 0 ? -1 : rank_selftest(s, next);
    // (several chunks or blocks, a last one cut short; then one: the one-launch paths)
    int64_t more = 0;
    for (const int64_t r : {int64_t{3 * kLayoutChunk / 8 + 29}, int64_t{kLayoutChunk / 8 - 3}}) {
      const int64_t w4 = more < 0 ? -1 : layout_selftest(s, next, r);
      more = w4 < 0 ? -1 : more + w4;
    }
    for (const int64_t t : {int64_t{3 * (kRoutesThreads / 8) + 5}, int64_t{kRoutesThreads / 8 - 3}}) {
      const int64_t w5 = more < 0 ? -1 : routes_selftest(s, next, t);
      more = w5 < 0 ? -1 : more + w5;
    }
    const int64_t w6 = more < 0 ? -1 : local_selftest(s, next);
    more = w6 < 0 ? -1 : more + w6;
    wrong = w2 < 0 || w3 < 0 || more < 0 ? -1 : wrong + w2 + w3 + more;
  }
  for (void* p : {d_table, d_out, d_idx, d_idx2, d_w, static_cast<void*>(d_sum)}) {
    if (p) cudaFree(p);
  }
  if (s) cudaStreamDestroy(s);
  return wrong;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kScatterDequant, ScatterDequant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // table (N, row bytes) uint8
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos (N, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill (F,)
                                  .Ret<ffi::AnyBuffer>()         // out (M, H)
                                  .Attr<int64_t>("block")        // values per scale
                                  .Attr<int64_t>("mx"));         // 1: E8M0 scales, 0: float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(kScatterFakeQuant, ScatterFakeQuant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // table (N, H)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos (N, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill (F,)
                                  .Ret<ffi::AnyBuffer>()         // out (M, H)
                                  .Attr<int64_t>("block")        // values per scale
                                  .Attr<int64_t>("mx"));         // 1: E8M0 scales, 0: float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(kScatterQuant, ScatterQuant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // table (N, H)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pos (N, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // fill (F,)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // values (M, H)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // scales (M, scale bytes)
                                  .Attr<int64_t>("block")         // values per scale
                                  .Attr<int64_t>("mx"));          // 1: E8M0 scales, 0: float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(kEmpty, Empty,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<int64_t>("id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGather, Gather,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // table (N, ...)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // idx (M,)
                                  .Ret<ffi::AnyBuffer>());       // out (M, ...)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kScatter, Scatter,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // table (N, ...)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos (N, K)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill (F,)
                                  .Ret<ffi::AnyBuffer>()         // out (M, ...)
                                  .Attr<int64_t>("offset"));     // first byte read of a row

XLA_FFI_DEFINE_HANDLER_SYMBOL(kKeyCount, KeyCount,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // key (M,)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // counts (chunks, num_keys)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kKeyRank, KeyRank,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // key (M,)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // base (chunks, num_keys)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // (rank, order) (2, M)

// The bindings the layout handlers share: the layout's results after the operands of `b`, and
// the token routes' operands and results.
template <typename B>
auto with_layout_rets(B b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::S32>>()   // recv_pos (R, K)
      .template Ret<ffi::Buffer<ffi::S32>>()       // targets (R, K)
      .template Ret<ffi::Buffer<ffi::F32>>()       // recv_w (R, K)
      .template Ret<ffi::Buffer<ffi::S32>>()       // expert_token (C,)
      .template Ret<ffi::Buffer<ffi::S32>>()       // group sizes (L,)
      .template Ret<ffi::Buffer<ffi::S32>>()       // num_pairs (1,)
      .template Ret<ffi::Buffer<ffi::S32>>();      // fill (F,)
}

auto routes_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::S32>>()    // ids (T, K)
      .Arg<ffi::Buffer<ffi::F32>>()    // weights (T, K)
      .Ret<ffi::Buffer<ffi::F32>>()    // route (T, 2K)
      .Ret<ffi::Buffer<ffi::S32>>()    // dest (T, K)
      .Ret<ffi::Buffer<ffi::PRED>>()   // in_rank (T, n)
      .Ret<ffi::Buffer<ffi::PRED>>()   // first (T, K)
      .Ret<ffi::Buffer<ffi::S32>>()    // counts (2n,)
      .Ret<ffi::Buffer<ffi::S32>>();   // invalid (1,)
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kExpertLayout, ExpertLayout,
                              with_layout_rets(ffi::Ffi::Bind()
                                                   .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                   .Arg<ffi::Buffer<ffi::F32>>()    // route
                                                   .Arg<ffi::Buffer<ffi::S32>>()    // num_recv
                                                   .Arg<ffi::Buffer<ffi::S32>>())   // me
                                  .Ret<ffi::Buffer<ffi::S32>>()   // scratch
                                  .Attr<int64_t>("zero_fill"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTokenRoutes, TokenRoutes,
                              routes_binding().Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLocalLayout, LocalLayout,
                              with_layout_rets(routes_binding()).Attr<int64_t>("zero_fill"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGatherSum, GatherSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // table (N, H)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // idx (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights (M, K)
                                  .Ret<ffi::AnyBuffer>());       // out (M, H)

void* gather_handler() { return reinterpret_cast<void*>(kGather); }
void* gather_sum_handler() { return reinterpret_cast<void*>(kGatherSum); }
void* empty_handler() { return reinterpret_cast<void*>(kEmpty); }
void* scatter_dequant_handler() { return reinterpret_cast<void*>(kScatterDequant); }
void* scatter_handler() { return reinterpret_cast<void*>(kScatter); }
void* key_count_handler() { return reinterpret_cast<void*>(kKeyCount); }
void* key_rank_handler() { return reinterpret_cast<void*>(kKeyRank); }
void* expert_layout_handler() { return reinterpret_cast<void*>(kExpertLayout); }
void* scatter_fake_quant_handler() { return reinterpret_cast<void*>(kScatterFakeQuant); }
void* scatter_quant_handler() { return reinterpret_cast<void*>(kScatterQuant); }
void* token_routes_handler() { return reinterpret_cast<void*>(kTokenRoutes); }
void* local_layout_handler() { return reinterpret_cast<void*>(kLocalLayout); }

}  // namespace ep_comm::rows
