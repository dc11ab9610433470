// The grouped GEMM's fused forward pass on Hopper (sm_90a): the kernel in
// gather.cuh, its launch, its XLA FFI handler and its selftest.
//
//   out[r] = epilogue(x[index[r]] . w[g])   for the rows r of group g (contiguous from row 0)
//
// - x (X, K): the buffer the exchange delivered (one row per received token); index (M,): the
//   token row each (token, local expert) pair reads, so the pairs' rows (expert_x, M x K) are
//   never written. An empty index reads row r itself (X == M): the down projection's h.
// - w (G, K, N) as the forward pass takes it; float32 accumulation.
// - epilogue: "store" (out (M, N)); "swiglu" (w's first N/2 columns the gate projection, its
//   last N/2 the up projection; out (M, N/2) = silu(gate) * up, so u (M, N) is never written); "scale" (out (M, N) = acc * scale[r], the
//   router weight of the pair, float32).
// Rows past the groups are zero with zero_tail (else unwritten). Malformed group sizes are
// clamped as by the other passes; an index outside [0, X) reads a zero row.
#include "xla/ffi/api/ffi.h"  // (first: see impl.cuh)

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <string>
#include <vector>

#include "grouped_gemm.h"
#include "common.cuh"
#include "gather.cuh"

namespace ffi = xla::ffi;

namespace ep_comm::gemm {
namespace {

using namespace gather;

std::string cuda_error(const char* what) {
  return std::string("ep_comm fused grouped GEMM: ") + what + ": " +
         cudaGetErrorString(cudaGetLastError());
}

// The persistent kernels' grid for `work` tiles: one CTA per SM (its shared memory holds one),
// at most max_ctas where that is set (> 0), none where there is no work. False where the
// device's SM count cannot be read.
bool persistent_grid(int64_t work, int max_ctas, unsigned& ctas) {
  const int sms = detail::sm_count();
  ctas = unsigned(std::min<int64_t>(work, max_ctas > 0 ? max_ctas : sms));
  return sms > 0;
}

template <class E, class Config, int EPI>
ffi::Error launch(cudaStream_t stream, const Params<E>& p) {
  // (kDSwiGLU reads B = w_out[g]^T K-major in place)
  using T = Traits<E, Config, cutlass::layout::RowMajor,
                   std::conditional_t<EPI == kDSwiGLU, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>>;
  static const cudaError_t attr = cudaFuncSetAttribute(
      kernel<T, E, EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (attr != cudaSuccess) {
    return ffi::Error::Internal("ep_comm fused grouped GEMM: shared memory attribute: " +
                                std::string(cudaGetErrorString(attr)));
  }
  int64_t tiles_m, tiles_n;
  grid_tiles<T>(p, tiles_m, tiles_n);
  unsigned ctas = 0;  // (the kernel is persistent: its CTAs walk the tiles)
  if (!persistent_grid(tiles_m * tiles_n, p.max_ctas, ctas)) {
    return ffi::Error::Internal(cuda_error("the device's SM count"));
  }
  // no group: every tile would return at once; no column (N = 0): no tile
  if (p.G == 0 || ctas == 0) return ffi::Error::Success();
  // config 2: B's TMA descriptor over w, encoded here (w's address changes from call to call)
  if (T::kTmaB && reinterpret_cast<uintptr_t>(p.w) % 16 != 0) {
    return ffi::Error::InvalidArgument("ep_comm fused grouped GEMM: config 2 (B by TMA) needs w "
                                       "16-byte aligned");
  }
  auto tma = [&] {
    if constexpr (T::kTmaB) {
      return make_tma_copy(SM90_TMA_LOAD{}, T::b_tensor(p.w, p.N, p.K, p.G),
                           typename T::SmemLayoutBHalf{});
    } else {
      return NoTma{};
    }
  }();
  kernel<T, E, EPI><<<ctas, T::kThreads, T::kSmemBytes, stream>>>(p, tma);
  return cudaPeekAtLastError() == cudaSuccess ? ffi::Error::Success()
                                               : ffi::Error::Internal(cuda_error("launch"));
}

template <class E, class Config>
ffi::Error launch_epilogue(cudaStream_t stream, const Params<E>& p, int epilogue) {
  switch (epilogue) {
    case kSwiGLU:  // (the handler takes it with the 256-wide tile only)
      if constexpr (size<1>(typename Config::TileShape{}) == 256) {
        return launch<E, Config, kSwiGLU>(stream, p);
      } else {
        return ffi::Error::InvalidArgument("ep_comm fused grouped GEMM: swiglu needs config 0 "
                                           "or 2");
      }
    case kScale: return launch<E, Config, kScale>(stream, p);
    case kDSwiGLU:  // (its handler takes configs 0 and 1)
      if constexpr (Config::kTmaB) {
        return ffi::Error::InvalidArgument("ep_comm dSwiGLU dlhs: config 2 is the forward's");
      } else {
        return launch<E, Config, kDSwiGLU>(stream, p);
      }
    default: return launch<E, Config, kStore>(stream, p);
  }
}

template <class E, class Config>
ffi::Error launch_drhs(cudaStream_t stream, const DrhsParams<E>& p) {
  using T = Traits<E, Config, cutlass::layout::ColumnMajor>;
  static const cudaError_t attr = cudaFuncSetAttribute(
      drhs_kernel<T, E>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (attr != cudaSuccess) {
    return ffi::Error::Internal("ep_comm gathered drhs: shared memory attribute: " +
                                std::string(cudaGetErrorString(attr)));
  }
  const int64_t tiles = ((p.K + T::BM - 1) / T::BM) * ((p.N + T::BN - 1) / T::BN);
  unsigned ctas = 0;  // (persistent, as the forward's kernel)
  if (!persistent_grid(tiles * p.G, p.max_ctas, ctas)) {
    return ffi::Error::Internal(cuda_error("the device's SM count"));
  }
  if (ctas == 0) return ffi::Error::Success();  // no tile or no group
  drhs_kernel<T, E><<<ctas, T::kThreads, T::kSmemBytes, stream>>>(p);
  return cudaPeekAtLastError() == cudaSuccess ? ffi::Error::Success()
                                               : ffi::Error::Internal(cuda_error("drhs launch"));
}

template <class E>
ffi::Error run_drhs(cudaStream_t stream, const DrhsParams<E>& p, int config) {
  return config == 1 ? launch_drhs<E, Single>(stream, p) : launch_drhs<E, Cooperative>(stream, p);
}

template <class E>
ffi::Error run(cudaStream_t stream, const Params<E>& p, int epilogue, int config, bool zero_tail) {
  if (p.M > 0 && p.N > 0) {
    ffi::Error e = config == 1   ? launch_epilogue<E, Single>(stream, p, epilogue)
                   : config == 2 ? launch_epilogue<E, CooperativeTmaB>(stream, p, epilogue)
                                 : launch_epilogue<E, Cooperative>(stream, p, epilogue);
    if (e.failure()) return e;
  }
  if (zero_tail) {
    const int64_t out_cols = epilogue == kSwiGLU ? p.N / 2 : p.N;
    detail::zero_past_groups(stream, p.out, p.sizes, p.G, p.M, out_cols * int64_t(sizeof(E)));
    if (cudaPeekAtLastError() != cudaSuccess) {
      return ffi::Error::Internal(cuda_error("zero-tail launch"));
    }
  }
  return ffi::Error::Success();
}

// What the three handlers check alike: 16-bit types, the tile config, K and N multiples of 8
// (16-byte rows), and a Hopper GPU; `api` names the handler in the message.
bool sixteen_bit(ffi::DataType dt) {
  return dt == ffi::DataType::BF16 || dt == ffi::DataType::F16;
}

ffi::Error invalid(const char* api, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(api) + ": " + what);
}

// configs: the forward's kConfigs, the backward handlers' kBackwardConfigs
std::string config_error(int64_t config, int configs) {
  return config < 0 || config >= configs
             ? "config must be in [0, " + std::to_string(configs) + "), got " +
                   std::to_string(config)
             : std::string();
}

std::string multiples_error(int64_t K, int64_t N) {
  return K % 8 || N % 8 ? "K and N must be multiples of 8, got K=" + std::to_string(K) + ", N=" +
                              std::to_string(N)
                        : std::string();
}

ffi::Error not_hopper(const char* api) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string(api) + ": its kernels are sm_90a (Hopper) only, and this GPU is "
                    "not a Hopper");
}

std::string dims(const ffi::AnyBuffer& b) {
  std::string s = "(";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

ffi::Error Fused(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                 ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> scale,
                 ffi::Result<ffi::AnyBuffer> out, int64_t epilogue, int64_t config,
                 int64_t zero_tail) {
  constexpr const char* api = "ep_comm fused grouped GEMM";
  auto bad = [](const std::string& what) { return invalid(api, what); };
  if (epilogue < 0 || epilogue > kScale) {  // (kDSwiGLU has its own handler)
    return bad("epilogue must be in [0, 3), got " + std::to_string(epilogue));
  }
  if (!config_error(config, kConfigs).empty()) return bad(config_error(config, kConfigs));
  if (epilogue == kSwiGLU && config == 1) {
    return bad("the swiglu epilogue runs with config 0 or 2 (a 256-wide tile holds both "
               "halves)");
  }
  const auto dt = x.element_type();
  if (!sixteen_bit(dt) || w.element_type() != dt || out->element_type() != dt) {
    return bad("x, w and the result must all be bfloat16 or all float16");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const int64_t G = group_sizes.element_count();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[0] != G || wd[1] != xd[1]) {
    return bad("x " + dims(x) + ", w " + dims(w) + ", " + std::to_string(G) +
               " groups and a result of " + dims(*out) + " do not fit (x (X, K), w (G, K, N))");
  }
  const int64_t X = xd[0], K = xd[1], N = wd[2], M = od[0];
  if (od[1] != (epilogue == kSwiGLU ? N / 2 : N)) {
    return bad("the result " + dims(*out) + " must be (M, " +
               (epilogue == kSwiGLU ? "N / 2" : std::string("N")) + ") for w " + dims(w));
  }
  const int64_t n_index = index.element_count();
  if (n_index != M && !(n_index == 0 && X == M)) {
    return bad("index must hold one row per result row (" + std::to_string(M) + "), or none when "
               "x has the result's rows; got " + std::to_string(n_index) + " for x " + dims(x));
  }
  if (epilogue == kScale && scale.element_count() != M) {
    return bad("the scale epilogue takes one float32 per row (" + std::to_string(M) + "), got " +
               std::to_string(scale.element_count()));
  }
  if (K % 8 || N % (epilogue == kSwiGLU ? 16 : 8)) {
    return bad("K must be a multiple of 8 and N of 8 (16 with swiglu), got K=" +
               std::to_string(K) + ", N=" + std::to_string(N));
  }
  if (out->element_count() == 0) return ffi::Error::Success();
  if (K == 0) {  // an empty contraction: zeros (the mainloop needs one K tile at least)
    return cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) == cudaSuccess
               ? ffi::Error::Success()
               : ffi::Error::Internal(cuda_error("memset"));
  }
  if (!detail::hopper()) return not_hopper(api);
  auto make = [&](auto tag) {
    using E = decltype(tag);
    return Params<E>{static_cast<const E*>(x.untyped_data()),
                     n_index ? index.typed_data() : nullptr,
                     static_cast<const E*>(w.untyped_data()),
                     group_sizes.typed_data(),
                     epilogue == kScale ? scale.typed_data() : nullptr,
                     static_cast<E*>(out->untyped_data()),
                     X, M, G, K, N};
  };
  if (dt == ffi::DataType::BF16) {
    return run(stream, make(cutlass::bfloat16_t{}), int(epilogue), int(config), zero_tail != 0);
  }
  return run(stream, make(cutlass::half_t{}), int(epilogue), int(config), zero_tail != 0);
}

ffi::Error DrhsGather(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index,
                      ffi::AnyBuffer dy, ffi::Buffer<ffi::S32> group_sizes,
                      ffi::Result<ffi::AnyBuffer> out, int64_t config) {
  constexpr const char* api = "ep_comm gathered drhs";
  auto bad = [](const std::string& what) { return invalid(api, what); };
  if (!config_error(config, kBackwardConfigs).empty()) {
    return bad(config_error(config, kBackwardConfigs));
  }
  const auto dt = x.element_type();
  if (!sixteen_bit(dt) || dy.element_type() != dt || out->element_type() != dt) {
    return bad("x, dy and the result must all be bfloat16 or all float16");
  }
  const auto xd = x.dimensions(), yd = dy.dimensions(), od = out->dimensions();
  const int64_t G = group_sizes.element_count();
  if (xd.size() != 2 || yd.size() != 2 || od.size() != 3 || od[0] != G || od[1] != xd[1] ||
      od[2] != yd[1]) {
    return bad("x " + dims(x) + ", dy " + dims(dy) + ", " + std::to_string(G) +
               " groups and a result of " + dims(*out) + " do not fit (x (X, K), dy (M, N), "
               "the result (G, K, N))");
  }
  const int64_t X = xd[0], K = xd[1], M = yd[0], N = yd[1];
  const int64_t n_index = index.element_count();
  if (n_index != M && !(n_index == 0 && X == M)) {
    return bad("index must hold one row per row of dy (" + std::to_string(M) + "), or none "
               "when x has dy's rows; got " + std::to_string(n_index) + " for x " + dims(x));
  }
  if (!multiples_error(K, N).empty()) return bad(multiples_error(K, N));
  if (out->element_count() == 0) return ffi::Error::Success();
  if (!detail::hopper()) return not_hopper(api);
  auto make = [&](auto tag) {
    using E = decltype(tag);
    return DrhsParams<E>{static_cast<const E*>(x.untyped_data()),
                         n_index ? index.typed_data() : nullptr,
                         static_cast<const E*>(dy.untyped_data()), group_sizes.typed_data(),
                         static_cast<E*>(out->untyped_data()), X, M, G, K, N};
  };
  if (dt == ffi::DataType::BF16) return run_drhs(stream, make(cutlass::bfloat16_t{}), int(config));
  return run_drhs(stream, make(cutlass::half_t{}), int(config));
}

ffi::Error DSwiGLU(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w,
                   ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer u, ffi::AnyBuffer h,
                   ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> du,
                   ffi::Result<ffi::Buffer<ffi::F32>> part, int64_t config) {
  constexpr const char* api = "ep_comm dSwiGLU dlhs";
  auto bad = [](const std::string& what) { return invalid(api, what); };
  if (!config_error(config, kBackwardConfigs).empty()) {
    return bad(config_error(config, kBackwardConfigs));
  }
  const auto dt = dy.element_type();
  if (!sixteen_bit(dt) || w.element_type() != dt || u.element_type() != dt || h.element_type() != dt || du->element_type() != dt) {
    return bad("dy, w, u, h and du must all be bfloat16 or all float16");
  }
  const auto yd = dy.dimensions(), wd = w.dimensions(), ud = u.dimensions(), hd = h.dimensions(),
             od = du->dimensions(), pd = part->dimensions();
  const int64_t G = group_sizes.element_count();
  const bool shapes = yd.size() == 2 && wd.size() == 3 && wd[0] == G && wd[2] == yd[1] &&
                      ud.size() == 2 && hd.size() == 2 && od.size() == 2 && pd.size() == 2;
  const int64_t M = shapes ? yd[0] : 0, K = shapes ? yd[1] : 0, N = shapes ? wd[1] : 0;
  const int64_t bn = config == 1 ? 128 : 256;
  if (!shapes || ud[0] != M || ud[1] != 2 * N || hd[0] != M || hd[1] != N || od[0] != M ||
      od[1] != 2 * N || pd[0] != M || pd[1] != (N + bn - 1) / bn || scale.element_count() != M) {
    return bad("dy " + dims(dy) + ", w " + dims(w) + ", u " + dims(u) + ", h " + dims(h) +
               " and the results do not fit (dy (M, K), w (G, N, K), u (M, 2N), h (M, N), scale "
               "(M,), du (M, 2N), part (M, N / " + std::to_string(bn) + "))");
  }
  if (!multiples_error(K, N).empty()) return bad(multiples_error(K, N));
  if (du->element_count() == 0) return ffi::Error::Success();
  if (!detail::hopper()) return not_hopper(api);
  if (K == 0) {
    return cudaMemsetAsync(du->untyped_data(), 0, du->size_bytes(), stream) == cudaSuccess &&
                   cudaMemsetAsync(part->untyped_data(), 0, part->size_bytes(), stream) ==
                       cudaSuccess
               ? ffi::Error::Success()
               : ffi::Error::Internal(cuda_error("memset"));
  }
  auto make = [&](auto tag) {
    using E = decltype(tag);
    Params<E> p{static_cast<const E*>(dy.untyped_data()), nullptr,
                static_cast<const E*>(w.untyped_data()), group_sizes.typed_data(),
                scale.typed_data(), static_cast<E*>(du->untyped_data()), M, M, G, K, N};
    p.u = static_cast<const E*>(u.untyped_data());
    p.h = static_cast<const E*>(h.untyped_data());
    p.part = part->typed_data();
    return p;
  };
  if (dt == ffi::DataType::BF16) {
    return run(stream, make(cutlass::bfloat16_t{}), kDSwiGLU, int(config), false);
  }
  return run(stream, make(cutlass::half_t{}), kDSwiGLU, int(config), false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_grouped_gemm_dswiglu, DSwiGLU,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // dy (M, K): weighted rows' cotangent
        .Arg<ffi::AnyBuffer>()         // w (G, N, K): w_out
        .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes (G,)
        .Arg<ffi::AnyBuffer>()         // u (M, 2N)
        .Arg<ffi::AnyBuffer>()         // h (M, N)
        .Arg<ffi::Buffer<ffi::F32>>()  // scale (M,): router weights
        .Ret<ffi::AnyBuffer>()         // du (M, 2N)
        .Ret<ffi::Buffer<ffi::F32>>()  // part (M, column tiles)
        .Attr<int64_t>("config"));


XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_grouped_gemm_drhs_gather, DrhsGather,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // x (X, K)
        .Arg<ffi::Buffer<ffi::S32>>()  // index (M,) or (0,)
        .Arg<ffi::AnyBuffer>()         // dy (M, N)
        .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes (G,)
        .Ret<ffi::AnyBuffer>()         // out (G, K, N)
        .Attr<int64_t>("config"));     // tile config


XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_grouped_gemm_fused, Fused,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // x (X, K)
        .Arg<ffi::Buffer<ffi::S32>>()  // index (M,) or (0,)
        .Arg<ffi::AnyBuffer>()         // w (G, K, N)
        .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes (G,)
        .Arg<ffi::Buffer<ffi::F32>>()  // scale (M,) or (0,)
        .Ret<ffi::AnyBuffer>()         // out (M, N) or (M, N / 2)
        .Attr<int64_t>("epilogue")     // 0 store, 1 swiglu, 2 scale
        .Attr<int64_t>("config")       // tile config
        .Attr<int64_t>("zero_tail"));  // zero the rows past the groups


#ifdef EP_COMM_SELFTESTS
// ---- selftest (compute-sanitizer) ---------------------------------------------------------------

namespace {

float bf16_value(cutlass::bfloat16_t v) { return float(v); }

}  // namespace

// The selftest's grids: one CTA, which walks all of its few tiles, empty groups' among them,
// through one pipeline (the tests at full size run one CTA per SM)
constexpr int kSelftestCtas = 1;

long long fused_selftest() {
  if (!detail::hopper()) return -2;
  using E = cutlass::bfloat16_t;
  // X=24 token rows, M=40 pair rows in G=4 groups (an empty one, a negative size, a total past
  // M: clamped), K=72 (a K tail), N=48 (a column tail in every tile); indices include -1 and
  // X + 3 (zero rows). Small integers: products exact in float32, sums exact in bfloat16.
  const int64_t X = 24, M = 40, G = 4, K = 72, N = 48;
  const int32_t sizes[4] = {7, -3, 50, 9};
  std::vector<E> x(X * K), w(G * K * N);
  std::vector<int32_t> index(M);
  std::vector<float> scale(M);
  for (size_t i = 0; i < x.size(); ++i) x[i] = E(float(int(i % 5) - 2));
  for (size_t i = 0; i < w.size(); ++i) w[i] = E(float(int(i % 3) - 1));
  for (int64_t r = 0; r < M; ++r) {
    index[r] = r == 3 ? -1 : r == 11 ? int32_t(X + 3) : int32_t((r * 7) % X);
    scale[r] = r % 2 ? 0.5f : 0.25f;
  }
  cudaStream_t s;
  if (cudaStreamCreate(&s) != cudaSuccess) return -1;
  std::vector<void*> held;
  auto up = [&](const void* h, size_t bytes) -> void* {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    held.push_back(p);
    if (h) cudaMemcpyAsync(p, h, bytes, cudaMemcpyHostToDevice, s);
    return p;
  };
  auto* dx = static_cast<E*>(up(x.data(), x.size() * sizeof(E)));
  auto* dw = static_cast<E*>(up(w.data(), w.size() * sizeof(E)));
  auto* di = static_cast<int32_t*>(up(index.data(), index.size() * 4));
  auto* dg = static_cast<int32_t*>(up(sizes, sizeof(sizes)));
  auto* dsc = static_cast<float*>(up(scale.data(), scale.size() * 4));
  auto* dout = static_cast<E*>(up(nullptr, M * N * sizeof(E)));
  long long wrong = 0;
  int64_t clamped[4], off = 0;
  for (int i = 0; i < G; ++i) {
    clamped[i] = detail::clamp_size(sizes[i], M, off);
    off += clamped[i];
  }
  const int64_t total = off;
  for (int config = 0; config < kConfigs && dx && dw && di && dg && dsc && dout; ++config) {
    for (int epi = 0; epi < kEpilogues; ++epi) {
      if ((epi == kSwiGLU && config == 1) || epi == kDSwiGLU) continue;  // (below)
      const int64_t cols = epi == kSwiGLU ? N / 2 : N;
      cudaMemsetAsync(dout, 0xFF, M * N * sizeof(E), s);  // NaN: every row must be written
      Params<E> p{dx, di, dw, dg, epi == kScale ? dsc : nullptr, dout, X, M, G, K, N};
      p.max_ctas = kSelftestCtas;
      if (run(s, p, epi, config, true).failure()) return -1;
      std::vector<E> got(M * cols);
      cudaMemcpyAsync(got.data(), dout, got.size() * sizeof(E), cudaMemcpyDeviceToHost, s);
      if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
      off = 0;
      for (int g = 0; g < G; ++g) {
        for (int64_t r = off; r < off + clamped[g]; ++r) {
          const int64_t xr = index[r];
          std::vector<float> acc(N, 0.f);
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t k = 0; k < K && xr >= 0 && xr < X; ++k) {
              acc[n] += bf16_value(x[xr * K + k]) * bf16_value(w[(g * K + k) * N + n]);
            }
          }
          for (int64_t c = 0; c < cols; ++c) {
            const float v = bf16_value(got[r * cols + c]);
            if (epi == kSwiGLU) {
              const float gate = acc[c], upv = acc[N / 2 + c];
              const float want = gate / (1.0f + std::exp(-gate)) * upv;
              wrong += !(std::fabs(v - want) <= 1e-2f * std::fabs(want) + 1e-3f);
            } else {
              const float want = acc[c] * (epi == kScale ? scale[r] : 1.0f);
              wrong += v != bf16_value(E(want));
            }
          }
        }
        off += clamped[g];
      }
      for (int64_t r = total; r < M; ++r) {
        for (int64_t c = 0; c < cols; ++c) wrong += bf16_value(got[r * cols + c]) != 0.f;
      }
    }
  }
  // the dSwiGLU dlhs: dy (M, K=72) against w_out (G, N=48, K) read K-major, u (M, 96), h (M, 48)
  {
    std::vector<E> dyk(M * K), wk(G * N * K), uk(M * 2 * N), hk(M * N);
    for (size_t i = 0; i < dyk.size(); ++i) dyk[i] = E(float(int(i % 5) - 2));
    for (size_t i = 0; i < wk.size(); ++i) wk[i] = E(float(int(i % 3) - 1));
    for (size_t i = 0; i < uk.size(); ++i) uk[i] = E(0.25f * float(int(i % 9) - 4));
    for (size_t i = 0; i < hk.size(); ++i) hk[i] = E(0.5f * float(int(i % 4) - 2));
    auto* d_dy = static_cast<E*>(up(dyk.data(), dyk.size() * sizeof(E)));
    auto* d_w = static_cast<E*>(up(wk.data(), wk.size() * sizeof(E)));
    auto* d_u = static_cast<E*>(up(uk.data(), uk.size() * sizeof(E)));
    auto* d_h = static_cast<E*>(up(hk.data(), hk.size() * sizeof(E)));
    auto* d_du = static_cast<E*>(up(nullptr, M * 2 * N * sizeof(E)));
    auto* d_part = static_cast<float*>(up(nullptr, M * sizeof(float)));  // one column tile
    for (int config = 0;
         config < kBackwardConfigs && d_dy && d_w && d_u && d_h && d_du && d_part;
         ++config) {
      cudaMemsetAsync(d_du, 0, M * 2 * N * sizeof(E), s);
      cudaMemsetAsync(d_part, 0, M * sizeof(float), s);
      Params<E> p{d_dy, nullptr, d_w, dg, dsc, d_du, M, M, G, K, N};
      p.u = d_u;
      p.h = d_h;
      p.part = d_part;
      p.max_ctas = kSelftestCtas;
      if (run(s, p, kDSwiGLU, config, false).failure()) return -1;
      std::vector<E> got(M * 2 * N);
      std::vector<float> got_part(M);
      cudaMemcpyAsync(got.data(), d_du, got.size() * sizeof(E), cudaMemcpyDeviceToHost, s);
      cudaMemcpyAsync(got_part.data(), d_part, M * sizeof(float), cudaMemcpyDeviceToHost, s);
      if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
      off = 0;
      for (int g = 0; g < G; ++g) {
        for (int64_t r = off; r < off + clamped[g]; ++r) {
          float want_part = 0.f;
          for (int64_t n = 0; n < N; ++n) {
            float dhw = 0.f;
            for (int64_t k = 0; k < K; ++k) {
              dhw += bf16_value(dyk[r * K + k]) * bf16_value(wk[(g * N + n) * K + k]);
            }
            want_part += dhw * bf16_value(hk[r * N + n]);
            const float dh = dhw * scale[r], gate = bf16_value(uk[r * 2 * N + n]),
                        upv = bf16_value(uk[r * 2 * N + N + n]);
            const float sig = 1.0f / (1.0f + std::exp(-gate));
            const float want[2] = {dh * upv * sig * (1.0f + gate * (1.0f - sig)), dh * gate * sig};
            for (int e = 0; e < 2; ++e) {
              const float v = bf16_value(got[r * 2 * N + e * N + n]);
              wrong += !(std::fabs(v - want[e]) <= 1e-2f * std::fabs(want[e]) + 1e-2f);
            }
          }
          wrong += !(std::fabs(got_part[r] - want_part) <= 1e-3f * std::fabs(want_part) + 1e-3f);
        }
        off += clamped[g];
      }
    }
  }
  // the gathered weight gradient: dy (M, N) against x's gathered rows, both configs
  std::vector<E> dyh(M * N);
  for (size_t i = 0; i < dyh.size(); ++i) dyh[i] = E(float(int(i % 7) - 3));
  auto* ddy = static_cast<E*>(up(dyh.data(), dyh.size() * sizeof(E)));
  auto* dgw = static_cast<E*>(up(nullptr, G * K * N * sizeof(E)));
  for (int config = 0; config < kBackwardConfigs && ddy && dgw && dx && di && dg; ++config) {
    cudaMemsetAsync(dgw, 0xFF, G * K * N * sizeof(E), s);  // NaN: every element must be written
    DrhsParams<E> p{dx, di, ddy, dg, dgw, X, M, G, K, N};
    p.max_ctas = kSelftestCtas;
    if (run_drhs(s, p, config).failure()) return -1;
    std::vector<E> got(G * K * N);
    cudaMemcpyAsync(got.data(), dgw, got.size() * sizeof(E), cudaMemcpyDeviceToHost, s);
    if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
    off = 0;
    for (int g = 0; g < G; ++g) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.f;
          for (int64_t r = off; r < off + clamped[g]; ++r) {
            const int64_t xr = index[r];
            if (xr >= 0 && xr < X) acc += bf16_value(x[xr * K + k]) * bf16_value(dyh[r * N + n]);
          }
          wrong += bf16_value(got[(g * K + k) * N + n]) != bf16_value(E(acc));
        }
      }
      off += clamped[g];
    }
  }
  for (void* p : held) cudaFree(p);
  cudaStreamDestroy(s);
  return wrong;
}

#endif  // EP_COMM_SELFTESTS

}  // namespace ep_comm::gemm
