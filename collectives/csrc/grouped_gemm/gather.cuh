// The grouped GEMM's fused forward kernel (sm_90a): A's rows gathered by index in the
// prologue, SwiGLU or a per-row scale in the epilogue. See gather.cu.
//
// Built from CUTLASS's pieces, not from its kernel: the warp-specialized cp.async + GMMA
// mainloop collective (the consumer warpgroups' mma and its PipelineAsync), with a producer of
// ep_comm's own that copies each (token, local expert) pair's row from the buffer the exchange
// delivered (TMA cannot gather rows on Hopper; cp.async can, 16 bytes at a time, straight into
// the mainloop's swizzled shared-memory layout), and an epilogue of its own on the accumulators
// in registers (SwiGLU pairs two adjacent accumulator columns, which one thread holds).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "common.cuh"

namespace ep_comm::gemm::gather {

using namespace cute;

// What the epilogue writes for row r (of the group's rows) and accumulator column c:
//   kStore:  out[r, c] = acc
//   kSwiGLU: out[r, j] = silu(acc[r, j]) * acc[r, I + j], j < I = N / 2 (w's first I columns
//            are the gate projection, its last I the up projection, as ep_comm lays them out);
//            each tile loads BN / 2 gate columns and the same BN / 2 up columns, so that one
//            thread holds both accumulators of every j it writes. Out is N / 2 wide.
//   kScale:  out[r, c] = acc * scale[r] (float32: the router weight of row r's pair)
//   kDSwiGLU: the down projection's dlhs with SwiGLU's derivative (B = w_out[g]^T read K-major
//            in place): for dh_w = acc (N = I columns), dh = dh_w * scale[r], out (M, 2I) =
//            [dh * up * s * (1 + gate * (1 - s)), dh * silu(gate)] with s = sigmoid(gate) from
//            u (M, 2I), and part[r, n] = sum over column tile n's columns of dh_w * h[r]
//            (the router weight's gradient, summed over the column tiles by the caller)
enum Epilogue : int { kStore = 0, kSwiGLU = 1, kScale = 2, kDSwiGLU = 3 };
constexpr int kEpilogues = 4;

// Tile configs: 0 cooperative (two consumer warpgroups on a 128 x 256 tile), 1 one consumer
// warpgroup on a 128 x 128 tile, 2 as 0 with B's tiles loaded by TMA (the forward's epilogues
// kStore, kSwiGLU and kScale: one thread issues them, and the producer warpgroup's cp.async
// copies only A's gathered rows, a third of the bytes).
// (registers per thread: the producer's and the consumers', within the SM's 64K; chosen with
// ptxas -v so that no kernel spills but the dSwiGLU dlhs (56 bytes): the cp.async producer's
// addresses, sources and tile walk need about 112, the consumers' 128 accumulators fit in 200;
// at 56 / 224 the cooperative kernels spilled 300 bytes and more)
struct Cooperative {
  using TileShape = Shape<_128, _256, _64>;
  using Schedule = cutlass::gemm::KernelCpAsyncWarpSpecializedCooperative;
  static constexpr int kProducerRegs = 112, kConsumerRegs = 200;
  static constexpr bool kTmaB = false;
};
struct Single {
  using TileShape = Shape<_128, _128, _64>;
  using Schedule = cutlass::gemm::KernelCpAsyncWarpSpecialized;
  static constexpr int kProducerRegs = 104, kConsumerRegs = 240;
  static constexpr bool kTmaB = false;
};
struct CooperativeTmaB : Cooperative {
  static constexpr bool kTmaB = true;
};
constexpr int kConfigs = 3;         // the forward's (Fused handler)
constexpr int kBackwardConfigs = 2;  // gathered drhs and dSwiGLU: 0 and 1 (cp.async only)

struct NoTma {};  // the kernel's TMA argument where B is copied by cp.async

// LayoutA: RowMajor (A K-major: the forward's rows) or ColumnMajor (A M-major: the weight
// gradient's x^T, whose K is the pairs); LayoutB: RowMajor (B N-major: w[g] as the forward
// takes it) or ColumnMajor (B K-major: w_out[g]^T in place, for kDSwiGLU)
// The mainloop collective M with its B swizzle atom replaced by AtomB.
template <class M, class AtomB>
struct WithAtomB;
template <class DP, class TS, class EA, class SA, class EB, class SB, class TM, class GA,
          class LA, class CA, class XA, class GB, class LB, class CB, class XB, class AtomB>
struct WithAtomB<cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA,
                                                          XA, GB, LB, CB, XB>,
                 AtomB> {
  using type = cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA,
                                                        XA, GB, AtomB, CB, XB>;
};

template <class E, class Config, class LayoutA = cutlass::layout::RowMajor,
          class LayoutB = cutlass::layout::RowMajor>
struct Traits {
  using TileShape = typename Config::TileShape;
  static constexpr int BM = size<0>(TileShape{});
  static constexpr int BN = size<1>(TileShape{});
  static constexpr int BK = size<2>(TileShape{});
  // B by TMA (Config::kTmaB, B N-major): see TmaArg below
  static constexpr bool kTmaB =
      Config::kTmaB && std::is_same_v<LayoutB, cutlass::layout::RowMajor>;
  // A (M x K) K-major (or M-major), B (K x N) N-major, as the passes lay them out
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, LayoutA, 8, E, LayoutB, 8, float,
      TileShape, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAuto, typename Config::Schedule>::CollectiveOp;
  // With B by TMA, B's stage is laid out K first, as CUTLASS's TMA mainloops lay an N-major
  // operand out: the builder's 128-byte swizzle atom (64 columns x 8 K rows) repeated along
  // the K tile makes one atom of 64 columns x BK, 8 KB contiguous, and a TMA box of that size
  // (the cp.async mainloop tiles N first: each 64 x 8 atom would be a 1 KB box of its own)
  using AtomB = typename Built::SmemLayoutAtomB;
  using BigAtomB =
      decltype(tile_to_shape(AtomB{}, Shape<decltype(size<0>(AtomB{})), Int<BK>>{}));
  using Mainloop =
      std::conditional_t<kTmaB, typename WithAtomB<Built, BigAtomB>::type, Built>;
  using TiledMma = typename Mainloop::TiledMma;
  using SmemLayoutA = typename Mainloop::SmemLayoutA;  // (BM, BK, stages)
  using SmemLayoutB = typename Mainloop::SmemLayoutB;  // (BN, BK, stages)
  using Pipeline = typename Mainloop::MainloopPipeline;
  static constexpr int kConsumers = size(TiledMma{});  // threads
  static constexpr int kProducers = 128;               // one warpgroup
  static constexpr int kThreads = kProducers + kConsumers;
  static constexpr int kProducerRegs = Config::kProducerRegs, kConsumerRegs = Config::kConsumerRegs;
  static_assert(kProducers * kProducerRegs + kConsumers * kConsumerRegs <= 65536,
                "the register file");
  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  // B by TMA (kTmaB): w (G, K, N) seen as (N, K, G), one copy per half tile of BN / 2 columns
  // (SwiGLU's gate and up halves lie apart in w), into the mainloop's swizzled stage layout;
  // out-of-range columns and K rows arrive as zeros
  using BHalf = Shape<Int<BN / 2>, Int<BK>>;
  using SmemLayoutBHalf =
      decltype(flat_divide(SmemLayoutB{}(_, _, Int<0>{}), BHalf{})(_, _, Int<0>{}, Int<0>{}));
  static auto b_tensor(const E* w, int64_t N, int64_t K, int64_t G) {
    return make_tensor(make_gmem_ptr(w),
                       make_layout(make_shape(int32_t(N), int32_t(K), int32_t(G)),
                                   make_stride(Int<1>{}, N, K * N)));
  }
  using TmaArg = std::conditional_t<
      kTmaB,
      decltype(make_tma_copy(SM90_TMA_LOAD{}, b_tensor(nullptr, 0, 0, 0), SmemLayoutBHalf{})),
      NoTma>;
  static constexpr uint32_t kTmaBytes = uint32_t(BN * BK * sizeof(E));  // both halves a stage
  static_assert(BK % 8 == 0 && BN % 8 == 0, "16-byte chunks along K (A) and N (B)");
  static_assert((BM * BK / 8) % kProducers == 0 && (BN * BK / 8) % kProducers == 0,
                "every producer thread copies the same number of chunks");
};

template <class E>
struct Params {
  const E* x;             // (X, K): the rows the pairs gather from
  const int32_t* index;   // (M,): pair r reads x's row index[r]; null: row r itself (X == M)
  const E* w;             // (G, K, N); kDSwiGLU: (G, N, K), w_out as the forward takes it
  const int32_t* sizes;   // (G,) group sizes, as given (clamped here as by fill_groups)
  const float* scale;     // (M,) per-row scale (kScale), else null
  E* out;                 // (M, N), (M, N / 2) for kSwiGLU, (M, 2N) for kDSwiGLU
  int64_t X, M, G, K, N;  // N: the accumulator's columns (2I for kSwiGLU)
  const E* u = nullptr;   // kDSwiGLU: (M, 2N), gate then up
  const E* h = nullptr;   // kDSwiGLU: (M, N), silu(gate) * up as the forward wrote it
  float* part = nullptr;  // kDSwiGLU: (M, N / BN column tiles)
  int max_ctas = 0;       // the persistent grid's CTAs at most (0: one per SM)
};

// The weight gradient with A's rows gathered: out[g] (K x N) = sum over the rows r of group g
// of x[index[r]]^T dy[r] (in GEMM terms M = K, N = N, and the group's pairs are the ragged
// contraction).
template <class E>
struct DrhsParams {
  const E* x;            // (X, K): the rows the pairs gather from
  const int32_t* index;  // (M,): pair r reads x's row index[r]; null: row r itself (X == M)
  const E* dy;           // (M, N)
  const int32_t* sizes;  // (G,) group sizes, as given (clamped as by fill_groups)
  E* out;                // (G, K, N)
  int64_t X, M, G, K, N;
  int max_ctas = 0;      // the persistent grid's CTAs at most (0: one per SM)
};

// 16 bytes global -> shared (a shared-window address), zero-filled when `bytes` is 0 (the
// source is then not read).
CUTLASS_DEVICE void cp_async_16(uint32_t smem, const void* gmem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
#endif
}

CUTLASS_DEVICE float silu(float v) { return v / (1.0f + __expf(-v)); }

// The mainloop's pipeline: the first warpgroup produces, the others consume.
template <class T>
CUTLASS_DEVICE typename T::Pipeline make_pipeline(typename T::SharedStorage& shared) {
  using Pipeline = typename T::Pipeline;
  typename Pipeline::Params pp;
  pp.role = cutlass::canonical_warp_group_idx() == 0 ? Pipeline::ThreadCategory::Producer
                                                     : Pipeline::ThreadCategory::Consumer;
  pp.producer_arv_count = T::kProducers;
  pp.consumer_arv_count = T::kConsumers;
  return Pipeline(shared.pipeline, pp);
}

// The consumers' part: CUTLASS's GMMA mainloop over k_tiles stages from `read` (advanced past
// them: a persistent CTA's next tile reads on), then the accumulators and the same partition of
// the tile's (row, column) coordinates. ct: the thread among the consumers.
template <class T>
CUTLASS_DEVICE auto consume(typename T::Pipeline& pipeline, typename T::SharedStorage& shared,
                            int k_tiles, int ct, typename T::Pipeline::PipelineState& read) {
  typename T::TiledMma mma;
  Tensor acc = partition_fragment_C(mma, take<0, 2>(typename T::TileShape{}));
  if (k_tiles == 0) {  // an empty contraction (the producer loads no stage for it): zeros
    clear(acc);
  } else {
    typename T::Mainloop mainloop;
    typename T::Mainloop::Params none{};
    mainloop.mma(pipeline, read, acc, k_tiles, ct, shared.tensors, none);
    mainloop.mma_tail(pipeline, read, k_tiles);
    read.advance(k_tiles);
  }
  Tensor coord = mma.get_slice(ct).partition_C(
      make_identity_tensor(take<0, 2>(typename T::TileShape{})));
  return cute::make_tuple(acc, coord);
}

// The fused kernel's tiles: every group's row tiles, at most M / BM + G of them (the ones past
// the last are skipped), by the accumulator's column tiles. The kernel is persistent: a 1-D grid
// of at most one CTA per SM (launch's persistent_grid) walks them in strides of its size.
template <class T, class Ep>
CUTLASS_HOST_DEVICE void grid_tiles(const Params<Ep>& p, int64_t& tiles_m, int64_t& tiles_n) {
  tiles_m = (p.M + T::BM - 1) / T::BM + p.G;
  tiles_n = (p.N + T::BN - 1) / T::BN;
}

// EPI a template argument: with the epilogue known, the loop over the accumulators unrolls and
// they stay in registers.
template <class T, class Ep, int EPI>
__global__ void __launch_bounds__(T::kThreads, 1)
    kernel(Params<Ep> p, const __grid_constant__ typename T::TmaArg tma_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename T::Pipeline;
  using State = typename Pipeline::PipelineState;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK;
  extern __shared__ __align__(128) char smem_raw[];
  auto& shared = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  // Tile `cta` (detail::strip_tile's order over grid_tiles): row tile `tile` over the groups in
  // order (each group's rows cut into tiles of BM; groups clamped as fill_groups does), column
  // tile tile_n; false past the last tile (the tiles are counted for the worst case). Producer
  // and consumers walk the same tiles, so the pipeline's stages pair up across tiles.
  int64_t tiles_m, tiles_n;
  grid_tiles<T>(p, tiles_m, tiles_n);
  const int64_t tiles = tiles_m * tiles_n;
  struct Tile {
    int64_t off, group, row0, rows_left, col0, tile_n;
  };
  auto locate = [&](int64_t cta, Tile& tl) {
    int64_t tile, tile_n;
    detail::strip_tile(cta, tiles_m, tiles_n, tile, tile_n);
    int64_t off = 0;
    for (int64_t i = 0; i < p.G; ++i) {
      const int64_t s = detail::clamp_size(p.sizes[i], p.M, off);
      const int64_t in_group = (s + BM - 1) / BM;
      if (tile < in_group) {
        // row0: the tile's first row within the group; rows_left: its rows there (may be < BM)
        tl = Tile{off, i, tile * BM, s - tile * BM, tile_n * BN, tile_n};
        return true;
      }
      tile -= in_group;
      off += s;
    }
    return false;
  };
  const int k_tiles = int((p.K + BK - 1) / BK);

  const int wg = cutlass::canonical_warp_group_idx();
  Pipeline pipeline = make_pipeline<T>(shared);
  __syncthreads();

  if (wg == 0) {  // producer: cp.async of A's gathered rows and B's tile, stage by stage
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    const int t = threadIdx.x;
    Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.data()), typename T::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), typename T::SmemLayoutB{});
    // Thread t copies A's 16-byte chunk t % 8 (of the 64-wide K tile) of rows t / 8 + 16 j,
    // and B's chunk t % 16 (of 128 columns) of K rows t / 16 + 8 ka, columns + 128 nh. Every
    // step is a whole number of the swizzle atoms (A: 8 rows x 64 K, B: 64 columns x 8 K), so
    // a chunk's place in shared memory is its first place plus a constant per step; what does
    // not change from stage to stage is computed once (a producer's register budget is small).
    using AtomA = typename T::Mainloop::SmemLayoutAtomA;
    using AtomB = typename T::Mainloop::SmemLayoutAtomB;
    static_assert(BK == 64 && size<1>(AtomA{}) == 64 && 16 % size<0>(AtomA{}) == 0,
                  "A: one 128-byte swizzle atom spans the K tile");
    static_assert(EPI == kDSwiGLU || T::kTmaB || (BN % 128 == 0 && 128 % size<0>(AtomB{}) == 0 &&
                                                  8 % size<1>(AtomB{}) == 0),
                  "B: 128 columns and 8 K rows are whole swizzle atoms");
    constexpr int kA = BM / 16, kNh = BN / 128, kKa = BK / 8;
    const int kc = (t % 8) * 8, n = (t % 16) * 8, kb = t / 16;
    auto at = [](auto& tensor, int i, int j) { return cast_smem_ptr_to_uint(&tensor(i, j, 0)); };
    const uint32_t a_base = at(sA, 0, 0), b_base = at(sB, 0, 0);
    const uint32_t a_stage = cast_smem_ptr_to_uint(&sA(0, 0, 1)) - a_base;
    const uint32_t b_stage = cast_smem_ptr_to_uint(&sB(0, 0, 1)) - b_base;
    const uint32_t a_first = at(sA, t / 8, kc) - a_base, a_step = at(sA, 16, 0) - a_base;
    const uint32_t b_first = at(sB, n, kb) - b_base, b_nstep = at(sB, 128, 0) - b_base,
                   b_kstep = at(sB, 0, 8) - b_base;
    // kDSwiGLU's B (w_out[g]^T, K-major in place): thread t copies chunk t % 8 of the tile's
    // rows (output columns) t / 8 + 16 j, whole 8 x 64 swizzle atoms per step, as A
    [[maybe_unused]] uint32_t bk_first = 0, bk_step = 0;
    if constexpr (EPI == kDSwiGLU) {
      static_assert(size<1>(AtomB{}) == 64 && 16 % size<0>(AtomB{}) == 0,
                    "B K-major: one 128-byte swizzle atom spans the K tile");
      bk_first = at(sB, t / 8, kc) - b_base;
      bk_step = at(sB, 16, 0) - b_base;
    }
    State write = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t cta = blockIdx.x; cta < tiles; cta += gridDim.x) {
      Tile tl;
      if (!locate(cta, tl)) continue;
      const int64_t off = tl.off, group = tl.group, row0 = tl.row0,
                    rows_left = tl.rows_left, col0 = tl.col0, tile_n = tl.tile_n;
      int32_t a_src[kA];  // x's row of each A row of this thread (-1: zeros)
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kA; ++j) {
        const int r = t / 8 + 16 * j;
        int32_t src = -1;
        if (r < rows_left) {
          const int64_t pair = off + row0 + r;
          const int64_t xr = p.index ? int64_t(p.index[pair]) : pair;
          if (xr >= 0 && xr < p.X) src = int32_t(xr);  // a malformed index reads zeros
        }
        a_src[j] = src;
      }
      // B's columns of 128-wide block nh: col0 + 128 nh, or with SwiGLU the gate block (the
      // first half of the tile) and the up block (the second) of output columns jb + ...
      const int64_t jb = tile_n * (BN / 2), half_n = p.N / 2;
      const Ep* w = p.w + group * p.K * p.N + n;
      int64_t b_col[kNh];
      bool b_ok[kNh];
      CUTLASS_PRAGMA_UNROLL
      for (int nh = 0; nh < kNh; ++nh) {
        if constexpr (EPI == kSwiGLU) {
          const int64_t j = jb + (nh % (kNh / 2)) * 128 + n;
          b_col[nh] = (nh < kNh / 2 ? 0 : half_n) + j - n;
          b_ok[nh] = j < half_n;
        } else {
          b_col[nh] = col0 + 128 * nh;
          b_ok[nh] = col0 + 128 * nh + n < p.N;
        }
      }
      // TMA: half hf of the tile (columns [0, BN / 2) of the stage, then the rest) reads w's
      // columns from its first: SwiGLU's gate jb and up half_n + jb, else col0 and col0 + BN / 2
      auto tma_parts = [&] {
        if constexpr (T::kTmaB) {
          Tensor mB = tma_b.get_tma_tensor(make_shape(int32_t(p.N), int32_t(p.K), int32_t(p.G)));
          Tensor mBg = mB(_, _, int32_t(group));
          Tensor sBh = flat_divide(sB, typename T::BHalf{});  // (BN / 2, BK, 2, 1, stages)
          auto cta = tma_b.get_slice(Int<0>{});
          auto part = [&](int hf) {
            const int32_t c = EPI == kSwiGLU ? int32_t((hf ? half_n : 0) + jb)
                                             : int32_t(col0 + hf * (BN / 2));
            Tensor gB = local_tile(domain_offset(make_coord(c, 0), mBg), typename T::BHalf{},
                                   make_coord(0, _));  // (BN / 2, BK, k tiles)
            return cute::make_tuple(cta.partition_S(gB), cta.partition_D(sBh(_, _, hf, 0, _)));
          };
          return cute::make_tuple(part(0), part(1));  // ((source, destination) per half)
        } else {
          return 0;
        }
      };
      [[maybe_unused]] auto tma_io = tma_parts();
      for (int kt = 0; kt < k_tiles; ++kt) {
        pipeline.producer_acquire(write);
        const uint32_t sa = a_base + write.index() * a_stage + a_first;
        const uint32_t sb = b_base + write.index() * b_stage + b_first;
        const int64_t k0 = int64_t(kt) * BK;
        const bool ka_ok = k0 + kc < p.K;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kA; ++j) {
          const bool ok = ka_ok && a_src[j] >= 0;
          cp_async_16(sa + j * a_step, ok ? p.x + int64_t(a_src[j]) * p.K + k0 + kc : p.x,
                      ok ? 16 : 0);
        }
        if constexpr (T::kTmaB) {
          if (t == 0) {  // (before this thread's arrival in producer_commit: the phase waits)
            auto* bar = pipeline.producer_get_barrier(write);
            cutlass::arch::ClusterTransactionBarrier::expect_transaction(bar, T::kTmaBytes);
            auto& h0 = get<0>(tma_io);
            auto& h1 = get<1>(tma_io);
            copy(tma_b.with(*bar), get<0>(h0)(_, _, _, kt), get<1>(h0)(_, _, _, write.index()));
            copy(tma_b.with(*bar), get<0>(h1)(_, _, _, kt), get<1>(h1)(_, _, _, write.index()));
          }
        } else if constexpr (EPI == kDSwiGLU) {
          const uint32_t sbk = b_base + write.index() * b_stage + bk_first;
          const Ep* wk = p.w + group * p.N * p.K + k0 + kc;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < BN / 16; ++j) {
            const int64_t col = col0 + t / 8 + 16 * j;
            const bool ok = ka_ok && col < p.N;
            cp_async_16(sbk + j * bk_step, ok ? wk + col * p.K : p.w, ok ? 16 : 0);
          }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int nh = 0; nh < kNh; ++nh) {
            CUTLASS_PRAGMA_UNROLL
            for (int ka = 0; ka < kKa; ++ka) {
              const int64_t k = k0 + kb + 8 * ka;
              const bool ok = b_ok[nh] && k < p.K;
              cp_async_16(sb + nh * b_nstep + ka * b_kstep, ok ? w + k * p.N + b_col[nh] : p.w,
                          ok ? 16 : 0);
            }
          }
        }
        pipeline.producer_commit(write, cutlass::arch::cpasync_barrier_arrive);
        ++write;
      }
    }
    pipeline.producer_tail(write);
  } else {  // consumers: CUTLASS's GMMA mainloop, then the epilogue on the accumulators
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    State read;
    for (int64_t cta = blockIdx.x; cta < tiles; cta += gridDim.x) {
      Tile tl;
      if (!locate(cta, tl)) continue;
      const int64_t off = tl.off, row0 = tl.row0, rows_left = tl.rows_left,
                    col0 = tl.col0, tile_n = tl.tile_n;
      auto [acc, coord] =
          consume<T>(pipeline, shared, k_tiles, threadIdx.x - T::kProducers, read);
      static_assert(decltype(size(acc))::value % 2 == 0, "accumulators come in column pairs");
      if constexpr (EPI == kDSwiGLU) {
        // values (2, 2, BN / 8) per M block: 2i, 2i + 1 are columns c, c + 1 of one row, value
        // bit 1 picks the row (r or r + 8), and the 4 lanes of a quad hold the same rows: each
        // thread sums its columns of a row, the quad adds its 4 sums
        static_assert(decltype(size<2>(acc))::value == 1, "one GMMA N block per tile");
        constexpr int kMb = decltype(size<1>(acc))::value;
        float part[2 * kMb];
        const int64_t two_n = 2 * p.N;
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kMb; ++m) {
          part[2 * m] = part[2 * m + 1] = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int v = 0; v < size<0>(acc); v += 2) {
            const int r = get<0>(coord(v, m, 0));
            const int64_t c = col0 + get<1>(coord(v, m, 0));
            if (r >= rows_left || c >= p.N) continue;
            const int64_t row = off + row0 + r;
            const float s = p.scale[row];
            const Ep* ur = p.u + row * two_n;
            cutlass::Array<Ep, 2> dg, du;
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) {
              const float dhw = acc(v + e, m, 0), dh = dhw * s;
              part[2 * m + (v / 2) % 2] += dhw * float(p.h[row * p.N + c + e]);
              const float gate = float(ur[c + e]), up = float(ur[p.N + c + e]);
              const float sig = 1.0f / (1.0f + __expf(-gate));
              dg[e] = Ep(dh * up * sig * (1.0f + gate * (1.0f - sig)));
              du[e] = Ep(dh * gate * sig);
            }
            Ep* out = p.out + row * two_n;
            *reinterpret_cast<cutlass::Array<Ep, 2>*>(out + c) = dg;
            *reinterpret_cast<cutlass::Array<Ep, 2>*>(out + p.N + c) = du;
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kMb; ++m) {
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            float v = part[2 * m + half];
            v += __shfl_xor_sync(0xffffffff, v, 1);
            v += __shfl_xor_sync(0xffffffff, v, 2);
            const int r = get<0>(coord(2 * half, m, 0));  // (value 2: the row + 8)
            if (threadIdx.x % 4 == 0 && r < rows_left) {
              p.part[(off + row0 + r) * tiles_n + tile_n] = v;
            }
          }
        }
      } else if constexpr (EPI == kSwiGLU) {
        // GMMA's accumulators (values (2, 2, BN / 8), M blocks, 1 N block): a thread holds the
        // same columns of both tile halves; value v < BN / 4 (per M block) is a gate column, v
        // + BN / 4 its up column, and values 2i, 2i + 1 are adjacent columns of one row
        static_assert(T::BN == 256 && decltype(size<2>(acc))::value == 1 &&
                      decltype(size<0>(acc))::value == T::BN / 2,
                      "SwiGLU pairs the halves of a 256-wide tile's single GMMA N block");
        constexpr int kHalf = T::BN / 4;
        const int64_t half_n = p.N / 2, jb = tile_n * (T::BN / 2);
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < size<1>(acc); ++m) {
          CUTLASS_PRAGMA_UNROLL
          for (int v = 0; v < kHalf; v += 2) {
            const int r = get<0>(coord(v, m, 0));
            const int64_t j = jb + get<1>(coord(v, m, 0));
            if (r >= rows_left || j >= half_n) continue;
            cutlass::Array<Ep, 2> pair;  // (j even, I a multiple of 8: a 4-byte aligned store)
            pair[0] = Ep(silu(acc(v, m, 0)) * acc(v + kHalf, m, 0));
            pair[1] = Ep(silu(acc(v + 1, m, 0)) * acc(v + 1 + kHalf, m, 0));
            *reinterpret_cast<cutlass::Array<Ep, 2>*>(p.out + (off + row0 + r) * half_n + j) = pair;
          }
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc); i += 2) {
          // values 2i and 2i + 1 of a thread are columns c, c + 1 of one row (c even)
          const int r = get<0>(coord(i));
          const int64_t c = col0 + get<1>(coord(i));
          if (r >= rows_left || c >= p.N) continue;
          float v0 = acc(i), v1 = acc(i + 1);
          if constexpr (EPI == kScale) {
            const float s = p.scale[off + row0 + r];
            v0 *= s;
            v1 *= s;
          }
          cutlass::Array<Ep, 2> pair;  // (c even, N a multiple of 8: a 4-byte aligned store)
          pair[0] = Ep(v0);
          pair[1] = Ep(v1);
          *reinterpret_cast<cutlass::Array<Ep, 2>*>(p.out + (off + row0 + r) * p.N + c) = pair;
        }
      }
    }
  }
#endif
}

// The gathered weight gradient (DrhsParams): work item i computes output tile i % tiles (row-major
// over the K / BM x N / BN tiles) of group i / tiles; persistent, as the forward's kernel: a 1-D
// grid of at most one CTA per SM walks the items in strides of its size. Its producer reads both
// operands as rows along the contraction: A's tile is BM consecutive elements of each gathered x
// row (M-major, a 64 x 8 swizzle atom), B's is BN of each dy row, 16-byte chunks.
template <class T, class Ep>
__global__ void __launch_bounds__(T::kThreads, 1) drhs_kernel(DrhsParams<Ep> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename T::Pipeline;
  using State = typename Pipeline::PipelineState;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK;
  extern __shared__ __align__(128) char smem_raw[];
  auto& shared = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int64_t tiles_n = (p.N + BN - 1) / BN;
  const int64_t tiles = ((p.K + BM - 1) / BM) * tiles_n;
  struct Item {
    int64_t off, rows, m0, col0;
    Ep* out;
    int k_tiles;
  };
  // item i: its group's first pair and pairs (clamped as fill_groups does), its tile's corner
  auto locate = [&](int64_t i) {
    const int64_t group = i / tiles, tile = i % tiles;
    int64_t off = 0, rows = 0;
    for (int64_t g = 0; g <= group; ++g) {
      const int64_t s = detail::clamp_size(p.sizes[g], p.M, off);
      if (g == group) rows = s; else off += s;
    }
    return Item{off, rows, tile / tiles_n * BM, tile % tiles_n * BN,
                p.out + group * p.K * p.N, int((rows + BK - 1) / BK)};
  };
  const int64_t items = tiles * p.G;

  const int wg = cutlass::canonical_warp_group_idx();
  Pipeline pipeline = make_pipeline<T>(shared);
  __syncthreads();

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    const int t = threadIdx.x;
    Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.data()), typename T::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), typename T::SmemLayoutB{});
    // Thread t copies chunk t % 16 (of 128 columns) of contraction rows t / 16 + 8 ka of both
    // operands (B: columns + 128 nh too); whole swizzle atoms per step, as in the forward's B.
    using AtomA = typename T::Mainloop::SmemLayoutAtomA;
    using AtomB = typename T::Mainloop::SmemLayoutAtomB;
    static_assert(BM == 128 && 128 % size<0>(AtomA{}) == 0 && 8 % size<1>(AtomA{}) == 0,
                  "A: 128 M-major columns and 8 K rows are whole swizzle atoms");
    static_assert(BN % 128 == 0 && 128 % size<0>(AtomB{}) == 0 && 8 % size<1>(AtomB{}) == 0,
                  "B: 128 columns and 8 K rows are whole swizzle atoms");
    constexpr int kNh = BN / 128, kKa = BK / 8;
    const int c8 = (t % 16) * 8, kb = t / 16;
    auto at = [](auto& tensor, int i, int j) { return cast_smem_ptr_to_uint(&tensor(i, j, 0)); };
    const uint32_t a_base = at(sA, 0, 0), b_base = at(sB, 0, 0);
    const uint32_t a_stage = cast_smem_ptr_to_uint(&sA(0, 0, 1)) - a_base;
    const uint32_t b_stage = cast_smem_ptr_to_uint(&sB(0, 0, 1)) - b_base;
    const uint32_t a_first = at(sA, c8, kb) - a_base, a_kstep = at(sA, 0, 8) - a_base;
    const uint32_t b_first = at(sB, c8, kb) - b_base, b_nstep = at(sB, 128, 0) - b_base,
                   b_kstep = at(sB, 0, 8) - b_base;
    State write = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
      const Item it = locate(i);
      const bool a_col_ok = it.m0 + c8 < p.K;
      const Ep* dy = p.dy + it.col0 + c8;
      // x's row of each of this thread's contraction rows of a stage (-1: zeros), read one stage
      // ahead so that the index loads' latency hides behind the copies
      auto sources = [&](int kt, int32_t (&xr)[kKa]) {
        CUTLASS_PRAGMA_UNROLL
        for (int ka = 0; ka < kKa; ++ka) {
          const int64_t k = int64_t(kt) * BK + kb + 8 * ka;  // the pair within the group
          int64_t r = -1;
          if (k < it.rows) {
            r = p.index ? int64_t(p.index[it.off + k]) : it.off + k;
            r = r >= 0 && r < p.X ? r : -1;  // a malformed index reads zeros
          }
          xr[ka] = int32_t(r);
        }
      };
      int32_t xr[kKa], next[kKa];
      if (it.k_tiles > 0) sources(0, xr);
      for (int kt = 0; kt < it.k_tiles; ++kt) {
        if (kt + 1 < it.k_tiles) sources(kt + 1, next);
        pipeline.producer_acquire(write);
        const uint32_t sa = a_base + write.index() * a_stage + a_first;
        const uint32_t sb = b_base + write.index() * b_stage + b_first;
        CUTLASS_PRAGMA_UNROLL
        for (int ka = 0; ka < kKa; ++ka) {
          const int64_t k = int64_t(kt) * BK + kb + 8 * ka;
          const bool ok = a_col_ok && xr[ka] >= 0;
          cp_async_16(sa + ka * a_kstep, ok ? p.x + int64_t(xr[ka]) * p.K + it.m0 + c8 : p.x,
                      ok ? 16 : 0);
          CUTLASS_PRAGMA_UNROLL
          for (int nh = 0; nh < kNh; ++nh) {
            const bool b_ok = k < it.rows && it.col0 + c8 + 128 * nh < p.N;
            cp_async_16(sb + nh * b_nstep + ka * b_kstep,
                        b_ok ? dy + (it.off + k) * p.N + 128 * nh : p.dy, b_ok ? 16 : 0);
          }
        }
        pipeline.producer_commit(write, cutlass::arch::cpasync_barrier_arrive);
        ++write;
        CUTLASS_PRAGMA_UNROLL
        for (int ka = 0; ka < kKa; ++ka) xr[ka] = next[ka];
      }
    }
    pipeline.producer_tail(write);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    State read;
    for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
      const Item it = locate(i);  // (an empty group's tile: zeros, its gradient)
      auto [acc, coord] =
          consume<T>(pipeline, shared, it.k_tiles, threadIdx.x - T::kProducers, read);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < size(acc); v += 2) {  // values v, v + 1: columns c, c + 1 of one row
        const int64_t r = it.m0 + get<0>(coord(v)), c = it.col0 + get<1>(coord(v));
        if (r >= p.K || c >= p.N) continue;
        cutlass::Array<Ep, 2> pair;
        pair[0] = Ep(acc(v));
        pair[1] = Ep(acc(v + 1));
        *reinterpret_cast<cutlass::Array<Ep, 2>*>(it.out + r * p.N + c) = pair;
      }
    }
  }
#endif
}

}  // namespace ep_comm::gemm::gather
