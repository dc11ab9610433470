// The grouped GEMM's kernels and their set-up, shared by passes.cu (the handler) and
// {forward,dlhs,drhs}.cu (one pass's CUTLASS kernels each). See passes.cu.
#pragma once

// (the FFI header first: a CUTLASS header leaves -Wmissing-field-initializers an error, which
// jaxlib 0.11's FFI header trips)
#include "xla/ffi/api/ffi.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_gemm.h"
#include "common.cuh"

namespace ffi = xla::ffi;
using namespace cute;

namespace ep_comm::gemm::detail {

enum Pass : int64_t { kForward = 0, kDlhs = 1, kDrhs = 2 };

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Problem = ProblemShape::UnderlyingProblemShape;

// The tile configs compiled in (the handler's "config" attribute picks one per call):
//   0 cooperative: two consumer warpgroups share a 128x256 tile (64-deep K steps);
//   1 ping-pong: each consumer warpgroup owns a 128x128 tile, one's epilogue under the other's
//     mainloop (meant for short K, as drhs's ragged K; on an H200 the clusters did better);
//   2 cooperative 256x128 in clusters of 1x2 (each A tile multicast by TMA to the two CTAs of
//     a cluster: CUTLASS's example 57 for grouped problems);
//   3 cooperative 128x256 in clusters of 2x1 (each B tile multicast to two CTAs);
//   4 cooperative 128x256 in clusters of 1x2 (each A tile multicast to two CTAs).
// CUTLASS's grouped tile scheduler rounds each group's tiles up to whole clusters: 2 and 3 to
// 256 rows, so on a routing's uneven groups they run about 6% more row tiles than 0, 1 and 4
// (docs/performance.md, "Equal groups flatter the clusters"); 4 clusters along N instead,
// which the benchmarked shapes' N divide into pairs of 256-wide tiles (all but I=768).
// The clusters halve one operand's L2 -> SMEM traffic; whether that pays on a pass is measured
// (layer_bench's GEMM rows), not assumed.
template <class Tile, class Cluster, class Kernel, class Epi>
struct TileConfig {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule = Kernel;
  using EpilogueSchedule = Epi;
};
template <class Tile, class Cluster>
using CooperativeConfig = TileConfig<Tile, Cluster,
                                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Cooperative = CooperativeConfig<Shape<_128, _256, _64>, Shape<_1, _1, _1>>;
using Pingpong = TileConfig<Shape<_128, _128, _64>, Shape<_1, _1, _1>,
                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                            cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using CooperativeTallCluster = CooperativeConfig<Shape<_256, _128, _64>, Shape<_1, _2, _1>>;
using CooperativeWideCluster = CooperativeConfig<Shape<_128, _256, _64>, Shape<_2, _1, _1>>;
using CooperativeRowCluster = CooperativeConfig<Shape<_128, _256, _64>, Shape<_1, _2, _1>>;
constexpr int kConfigs = 5;

// Calls f with config `config`'s TileConfig (a default-constructed tag).
template <class F>
decltype(auto) with_config(int config, F&& f) {
  switch (config) {
    case 1: return f(Pingpong{});
    case 2: return f(CooperativeTallCluster{});
    case 3: return f(CooperativeWideCluster{});
    case 4: return f(CooperativeRowCluster{});
    default: return f(Cooperative{});
  }
}

// One CUTLASS kernel: inputs of Element with A's and B's layouts (CUTLASS's convention: A is
// M x K, B is K x N; RowMajor/ColumnMajor name which index is contiguous), D row-major.
template <class Element, class LayoutA, class LayoutB, class Config = Cooperative>
struct Kernel {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using KernelSchedule = typename Config::KernelSchedule;
  using EpilogueSchedule = typename Config::EpilogueSchedule;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlign,  // no source C
      Element, LayoutD*, kAlign, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

// The per-group arguments CUTLASS reads on the device, written by setup_kernel.
template <class K>
struct GroupArgs {
  Problem* problems;
  const typename K::Gemm::ElementA** a;
  const typename K::Gemm::ElementB** b;
  typename K::Gemm::ElementD** d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  int32_t* sizes;  // the clamped group sizes (G), then their total
};

// The groups' CUTLASS arguments, walking the groups in order (G is the local expert count: tens
// to hundreds), each size clamped so that every group lies inside the M rows. Host and device:
// the layout test (EP_COMM_GEMM_LAYOUT_TEST) runs it on the host.
template <class K, class E>
CUTLASS_HOST_DEVICE void fill_groups(GroupArgs<K> g, const int32_t* group_sizes, int64_t G,
                                     int64_t M, int64_t k_dim, int64_t n_dim, int pass,
                                     const E* a, const E* b, E* d) {
  int64_t off = 0;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t s = clamp_size(group_sizes[i], M, off);
    g.sizes[i] = static_cast<int32_t>(s);
    const int m = static_cast<int>(s), kk = static_cast<int>(k_dim), nn = static_cast<int>(n_dim);
    if (pass != kDrhs) {
      // forward: (s x K) . (K x N); dlhs: (s x N) . (N x K), B = w[g]^T read K-major in place
      const int inner = pass == kForward ? kk : nn, outer = pass == kForward ? nn : kk;
      g.problems[i] = Problem(m, outer, inner);
      g.a[i] = a + off * inner;
      g.b[i] = b + i * k_dim * n_dim;
      g.d[i] = d + off * outer;
      g.stride_a[i] = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, inner, 1});
      g.stride_b[i] = cutlass::make_cute_packed_stride(typename K::StrideB{}, {outer, inner, 1});
      g.stride_d[i] = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, outer, 1});
    } else {  // drhs: (K x s) . (s x N); an empty group runs no tile (zeroed by zero_groups)
      g.problems[i] = s == 0 ? Problem(0, nn, 0) : Problem(kk, nn, m);
      g.a[i] = a + off * k_dim;
      g.b[i] = b + off * n_dim;
      g.d[i] = d + i * k_dim * n_dim;
      g.stride_a[i] = cutlass::make_cute_packed_stride(typename K::StrideA{}, {kk, m, 1});
      g.stride_b[i] = cutlass::make_cute_packed_stride(typename K::StrideB{}, {nn, m, 1});
      g.stride_d[i] = cutlass::make_cute_packed_stride(typename K::StrideD{}, {kk, nn, 1});
    }
    off += s;
  }
  g.sizes[G] = static_cast<int32_t>(off);
}

template <class K, class E>
__global__ void setup_kernel(GroupArgs<K> g, const int32_t* group_sizes, int64_t G, int64_t M,
                             int64_t k_dim, int64_t n_dim, int pass, const E* a, const E* b,
                             E* d) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    fill_groups<K, E>(g, group_sizes, G, M, k_dim, n_dim, pass, a, b, d);
  }
}

// The (K, N) slabs of empty groups to zero.
static __global__ void zero_groups_kernel(uint4* out, const int32_t* sizes, int64_t units) {
  if (sizes[blockIdx.y] != 0) return;
  uint4* slab = out + blockIdx.y * units;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    slab[u] = uint4{0, 0, 0, 0};
  }
}

inline std::string cuda_str(cudaError_t e) { return std::string(cudaGetErrorString(e)); }

// Device memory for the handler: XLA's scratch allocator inside XLA, cudaMallocAsync outside
// (the selftest).
struct Memory {
  virtual ~Memory() = default;
  virtual void* get(size_t bytes) = 0;
};

constexpr size_t kAlignBytes = 128;
inline size_t aligned_bytes(size_t bytes) { return (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// The workspace buffer XLA allocates as a second result (its size from workspace_bytes at trace
// time), handed out in 128-byte aligned pieces.
struct BufferMemory : Memory {
  BufferMemory(void* base, size_t size) : base(static_cast<uint8_t*>(base)), size(size) {}
  void* get(size_t bytes) override {
    if (used + aligned_bytes(bytes) > size) return nullptr;
    void* p = base + used;
    used += aligned_bytes(bytes);
    return p;
  }
  uint8_t* base;
  size_t size, used = 0;
};

// The per-group arrays run_pass takes, in the order it takes them.
template <class K>
size_t group_args_bytes(int64_t G) {
  return 3 * aligned_bytes(G * sizeof(void*)) + aligned_bytes(G * sizeof(Problem)) +
         aligned_bytes(G * sizeof(typename K::StrideA)) +
         aligned_bytes(G * sizeof(typename K::StrideB)) +
         aligned_bytes(G * sizeof(typename K::StrideD)) + aligned_bytes((G + 1) * sizeof(int32_t));
}

// CUTLASS's arguments for G groups whose problems, pointers and strides are on the device (the
// pointers are null when only the workspace size is asked for).
template <class K>
typename K::Gemm::Arguments gemm_arguments(const GroupArgs<K>& g, int64_t G) {
  using Gemm = typename K::Gemm;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(G), g.problems, nullptr};
  args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.alpha_ptr = nullptr;
  args.epilogue.thread.beta_ptr = nullptr;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;
  args.hw_info.device_id = 0;
  cudaGetDevice(&args.hw_info.device_id);
  args.hw_info.sm_count = sm_count();
  return args;
}

// Bytes of workspace one call with G groups takes: the group arrays and CUTLASS's own.
template <class K>
size_t workspace_size(int64_t G) {
  GroupArgs<K> none{};
  return group_args_bytes<K>(G) + aligned_bytes(K::Gemm::get_workspace_size(gemm_arguments<K>(none, G)));
}

template <class K, class E>
ffi::Error run_pass(cudaStream_t stream, Memory& mem, int pass, const E* a, const E* b,
                    const int32_t* group_sizes, E* d, int64_t G, int64_t M, int64_t k_dim,
                    int64_t n_dim, bool zero_tail) {
  using Gemm = typename K::Gemm;
  GroupArgs<K> g;
  auto take = [&](auto*& p, size_t count) {
    p = static_cast<std::remove_reference_t<decltype(p)>>(mem.get(count * sizeof(*p)));
    return p != nullptr;
  };
  if (!take(g.problems, G) || !take(g.a, G) || !take(g.b, G) || !take(g.d, G) ||
      !take(g.stride_a, G) || !take(g.stride_b, G) || !take(g.stride_d, G) ||
      !take(g.sizes, G + 1)) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "ep_comm grouped GEMM: the workspace result has no room for the group "
                      "arguments (size it with collectives.grouped_gemm.workspace_bytes)");
  }
  setup_kernel<K, E><<<1, 1, 0, stream>>>(g, group_sizes, G, M, k_dim, n_dim, pass, a, b, d);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error::Internal("ep_comm grouped GEMM: setup launch: " + cuda_str(e));
  }
  if (M > 0) {
    typename Gemm::Arguments args = gemm_arguments<K>(g, G);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return ffi::Error::InvalidArgument(
          "ep_comm grouped GEMM: CUTLASS cannot run this problem (K=" + std::to_string(k_dim) +
          ", N=" + std::to_string(n_dim) + ")");
    }
    const size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = ws_bytes ? mem.get(ws_bytes) : nullptr;
    if (ws_bytes && ws == nullptr) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "ep_comm grouped GEMM: the workspace result has no room for "
                        "CUTLASS's own (size it with collectives.grouped_gemm.workspace_bytes)");
    }
    if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) {
      return ffi::Error::Internal("ep_comm grouped GEMM: CUTLASS initialize failed");
    }
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      return ffi::Error::Internal("ep_comm grouped GEMM: CUTLASS launch failed: " +
                                  cuda_str(cudaGetLastError()));
    }
  }
  if (pass == kDrhs) {
    const int64_t units = k_dim * n_dim * int64_t(sizeof(E)) / 16;
    if (G > 0 && units > 0) {
      dim3 grid(static_cast<unsigned>((units + 255) / 256 < 64 ? (units + 255) / 256 : 64),
                static_cast<unsigned>(G));
      zero_groups_kernel<<<grid, 256, 0, stream>>>(reinterpret_cast<uint4*>(d), g.sizes, units);
    }
  } else if (zero_tail) {
    zero_past_groups(stream, d, group_sizes, G, M, (pass == kForward ? n_dim : k_dim) * sizeof(E));
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal("ep_comm grouped GEMM: launch: " + cuda_str(e));
  return ffi::Error::Success();
}

// The operands' layouts of each pass (passes.cu's header).
template <int P>
struct PassLayouts {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct PassLayouts<kDlhs> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;  // w[g]^T, K-major in place
};
template <>
struct PassLayouts<kDrhs> {
  using A = cutlass::layout::ColumnMajor;  // x_g^T, M-major in place
  using B = cutlass::layout::RowMajor;
};

// One pass with tile config `config`; instantiated per pass and dtype in grouped_gemm_<pass>.cu
// (one translation unit each, so that the build compiles them in parallel).
template <class E, int P>
ffi::Error run_pass_cfg(int config, cudaStream_t stream, Memory& mem, const E* a, const E* b,
                        const int32_t* group_sizes, E* d, int64_t G, int64_t M, int64_t k_dim,
                        int64_t n_dim, bool zero_tail) {
  using L = PassLayouts<P>;
  return with_config(config, [&](auto c) {
    return run_pass<Kernel<E, typename L::A, typename L::B, decltype(c)>, E>(
        stream, mem, P, a, b, group_sizes, d, G, M, k_dim, n_dim, zero_tail);
  });
}

template <class E, int P>
size_t workspace_cfg(int config, int64_t G) {
  using L = PassLayouts<P>;
  return with_config(config, [&](auto c) {
    return workspace_size<Kernel<E, typename L::A, typename L::B, decltype(c)>>(G);
  });
}

#define EP_COMM_GEMM_INSTANCES(EXTERN, P)                                                     \
  EXTERN template ffi::Error run_pass_cfg<cutlass::bfloat16_t, P>(                           \
      int, cudaStream_t, Memory&, const cutlass::bfloat16_t*, const cutlass::bfloat16_t*,     \
      const int32_t*, cutlass::bfloat16_t*, int64_t, int64_t, int64_t, int64_t, bool);        \
  EXTERN template ffi::Error run_pass_cfg<cutlass::half_t, P>(                               \
      int, cudaStream_t, Memory&, const cutlass::half_t*, const cutlass::half_t*,             \
      const int32_t*, cutlass::half_t*, int64_t, int64_t, int64_t, int64_t, bool);        \
  EXTERN template size_t workspace_cfg<cutlass::bfloat16_t, P>(int, int64_t);                \
  EXTERN template size_t workspace_cfg<cutlass::half_t, P>(int, int64_t);

EP_COMM_GEMM_INSTANCES(extern, kForward)
EP_COMM_GEMM_INSTANCES(extern, kDlhs)
EP_COMM_GEMM_INSTANCES(extern, kDrhs)

}  // namespace ep_comm::gemm::detail
