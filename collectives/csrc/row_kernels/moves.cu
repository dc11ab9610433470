// The moves' XLA FFI handlers (handlers.def): ep_comm_rows_gather, _scatter, _gather_sum and
// _empty (Python: collectives/row_kernels/moves.py; empty: primitive.py).
#include "moves.cuh"
#include "row_kernels.h"

namespace ep_comm::rows {
namespace {

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

// ---- empty --------------------------------------------------------------------------------------

// A buffer for an exchange to write into, not initialised: the rows no segment covers are
// unspecified, and nothing reads them (no memset of a worst-case receive buffer).
ffi::Error Empty(ffi::Result<ffi::AnyBuffer> /*out*/, int64_t /*id: keeps calls distinct*/) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_gather, Gather,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // table (N, ...)
        .Arg<ffi::Buffer<ffi::S32>>()  // idx (M,)
        .Ret<ffi::AnyBuffer>());       // out (M, ...)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_scatter, Scatter,
    scatter_operands()
        .Ret<ffi::AnyBuffer>()      // out (M, ...)
        .Attr<int64_t>("offset"));  // first byte read of a row

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_gather_sum, GatherSum,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // table (N, H)
        .Arg<ffi::Buffer<ffi::S32>>()  // idx (M, K)
        .Arg<ffi::Buffer<ffi::F32>>()  // weights (M, K)
        .Ret<ffi::AnyBuffer>());       // out (M, H)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_empty, Empty,
    ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<int64_t>("id"));

}  // namespace ep_comm::rows
