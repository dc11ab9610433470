// The row kernels on malformed indices outside XLA (for compute-sanitizer): built into _ep_rows
// only when a test build asks (CMake: -DEP_COMM_SELFTESTS=ON).
#include "layouts.cuh"
#include "moves.cuh"
#include "row_kernels.h"

namespace ep_comm::rows {

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

}  // namespace ep_comm::rows
