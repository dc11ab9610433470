// ep_comm's grouped GEMM for the experts on Hopper (sm_90a), built on CUTLASS 3.x.
//
// Route: the C++ headers of the `nvidia-cutlass` wheel (collective builders, the pointer-array
// grouped kernel with warp-specialized TMA loads and GMMA, KernelPtrArrayTmaWarpSpecializedCooperative),
// not CUTLASS's Python DSL: the same XLA FFI + nanobind build as the engine's other kernels, no
// JIT at run time, and a module that is compiled once for sm_90a.
//
// One handler, three passes over G groups of rows (group g: rows [off_g, off_g + s_g) of the
// row operand, s_g = group_sizes[g]), in the layouts CUTLASS's Hopper mainloop takes natively, so
// that no operand is transposed in memory (GMMA reads 16-bit operands K-major or MN-major):
//   forward  out (M, N)    = a (M, K) . b[g] (K, N)          A row-major, B row-major (N-major)
//   dlhs     out (M, K)    = a (M, N) . b[g] (K, N)^T        A row-major, B column-major (K-major)
//   drhs     out[g] (K, N) = a_g (M_g, K)^T . b_g (M_g, N)   A column-major (M-major), B row-major
// (forward: a = x, b = w; dlhs: a = dy, b = w; drhs: a = x, b = dy), float32 accumulation, the
// output in the inputs' dtype (bfloat16 or float16). The group sizes stay on the device: a setup
// kernel turns them into CUTLASS's per-group problem shapes, pointers and strides, and the
// grouped kernel's persistent tile scheduler reads them there (no host synchronization, no
// per-step host work beyond the launch).
//
// Rows past the groups (forward, dlhs) are zeroed when zero_tail is set (else left unwritten);
// drhs writes zeros for empty groups. Malformed group sizes are clamped (a negative size is 0, a
// group ends at row M at the latest), so no kernel reads or writes outside its buffers.
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
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace cute;

namespace ep_comm::gemm {
namespace {

enum Pass : int64_t { kForward = 0, kDlhs = 1, kDrhs = 2 };

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Problem = ProblemShape::UnderlyingProblemShape;

// The module holds sm_90a code only (CMake: CUDA_ARCHITECTURES 90a): whether this GPU runs it.
bool hopper() {
  static const bool yes = [] {
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
               cudaSuccess &&
           major == 9;
  }();
  return yes;
}

// One CUTLASS kernel: inputs of Element with A's and B's layouts (CUTLASS's convention: A is
// M x K, B is K x N; RowMajor/ColumnMajor name which index is contiguous), D row-major.
template <class Element, class LayoutA, class LayoutB>
struct Kernel {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

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
    int64_t s = group_sizes[i];
    s = s < 0 ? 0 : (s > M - off ? M - off : s);
    g.sizes[i] = static_cast<int32_t>(s);
    const int m = static_cast<int>(s), kk = static_cast<int>(k_dim), nn = static_cast<int>(n_dim);
    if (pass == kForward) {  // (s x K) . (K x N)
      g.problems[i] = Problem(m, nn, kk);
      g.a[i] = a + off * k_dim;
      g.b[i] = b + i * k_dim * n_dim;
      g.d[i] = d + off * n_dim;
      g.stride_a[i] = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, kk, 1});
      g.stride_b[i] = cutlass::make_cute_packed_stride(typename K::StrideB{}, {nn, kk, 1});
      g.stride_d[i] = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, nn, 1});
    } else if (pass == kDlhs) {  // (s x N) . (N x K): B = w[g]^T, read K-major in place
      g.problems[i] = Problem(m, kk, nn);
      g.a[i] = a + off * n_dim;
      g.b[i] = b + i * k_dim * n_dim;
      g.d[i] = d + off * k_dim;
      g.stride_a[i] = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, nn, 1});
      g.stride_b[i] = cutlass::make_cute_packed_stride(typename K::StrideB{}, {kk, nn, 1});
      g.stride_d[i] = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, kk, 1});
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

// Rows [total, M) of a row-major (M, width) output to zero, 16 bytes at a time (width * 2 bytes
// is a multiple of 16: checked by the handler).
__global__ void zero_tail_kernel(uint4* out, const int32_t* total, int64_t M, int64_t units) {
  const int64_t first = *total;
  for (int64_t r = first + blockIdx.x; r < M; r += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) out[r * units + u] = uint4{0, 0, 0, 0};
  }
}

// The (K, N) slabs of empty groups to zero.
__global__ void zero_groups_kernel(uint4* out, const int32_t* sizes, int64_t units) {
  if (sizes[blockIdx.y] != 0) return;
  uint4* slab = out + blockIdx.y * units;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units;
       u += int64_t(gridDim.x) * blockDim.x) {
    slab[u] = uint4{0, 0, 0, 0};
  }
}

std::string cuda_str(cudaError_t e) { return std::string(cudaGetErrorString(e)); }

int sm_count() {
  static int count = [] {
    int device = 0;
    cudaGetDevice(&device);
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return count;
}

// Device memory for the handler: XLA's scratch allocator inside XLA, cudaMallocAsync outside
// (the selftest).
struct Memory {
  virtual ~Memory() = default;
  virtual void* get(size_t bytes) = 0;
};

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
                      "ep_comm grouped GEMM: no scratch memory for the group arguments");
  }
  setup_kernel<K, E><<<1, 1, 0, stream>>>(g, group_sizes, G, M, k_dim, n_dim, pass, a, b, d);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error::Internal("ep_comm grouped GEMM: setup launch: " + cuda_str(e));
  }
  if (M > 0) {
    using Elem = typename Gemm::ElementD;
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
    args.epilogue.ptr_D = reinterpret_cast<Elem**>(g.d);
    args.epilogue.dD = g.stride_d;
    args.hw_info.device_id = 0;
    cudaGetDevice(&args.hw_info.device_id);
    args.hw_info.sm_count = sm_count();
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
                        "ep_comm grouped GEMM: no scratch memory for CUTLASS's workspace");
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
  } else if (zero_tail && M > 0) {
    const int64_t width = pass == kForward ? n_dim : k_dim;
    const int64_t units = width * int64_t(sizeof(E)) / 16;
    const unsigned blocks = static_cast<unsigned>(M < 4096 ? M : 4096);
    zero_tail_kernel<<<blocks, 128, 0, stream>>>(reinterpret_cast<uint4*>(d), g.sizes + G, M,
                                                 units);
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal("ep_comm grouped GEMM: launch: " + cuda_str(e));
  return ffi::Error::Success();
}

template <class E>
ffi::Error run_typed(cudaStream_t stream, Memory& mem, int pass, const void* a, const void* b,
                     const int32_t* gs, void* d, int64_t G, int64_t M, int64_t k_dim,
                     int64_t n_dim, bool zero_tail) {
  using RowMajor = cutlass::layout::RowMajor;
  using ColumnMajor = cutlass::layout::ColumnMajor;
  auto ea = static_cast<const E*>(a);
  auto eb = static_cast<const E*>(b);
  auto ed = static_cast<E*>(d);
  switch (pass) {
    case kForward:
      return run_pass<Kernel<E, RowMajor, RowMajor>, E>(stream, mem, pass, ea, eb, gs, ed, G, M,
                                                        k_dim, n_dim, zero_tail);
    case kDlhs:
      return run_pass<Kernel<E, RowMajor, ColumnMajor>, E>(stream, mem, pass, ea, eb, gs, ed, G,
                                                           M, k_dim, n_dim, zero_tail);
    default:
      return run_pass<Kernel<E, ColumnMajor, RowMajor>, E>(stream, mem, pass, ea, eb, gs, ed, G,
                                                           M, k_dim, n_dim, zero_tail);
  }
}

struct ScratchMemory : Memory {
  explicit ScratchMemory(ffi::ScratchAllocator& s) : scratch(s) {}
  void* get(size_t bytes) override {
    auto p = scratch.Allocate(bytes, 128);
    return p.has_value() ? *p : nullptr;
  }
  ffi::ScratchAllocator& scratch;
};

std::string dims_str(const ffi::AnyBuffer& b) {
  std::string s = "(";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error GroupedGemm(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a,
                       ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                       ffi::Result<ffi::AnyBuffer> out, int64_t pass, int64_t zero_tail) {
  if (!hopper()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "ep_comm grouped GEMM: its kernels are sm_90a (Hopper) only, and this GPU "
                      "is not a Hopper");
  }
  const auto dt = a.element_type();
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || b.element_type() != dt ||
      out->element_type() != dt) {
    return ffi::Error::InvalidArgument(
        "ep_comm grouped GEMM: the operands and the result must all be bfloat16 or all float16");
  }
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t G = group_sizes.element_count();
  bool ok = ad.size() == 2;
  int64_t M = ok ? ad[0] : 0, k_dim = 0, n_dim = 0;
  if (ok && pass == kForward) {  // a (M, K), b (G, K, N), out (M, N)
    k_dim = ad[1];
    ok = bd.size() == 3 && bd[0] == G && bd[1] == k_dim && od.size() == 2 && od[0] == M;
    n_dim = ok ? bd[2] : 0;
    ok = ok && od[1] == n_dim;
  } else if (ok && pass == kDlhs) {  // a (M, N), b (G, K, N), out (M, K)
    n_dim = ad[1];
    ok = bd.size() == 3 && bd[0] == G && bd[2] == n_dim && od.size() == 2 && od[0] == M;
    k_dim = ok ? bd[1] : 0;
    ok = ok && od[1] == k_dim;
  } else if (ok && pass == kDrhs) {  // a (M, K), b (M, N), out (G, K, N)
    k_dim = ad[1];
    ok = bd.size() == 2 && bd[0] == M && od.size() == 3 && od[0] == G && od[1] == k_dim;
    n_dim = ok ? bd[1] : 0;
    ok = ok && od[2] == n_dim;
  } else {
    ok = false;
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "ep_comm grouped GEMM: pass " + std::to_string(pass) + " got a " + dims_str(a) + ", b " +
        dims_str(b) + ", " + std::to_string(G) + " groups and a result of " + dims_str(*out));
  }
  if (k_dim % 8 || n_dim % 8 || k_dim > INT32_MAX || n_dim > INT32_MAX || M > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        "ep_comm grouped GEMM: K and N must be multiples of 8 (16-byte rows for TMA), got K=" +
        std::to_string(k_dim) + ", N=" + std::to_string(n_dim));
  }
  if (!aligned16(a.untyped_data()) || !aligned16(b.untyped_data()) ||
      !aligned16(out->untyped_data())) {
    return ffi::Error::InvalidArgument("ep_comm grouped GEMM: buffers must be 16-byte aligned");
  }
  if (out->element_count() == 0) return ffi::Error::Success();
  ScratchMemory mem(scratch);
  if (dt == ffi::DataType::BF16) {
    return run_typed<cutlass::bfloat16_t>(stream, mem, static_cast<int>(pass), a.untyped_data(),
                                          b.untyped_data(), group_sizes.typed_data(),
                                          out->untyped_data(), G, M, k_dim, n_dim, zero_tail != 0);
  }
  return run_typed<cutlass::half_t>(stream, mem, static_cast<int>(pass), a.untyped_data(),
                                    b.untyped_data(), group_sizes.typed_data(),
                                    out->untyped_data(), G, M, k_dim, n_dim, zero_tail != 0);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupedGemm, GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()         // a
                                  .Arg<ffi::AnyBuffer>()         // b
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes (G,)
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int64_t>("pass")         // 0 forward, 1 dlhs, 2 drhs
                                  .Attr<int64_t>("zero_tail"));  // forward/dlhs: zero past groups

void* grouped_gemm_handler() { return reinterpret_cast<void*>(kGroupedGemm); }

// ---- selftest (compute-sanitizer) ---------------------------------------------------------------

namespace {

struct MallocMemory : Memory {
  explicit MallocMemory(cudaStream_t s) : stream(s) {}
  ~MallocMemory() override {
    for (void* p : held) cudaFreeAsync(p, stream);
  }
  void* get(size_t bytes) override {
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, stream) != cudaSuccess) return nullptr;
    held.push_back(p);
    return p;
  }
  cudaStream_t stream;
  std::vector<void*> held;
};

float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

long long selftest() {
  if (!hopper()) return -2;
  // G=4 groups over M=40 rows, K=64, N=32; sizes include an empty group, a negative size and a
  // total past M (clamped), then a well-formed call. Values are small integers: every product
  // is exact in float32 and bfloat16.
  const int64_t G = 4, M = 40, K = 64, N = 32;
  const int32_t cases[2][4] = {{7, -3, 50, 9}, {5, 0, 17, 11}};
  std::vector<uint16_t> x(M * K), w(G * K * N), dy(M * N);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(float(int(i % 5) - 2));
  for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(float(int(i % 3) - 1));
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = float_to_bf16(float(int(i % 7) - 3));
  cudaStream_t s;
  if (cudaStreamCreate(&s) != cudaSuccess) return -1;
  long long wrong = 0;
  for (const auto& sizes_in : cases) {
    int32_t clamped[4];
    int64_t off = 0;
    for (int i = 0; i < G; ++i) {
      int64_t v = sizes_in[i] < 0 ? 0 : std::min<int64_t>(sizes_in[i], M - off);
      clamped[i] = int32_t(v);
      off += v;
    }
    MallocMemory mem(s);
    auto up = [&](const void* h, size_t bytes) {
      void* p = mem.get(bytes);
      if (p) cudaMemcpyAsync(p, h, bytes, cudaMemcpyHostToDevice, s);
      return p;
    };
    void* dx = up(x.data(), x.size() * 2);
    void* dw = up(w.data(), w.size() * 2);
    void* ddy = up(dy.data(), dy.size() * 2);
    void* dgs = up(sizes_in, sizeof(sizes_in));
    void* out_f = mem.get(M * N * 2);
    void* out_l = mem.get(M * K * 2);
    void* out_r = mem.get(G * K * N * 2);
    if (!dx || !dw || !ddy || !dgs || !out_f || !out_l || !out_r) return -1;
    const auto* gs = static_cast<const int32_t*>(dgs);
    bool ok = run_typed<cutlass::bfloat16_t>(s, mem, kForward, dx, dw, gs, out_f, G, M, K, N, true)
                  .success() &&
              run_typed<cutlass::bfloat16_t>(s, mem, kDlhs, ddy, dw, gs, out_l, G, M, K, N, true)
                  .success() &&
              run_typed<cutlass::bfloat16_t>(s, mem, kDrhs, dx, ddy, gs, out_r, G, M, K, N, false)
                  .success();
    std::vector<uint16_t> hf(M * N), hl(M * K), hr(G * K * N);
    cudaMemcpyAsync(hf.data(), out_f, hf.size() * 2, cudaMemcpyDeviceToHost, s);
    cudaMemcpyAsync(hl.data(), out_l, hl.size() * 2, cudaMemcpyDeviceToHost, s);
    cudaMemcpyAsync(hr.data(), out_r, hr.size() * 2, cudaMemcpyDeviceToHost, s);
    if (!ok || cudaStreamSynchronize(s) != cudaSuccess) return -1;
    off = 0;
    for (int g = 0; g < G; ++g) {
      for (int64_t r = off; r < off + clamped[g]; ++r) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += bf16_to_float(x[r * K + k]) * bf16_to_float(w[(g * K + k) * N + n]);
          wrong += bf16_to_float(hf[r * N + n]) != bf16_to_float(float_to_bf16(acc));
        }
        for (int64_t k = 0; k < K; ++k) {
          float acc = 0;
          for (int64_t n = 0; n < N; ++n) acc += bf16_to_float(dy[r * N + n]) * bf16_to_float(w[(g * K + k) * N + n]);
          wrong += bf16_to_float(hl[r * K + k]) != bf16_to_float(float_to_bf16(acc));
        }
      }
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0;
          for (int64_t r = off; r < off + clamped[g]; ++r) acc += bf16_to_float(x[r * K + k]) * bf16_to_float(dy[r * N + n]);
          wrong += bf16_to_float(hr[(g * K + k) * N + n]) != bf16_to_float(float_to_bf16(acc));
        }
      }
      off += clamped[g];
    }
    for (int64_t r = off; r < M; ++r) {  // past the groups: zero
      for (int64_t n = 0; n < N; ++n) wrong += hf[r * N + n] != 0;
      for (int64_t k = 0; k < K; ++k) wrong += hl[r * K + k] != 0;
    }
  }
  cudaStreamDestroy(s);
  return wrong;
}

}  // namespace ep_comm::gemm

#ifdef EP_COMM_GEMM_LAYOUT_TEST
// The layout test, on the host (no GPU): fill_groups' problems, pointers and strides, read back
// through CuTe tensors the way CUTLASS's collectives read them (A as (M, K), B as (N, K), D as
// (M, N), each with its stride), must give each pass's product as the module docstring defines
// it, for well-formed and malformed group sizes. Built by CMake's gemm_layout_test target.
#include <cstdio>

namespace ep_comm::gemm {
namespace {

template <class K, class E>
long long check_pass(int pass, const std::vector<int32_t>& sizes, int64_t M, int64_t k_dim,
                     int64_t n_dim) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  auto fill = [](std::vector<E>& v, int mod) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = E(float(int(i % mod) - mod / 2));
  };
  std::vector<E> x(M * k_dim), w(G * k_dim * n_dim), dy(M * n_dim);
  fill(x, 5);
  fill(w, 3);
  fill(dy, 7);
  const int64_t out_size = pass == kForward ? M * n_dim : pass == kDlhs ? M * k_dim
                                                                        : G * k_dim * n_dim;
  std::vector<E> out_base(out_size);
  std::vector<Problem> problems(G);
  std::vector<const E*> pa(G), pb(G);
  std::vector<E*> pd(G);
  std::vector<typename K::StrideA> sa(G);
  std::vector<typename K::StrideB> sb(G);
  std::vector<typename K::StrideD> sd(G);
  std::vector<int32_t> clamped(G + 1);
  GroupArgs<K> g{problems.data(), pa.data(), pb.data(), pd.data(), sa.data(), sb.data(),
                 sd.data(), clamped.data()};
  const E* a = pass == kDlhs ? dy.data() : x.data();
  const E* b = pass == kDrhs ? dy.data() : w.data();
  fill_groups<K, E>(g, sizes.data(), G, M, k_dim, n_dim, pass, a, b, out_base.data());
  std::vector<float> got(out_size, 0.f), want(out_size, 0.f);
  long long wrong = 0;
  int64_t off = 0;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t s = clamped[i];
    // CUTLASS's view
    auto [pm, pn, pk] = problems[i];
    auto A = make_tensor(pa[i], make_layout(make_shape(pm, pk), take<0, 2>(sa[i])));
    auto B = make_tensor(pb[i], make_layout(make_shape(pn, pk), take<0, 2>(sb[i])));
    const int64_t d0 = pd[i] - out_base.data();
    for (int m = 0; m < pm; ++m) {
      for (int n = 0; n < pn; ++n) {
        float acc = 0;
        for (int k = 0; k < pk; ++k) acc += float(A(m, k)) * float(B(n, k));
        const int64_t at = d0 + m * int64_t(get<0>(sd[i])) + n * int64_t(get<1>(sd[i]));
        if (at < 0 || at >= out_size) return -1000000;  // outside the result
        got[at] = acc;
      }
    }
    // the definition
    for (int64_t r = off; r < off + s; ++r) {
      if (pass == kForward) {
        for (int64_t n = 0; n < n_dim; ++n) {
          float acc = 0;
          for (int64_t k = 0; k < k_dim; ++k)
            acc += float(x[r * k_dim + k]) * float(w[(i * k_dim + k) * n_dim + n]);
          want[r * n_dim + n] = acc;
        }
      } else if (pass == kDlhs) {
        for (int64_t k = 0; k < k_dim; ++k) {
          float acc = 0;
          for (int64_t n = 0; n < n_dim; ++n)
            acc += float(dy[r * n_dim + n]) * float(w[(i * k_dim + k) * n_dim + n]);
          want[r * k_dim + k] = acc;
        }
      }
    }
    if (pass == kDrhs) {
      for (int64_t k = 0; k < k_dim; ++k) {
        for (int64_t n = 0; n < n_dim; ++n) {
          float acc = 0;
          for (int64_t r = off; r < off + s; ++r)
            acc += float(x[r * k_dim + k]) * float(dy[r * n_dim + n]);
          want[(i * k_dim + k) * n_dim + n] = acc;
        }
      }
    }
    off += s;
  }
  if (clamped[G] != off) ++wrong;
  for (int64_t i = 0; i < out_size; ++i) wrong += got[i] != want[i];
  return wrong;
}

}  // namespace
}  // namespace ep_comm::gemm

int main() {
  using namespace ep_comm::gemm;
  using E = cutlass::bfloat16_t;
  using RowMajor = cutlass::layout::RowMajor;
  using ColumnMajor = cutlass::layout::ColumnMajor;
  const std::vector<std::vector<int32_t>> cases = {
      {5, 0, 17, 11}, {7, -3, 50, 9}, {0, 0, 0, 0}, {40, 0, 0, 0}, {1, 1, 1, 1}};
  long long wrong = 0;
  for (const auto& sizes : cases) {
    wrong += check_pass<Kernel<E, RowMajor, RowMajor>, E>(kForward, sizes, 40, 24, 16);
    wrong += check_pass<Kernel<E, RowMajor, ColumnMajor>, E>(kDlhs, sizes, 40, 24, 16);
    wrong += check_pass<Kernel<E, ColumnMajor, RowMajor>, E>(kDrhs, sizes, 40, 24, 16);
  }
  std::printf("grouped GEMM layout test: %lld wrong values\n", wrong);
  return wrong == 0 ? 0 : 1;
}
#endif  // EP_COMM_GEMM_LAYOUT_TEST
