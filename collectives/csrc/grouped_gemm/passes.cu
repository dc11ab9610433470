// ep_comm's grouped GEMM for the experts on Hopper (sm_90a), built on CUTLASS 3.x.
//
// Route: the C++ headers of the `nvidia-cutlass` wheel (collective builders, the pointer-array
// grouped kernels with warp-specialized TMA loads and GMMA, cooperative and ping-pong: the tile
// configs in impl.cuh, one picked per call), not CUTLASS's Python DSL: the same XLA FFI + nanobind build as the engine's other kernels, no
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
#include "impl.cuh"

#include "grouped_gemm.h"

namespace ep_comm::gemm {
namespace {

using namespace detail;

template <class E>
ffi::Error run_typed(cudaStream_t stream, Memory& mem, int pass, int config, const void* a,
                     const void* b, const int32_t* gs, void* d, int64_t G, int64_t M,
                     int64_t k_dim, int64_t n_dim, bool zero_tail) {
  auto ea = static_cast<const E*>(a);
  auto eb = static_cast<const E*>(b);
  auto ed = static_cast<E*>(d);
  switch (pass) {
    case kForward:
      return run_pass_cfg<E, kForward>(config, stream, mem, ea, eb, gs, ed, G, M, k_dim, n_dim,
                                       zero_tail);
    case kDlhs:
      return run_pass_cfg<E, kDlhs>(config, stream, mem, ea, eb, gs, ed, G, M, k_dim, n_dim,
                                    zero_tail);
    default:
      return run_pass_cfg<E, kDrhs>(config, stream, mem, ea, eb, gs, ed, G, M, k_dim, n_dim,
                                    zero_tail);
  }
}

}  // namespace

size_t workspace_bytes(int64_t pass, int64_t config, int64_t groups) {
  using BF = cutlass::bfloat16_t;
  using F16 = cutlass::half_t;
  const int c = static_cast<int>(config);
  switch (pass) {  // either dtype's kernels (the same sizes in practice)
    case kForward:
      return std::max(workspace_cfg<BF, kForward>(c, groups), workspace_cfg<F16, kForward>(c, groups));
    case kDlhs:
      return std::max(workspace_cfg<BF, kDlhs>(c, groups), workspace_cfg<F16, kDlhs>(c, groups));
    default:
      return std::max(workspace_cfg<BF, kDrhs>(c, groups), workspace_cfg<F16, kDrhs>(c, groups));
  }
}

namespace {

std::string dims_str(const ffi::AnyBuffer& b) {
  std::string s = "(";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error GroupedGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t pass, int64_t zero_tail,
                       int64_t config) {
  if (!hopper()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "ep_comm grouped GEMM: its kernels are sm_90a (Hopper) only, and this GPU "
                      "is not a Hopper");
  }
  if (config < 0 || config >= kConfigs) {
    return ffi::Error::InvalidArgument("ep_comm grouped GEMM: config must be in [0, " +
                                       std::to_string(kConfigs) + "), got " +
                                       std::to_string(config));
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
  if (G > 65535) {  // the empty-group zeroing's grid.y
    return ffi::Error::InvalidArgument("ep_comm grouped GEMM: at most 65535 groups, got " +
                                       std::to_string(G));
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
  if ((pass == kForward && k_dim == 0) || (pass == kDlhs && n_dim == 0)) {
    // an empty contraction: zeros (CUTLASS's mainloop needs one K tile at least)
    return cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) == cudaSuccess
               ? ffi::Error::Success()
               : ffi::Error::Internal("ep_comm grouped GEMM: memset: " +
                                      cuda_str(cudaGetLastError()));
  }
  if (!aligned16(workspace->untyped_data())) {
    return ffi::Error::InvalidArgument("ep_comm grouped GEMM: the workspace must be 16-byte aligned");
  }
  BufferMemory mem(workspace->untyped_data(), workspace->size_bytes());
  if (dt == ffi::DataType::BF16) {
    return run_typed<cutlass::bfloat16_t>(stream, mem, static_cast<int>(pass),
                                          static_cast<int>(config), a.untyped_data(),
                                          b.untyped_data(), group_sizes.typed_data(),
                                          out->untyped_data(), G, M, k_dim, n_dim, zero_tail != 0);
  }
  return run_typed<cutlass::half_t>(stream, mem, static_cast<int>(pass),
                                    static_cast<int>(config), a.untyped_data(),
                                    b.untyped_data(), group_sizes.typed_data(),
                                    out->untyped_data(), G, M, k_dim, n_dim, zero_tail != 0);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_grouped_gemm, GroupedGemm,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // a
        .Arg<ffi::AnyBuffer>()         // b
        .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes (G,)
        .Ret<ffi::AnyBuffer>()         // out
        .Ret<ffi::AnyBuffer>()         // workspace (u8, workspace_bytes)
        .Attr<int64_t>("pass")         // 0 forward, 1 dlhs, 2 drhs
        .Attr<int64_t>("zero_tail")   // forward/dlhs: zero past groups
        .Attr<int64_t>("config"));    // tile config (impl header)


#ifdef EP_COMM_SELFTESTS
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
  for (int config = 0; config < kConfigs; ++config)
  for (const auto& sizes_in : cases) {
    int32_t clamped[4];
    int64_t off = 0;
    for (int i = 0; i < G; ++i) {
      const int64_t v = detail::clamp_size(sizes_in[i], M, off);
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
    bool ok = run_typed<cutlass::bfloat16_t>(s, mem, kForward, config, dx, dw, gs, out_f, G, M, K, N, true)
                  .success() &&
              run_typed<cutlass::bfloat16_t>(s, mem, kDlhs, config, ddy, dw, gs, out_l, G, M, K, N, true)
                  .success() &&
              run_typed<cutlass::bfloat16_t>(s, mem, kDrhs, config, dx, ddy, gs, out_r, G, M, K, N, false)
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

#endif  // EP_COMM_SELFTESTS

}  // namespace ep_comm::gemm

#ifdef EP_COMM_GEMM_LAYOUT_TEST
// The layout test, on the host (no GPU): fill_groups' problems, pointers and strides, read back
// through CuTe tensors the way CUTLASS's collectives read them (A as (M, K), B as (N, K), D as
// (M, N), each with its stride), must give each pass's product as the module docstring defines
// it, for well-formed and malformed group sizes. Built by CMake's gemm_layout_test target.
#include <cstdio>

namespace ep_comm::gemm {
namespace {

using namespace detail;

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
  using namespace ep_comm::gemm::detail;
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
  // the fused kernels' CTA order (detail::strip_tile): each (row tile, column tile) once
  for (int64_t tm : {1, 7, 8, 9, 17, 288}) {
    for (int64_t tn : {1, 3, 16}) {
      std::vector<int> seen(tm * tn, 0);
      for (int64_t cta = 0; cta < tm * tn; ++cta) {
        int64_t m = -1, n = -1;
        strip_tile(cta, tm, tn, m, n);
        if (m < 0 || m >= tm || n < 0 || n >= tn) ++wrong; else ++seen[m * tn + n];
      }
      for (int v : seen) wrong += v != 1;
    }
  }
  std::printf("grouped GEMM layout test: %lld wrong values\n", wrong);
  return wrong == 0 ? 0 : 1;
}
#endif  // EP_COMM_GEMM_LAYOUT_TEST
