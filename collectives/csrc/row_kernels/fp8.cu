// The FP8 codecs' kernels and XLA FFI handlers (handlers.def): ep_comm_rows_scatter_dequant,
// _scatter_fake_quant and _scatter_quant (Python: collectives/row_kernels/fp8.py).
#include "common.cuh"
#include "row_kernels.h"

namespace ep_comm::rows {
namespace {

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

}  // namespace

namespace {

// scatter_dequant's and scatter_fake_quant's binding: one out (M, H) in its dtype; block: values
// per scale; mx: 1 for E8M0 scales, 0 for float32
auto dequantized_scatter_binding() {
  return scatter_operands().Ret<ffi::AnyBuffer>().Attr<int64_t>("block").Attr<int64_t>("mx");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ep_comm_rows_scatter_dequant, ScatterDequant,
                              dequantized_scatter_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ep_comm_rows_scatter_fake_quant, ScatterFakeQuant,
                              dequantized_scatter_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_scatter_quant, ScatterQuant,
    scatter_operands()
        .Ret<ffi::Buffer<ffi::U8>>()  // values (M, H)
        .Ret<ffi::Buffer<ffi::U8>>()  // scales (M, scale bytes)
        .Attr<int64_t>("block")
        .Attr<int64_t>("mx"));

}  // namespace ep_comm::rows
