// The layouts: key_count / key_rank, expert_layout, token_routes and local_layout's kernels and
// launches (layouts.cu: their handlers).
#pragma once

#include "common.cuh"

namespace ep_comm::rows {
namespace {

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

}  // namespace
}  // namespace ep_comm::rows
