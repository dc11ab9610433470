// The layouts' XLA FFI handlers (handlers.def): ep_comm_rows_key_count, _key_rank,
// _expert_layout, _token_routes and _local_layout (Python: collectives/row_kernels/layouts.py).
#include "layouts.cuh"
#include "row_kernels.h"

namespace ep_comm::rows {
namespace {

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

}  // namespace

namespace {

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_key_count, KeyCount,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::Buffer<ffi::S32>>()   // key (M,)
        .Ret<ffi::Buffer<ffi::S32>>());  // counts (chunks, num_keys)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_key_rank, KeyRank,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::Buffer<ffi::S32>>()   // key (M,)
        .Arg<ffi::Buffer<ffi::S32>>()   // base (chunks, num_keys)
        .Ret<ffi::Buffer<ffi::S32>>());  // (rank, order) (2, M)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_expert_layout, ExpertLayout,
    with_layout_rets(ffi::Ffi::Bind()
                         .Ctx<ffi::PlatformStream<cudaStream_t>>()
                         .Arg<ffi::Buffer<ffi::F32>>()    // route
                         .Arg<ffi::Buffer<ffi::S32>>()    // num_recv
                         .Arg<ffi::Buffer<ffi::S32>>())   // me
        .Ret<ffi::Buffer<ffi::S32>>()   // scratch
        .Attr<int64_t>("zero_fill"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_token_routes, TokenRoutes,
    routes_binding().Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_rows_local_layout, LocalLayout,
    with_layout_rets(routes_binding()).Attr<int64_t>("zero_fill"));

}  // namespace ep_comm::rows
