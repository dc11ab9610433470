// NCCL transport (GPU): the ragged exchange as a pair of XLA FFI handlers, start and done.
//
// start (on XLA's stream S, issuing on the communicator's own stream C):
//   C waits for S; a kernel packs one metadata message per peer (exchange_plan.h) from the device
//   index arrays; the self segment is copied by a kernel that reads its offsets on the device (no
//   host round trip; a single-rank exchange never touches the host or NCCL); with peers, the
//   messages are exchanged with grouped ncclSend/ncclRecv and a kernel publishes them to pinned,
//   mapped host memory and raises a sequence flag that the handler polls (with a deadline); the host
//   then decides every transfer and issues one grouped ncclSend/ncclRecv of exactly the bytes
//   needed; C records the op's done event.
// done: S waits for that event. Everything between start and done on S overlaps the exchange.
//
// Communicators live in a process-wide registry keyed by (communicator key, device ordinal); the
// registry owns them (RAII: CommState's destructor), created by init() and destroyed by finalize().
#include <cuda_runtime.h>
#include <nccl.h>
#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtCudaRt.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "call_shape.h"
#include "exchange_plan.h"
#include "nccl_engine.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ep_comm::nccl {
namespace {

std::string cuda_str(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }
std::string nccl_str(ncclResult_t r) {
  std::string s = ncclGetErrorString(r);
  return s;
}

// A payload phase in flight, watched until its done event completes or its deadline passes.
struct Pending {
  int64_t op_id;
  cudaEvent_t done;
  std::chrono::steady_clock::time_point deadline;
  std::string what;  // the call site and the peers it waits for
};

struct CommState {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0, sm_count = 1;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev_in = nullptr;
  std::map<int64_t, cudaEvent_t> done;       // per op_id: recorded by start, waited for by done
  std::map<int64_t, nvtxRangeId_t> ranges;   // per op_id: NVTX range from start to done
  int64_t* host = nullptr;                   // pinned, mapped: published metadata
  size_t host_len = 0;                       // int64 elements
  int64_t* flag = nullptr;                   // pinned, mapped: [sequence, self-copy error, aborted]
  int64_t seq = 0;
  std::string broken;                        // non-empty once the communicator was aborted
  // Read from the environment once, when the communicator is created (never per call):
  double timeout_s = 300.0;                  // EP_COMM_TIMEOUT_S
  bool self_via_nccl = false;                // EP_COMM_NCCL_SELF=1
  int self_copy_blocks = 0;                   // EP_COMM_SELF_COPY_BLOCKS (0: as many as useful)
  Fault fault = Fault::kNone;                // EP_COMM_FAULT (tests only)
  std::mutex mu;
  // The payload watchdog: a thread (started by the first exchange with peers) that aborts the
  // communicator when a payload phase outlives EP_COMM_TIMEOUT_S, so that a peer dying after the
  // metadata cannot leave NCCL's kernels (and XLA's stream behind them) waiting forever.
  std::vector<Pending> pending;              // guarded by mu
  std::thread watchdog;
  std::condition_variable wake;
  bool stop = false;

  ~CommState() {
    cudaSetDevice(device);
    if (stream) cudaStreamSynchronize(stream);  // the watchdog still runs: a dead peer cannot hang this
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    wake.notify_all();
    if (watchdog.joinable()) watchdog.join();
    if (comm) {
      if (broken.empty()) ncclCommDestroy(comm); else ncclCommAbort(comm);
    }
    for (auto& [id, ev] : done) cudaEventDestroy(ev);
    if (ev_in) cudaEventDestroy(ev_in);
    if (stream) cudaStreamDestroy(stream);
    if (host) cudaFreeHost(host);
    if (flag) cudaFreeHost(flag);
  }
};

// Leaked on purpose: no static destructor may run after the CUDA runtime is torn down at exit;
// finalize() (called by Python's atexit) destroys the communicators in order.
std::mutex& registry_mu() { static auto* m = new std::mutex; return *m; }
std::map<std::pair<int64_t, int>, std::unique_ptr<CommState>>& registry() {
  static auto* r = new std::map<std::pair<int64_t, int>, std::unique_ptr<CommState>>;
  return *r;
}

CommState* lookup(int64_t key, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mu());
  auto it = registry().find({key, ordinal});
  return it == registry().end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------------------------
// Kernels.

__global__ void pack_kernel(const int32_t* io, const int32_t* ss, const int32_t* oo, const int32_t* rs,
                            int n, int m, int64_t K, int64_t row_bytes, int64_t tag, int64_t n_in,
                            int64_t n_out, int64_t* msgs) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < n) {
    pack_message(msgs + static_cast<int64_t>(p) * message_len(m), p, m, K, row_bytes, tag, n_in,
                 n_out, io, ss, oo, rs);
  }
}

// What a kernel needs to build this rank's metadata for itself.
struct SelfArgs {
  const int32_t *io, *ss, *oo, *rs;  // the index arrays (device)
  int me, m;
  int64_t K, row_bytes, tag, n_in, n_out;
};

// Copy this rank's segments to itself, reading sizes and offsets straight from the index arrays on
// the device (no metadata kernel or host round trip first). blockIdx.y = slot.
template <typename V>
__global__ void self_copy_kernel(const char* in, char* out, SelfArgs a, int64_t* error_flag) {
  const int s = blockIdx.y;
  const int64_t row_bytes = a.row_bytes;
  int64_t self_msg[kHeader + kSlot];  // the message to itself, slot s only (as slot 0)
  const int64_t seg = static_cast<int64_t>(a.me) * a.m + s;
  pack_message(self_msg, 0, 1, a.K, a.row_bytes, a.tag, a.n_in, a.n_out, a.io + seg, a.ss + seg,
               a.oo + seg, a.rs + seg);
  if (transfer_verdict(self_msg, self_msg, 0) != kOk) {
    if (blockIdx.x == 0 && threadIdx.x == 0) error_flag[1] = 1;  // reported by the host
    return;
  }
  const int64_t rows = slot(self_msg, 0, kSSendSize);
  const V* src = reinterpret_cast<const V*>(in + slot(self_msg, 0, kSInputOffset) * row_bytes);
  V* dst = reinterpret_cast<V*>(out + slot(self_msg, 0, kSOutputOffset) * row_bytes);
  const int64_t count = rows * row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {  // four loads in flight per thread
    V a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < count; i += stride) dst[i] = src[i];
}

// After done's wait: when the watchdog aborted the communicator (flag[2], mapped host memory), fill
// the result with all-ones bytes (NaN for floating types) rather than leave rows that never came.
__global__ void poison_if_aborted(char* out, int64_t bytes, const volatile int64_t* flag) {
  __shared__ int64_t aborted;
  if (threadIdx.x == 0) aborted = flag[2];
  __syncthreads();
  if (aborted == 0) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    out[i] = static_cast<char>(0xff);
  }
}

// Copy the metadata (mine, then theirs) to mapped host memory, then raise the sequence flag.
__global__ void publish_kernel(const int64_t* mine, const int64_t* theirs, int64_t len,
                               volatile int64_t* host, volatile int64_t* flag, int64_t seq) {
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    host[i] = mine[i];
    host[len + i] = theirs[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) flag[0] = seq;
}

// ---------------------------------------------------------------------------------------------

void launch_self_copy(const CommState& st, const char* in, char* out, const SelfArgs& a) {
  const int threads = 512, m = a.m;
  const int64_t row_bytes = a.row_bytes, max_rows = std::min(a.n_in, a.n_out);
  auto blocks_for = [&](int64_t width) {
    const int64_t elems = max_rows * row_bytes / width;
    int64_t b = (elems + threads - 1) / threads;
    b = std::min<int64_t>(b, 4LL * st.sm_count);
    if (st.self_copy_blocks > 0) b = std::min<int64_t>(b, st.self_copy_blocks);
    return static_cast<unsigned>(std::max<int64_t>(1, b));
  };
  const auto aligned = [&](int64_t w) {
    return row_bytes % w == 0 && reinterpret_cast<uintptr_t>(in) % w == 0 &&
           reinterpret_cast<uintptr_t>(out) % w == 0;
  };
  if (aligned(16)) {
    self_copy_kernel<uint4><<<dim3(blocks_for(16), m), threads, 0, st.stream>>>(
        in, out, a, st.flag);
  } else if (aligned(4)) {
    self_copy_kernel<uint32_t><<<dim3(blocks_for(4), m), threads, 0, st.stream>>>(
        in, out, a, st.flag);
  } else {
    self_copy_kernel<uint8_t><<<dim3(blocks_for(1), m), threads, 0, st.stream>>>(
        in, out, a, st.flag);
  }
}

ffi::Error ensure_host(CommState& st, size_t len) {
  if (st.host_len >= len) return ffi::Error::Success();
  if (st.host) cudaFreeHost(st.host);
  st.host = nullptr;
  st.host_len = 0;
  cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&st.host), len * sizeof(int64_t),
                                cudaHostAllocMapped);
  if (e != cudaSuccess) return ffi::Error::Internal("cudaHostAlloc of the metadata buffer: " + cuda_str(e));
  st.host_len = len;
  return ffi::Error::Success();
}

// Abort the communicator (unblocks kernels waiting for a peer) and remember why.
void poison(CommState& st, const std::string& why) {
  st.broken = why;
  if (st.comm) ncclCommAbort(st.comm);
  st.comm = nullptr;
}

// The watchdog's loop (one thread per communicator with peers): every 10 ms, under the state's
// lock, retire the payload phases whose done event completed; when one is past its deadline, the
// stream failed, or NCCL reports an asynchronous error, raise the mapped `aborted` flag (done's
// check kernel then fills the results with NaN bits: no silently wrong rows), abort the
// communicator (NCCL's kernels return, XLA's stream moves on), print the diagnostic and keep it
// for the next call, which fails with it.
void watch(CommState* st) {
  cudaSetDevice(st->device);
  std::unique_lock<std::mutex> lock(st->mu);
  while (!st->stop) {
    st->wake.wait_for(lock, std::chrono::milliseconds(10));
    std::string why;
    for (auto it = st->pending.begin(); it != st->pending.end() && why.empty();) {
      const cudaError_t q = cudaEventQuery(it->done);
      if (q == cudaSuccess) {
        it = st->pending.erase(it);
        continue;
      }
      ncclResult_t async = ncclSuccess;
      if (st->comm) ncclCommGetAsyncError(st->comm, &async);
      if (q != cudaErrorNotReady) {
        why = it->what + ": the communication stream failed: " + cuda_str(q);
      } else if (async != ncclSuccess && async != ncclInProgress) {
        why = it->what + ": NCCL reported an asynchronous error: " + nccl_str(async);
      } else if (std::chrono::steady_clock::now() > it->deadline) {
        why = it->what + " did not complete within " + std::to_string(st->timeout_s) +
              " s: a peer stopped after the metadata exchange (a crashed or stalled process). The "
              "communicator was aborted and this call's results are NaN; restart the processes. "
              "Set EP_COMM_TIMEOUT_S to change the limit";
      } else {
        ++it;
      }
    }
    if (!why.empty()) {
      st->flag[2] = 1;
      std::fprintf(stderr, "ep_comm watchdog: %s\n", why.c_str());
      std::fflush(stderr);
      poison(*st, why);
      st->pending.clear();
    }
  }
}

// Watch the payload phase just issued (op `op_id`, completing with `done`).
void watch_payload(CommState& st, int64_t op_id, cudaEvent_t done, const std::string& what) {
  st.pending.push_back({op_id, done,
                        std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(st.timeout_s)),
                        what});
  if (!st.watchdog.joinable()) st.watchdog = std::thread(watch, &st);
}

// Wait until the metadata of sequence `seq` is on the host, the communicator fails, or the deadline.
std::string wait_for_metadata(CommState& st, int64_t seq) {
  const double timeout_s = st.timeout_s;
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
  volatile int64_t* flag = st.flag;
  int spins = 0;
  while (*flag != seq) {
    if (++spins % 1024 == 0) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(st.comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        std::string why = "NCCL reported an asynchronous error: " + nccl_str(async);
        poison(st, why);
        return why;
      }
      cudaError_t e = cudaStreamQuery(st.stream);
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        std::string why = "the communication stream failed: " + cuda_str(e);
        poison(st, why);
        return why;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::string why = "the metadata exchange did not complete within " +
                          std::to_string(timeout_s) +
                          " s: a peer never reached this exchange (a crashed process, or ranks "
                          "running different programs), or the work before it on this GPU never "
                          "finished. The communicator was aborted; restart the processes. Set "
                          "EP_COMM_TIMEOUT_S to change the limit";
        poison(st, why);
        return why;
      }
      if (spins > 1024 * 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return "";
}

#define EP_CUDA(expr, what)                                                             \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) return ffi::Error::Internal(where + ": " + (what) + ": " + cuda_str(e_)); \
  } while (0)

#define EP_NCCL(expr, what)                                                               \
  do {                                                                                    \
    ncclResult_t r_ = (expr);                                                             \
    if (r_ != ncclSuccess) {                                                              \
      std::string why_ = std::string(what) + " failed: " + nccl_str(r_) + " (" +          \
                         ncclGetLastError(st.comm) + ")";                                 \
      poison(st, why_);                                                                   \
      return ffi::Error::Internal(where + ": " + why_);                                   \
    }                                                                                     \
  } while (0)

// Metadata: pack one message per peer on the device, exchange them with the peers, publish them to
// the host and wait for them there; then decide every transfer (both ends of a pair decide alike).
// The self segment's transfers stay out of `plan` unless `self_via_nccl` (the self-copy kernel moves
// them); every ill-formed transfer is in plan->errors.
ffi::Error plan_exchange(CommState& st, const std::string& where, const SelfArgs& a,
                         bool self_via_nccl, int64_t* mine, int64_t* theirs, Plan* plan) {
  const int n = st.size, me = st.rank, L = message_len(a.m);
  pack_kernel<<<(n + 127) / 128, 128, 0, st.stream>>>(a.io, a.ss, a.oo, a.rs, n, a.m, a.K,
                                                      a.row_bytes, a.tag, a.n_in, a.n_out, mine);
  EP_CUDA(cudaGetLastError(), "launching the metadata kernel");
  if (n > 1) EP_NCCL(ncclGroupStart(), "ncclGroupStart");
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    EP_NCCL(ncclSend(mine + static_cast<int64_t>(p) * L, L, ncclInt64, p, st.comm, st.stream),
            "ncclSend of metadata to peer " + std::to_string(p));
    EP_NCCL(ncclRecv(theirs + static_cast<int64_t>(p) * L, L, ncclInt64, p, st.comm, st.stream),
            "ncclRecv of metadata from peer " + std::to_string(p));
  }
  if (n > 1) EP_NCCL(ncclGroupEnd(), "ncclGroupEnd (metadata)");
  ffi::Error e = ensure_host(st, static_cast<size_t>(2) * n * L);
  if (e.failure()) return ffi::Error::Internal(where + ": " + e.message());
  const int64_t seq = ++st.seq;
  publish_kernel<<<1, 256, 0, st.stream>>>(mine, theirs, static_cast<int64_t>(n) * L, st.host,
                                           st.flag, seq);
  EP_CUDA(cudaGetLastError(), "launching the publish kernel");
  std::string why = wait_for_metadata(st, seq);
  if (!why.empty()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, where + ": " + why);
  const int64_t* h_mine = st.host;
  const int64_t* h_theirs = st.host + static_cast<int64_t>(n) * L;
  std::memcpy(const_cast<int64_t*>(h_theirs) + static_cast<int64_t>(me) * L,
              h_mine + static_cast<int64_t>(me) * L, L * sizeof(int64_t));
  for (int p = 0; p < n; ++p) {
    Plan pair;
    plan_pair(pair, h_mine + static_cast<int64_t>(p) * L, h_theirs + static_cast<int64_t>(p) * L, me,
              p, a.m);
    plan->errors.insert(plan->errors.end(), pair.errors.begin(), pair.errors.end());
    if (p == me && !self_via_nccl) continue;  // the self-copy kernel moved these
    plan->sends.insert(plan->sends.end(), pair.sends.begin(), pair.sends.end());
    plan->recvs.insert(plan->recvs.end(), pair.recvs.begin(), pair.recvs.end());
  }
  if (st.flag[1] != 0) st.flag[1] = 0;  // the host plan above reports the self segment in words
  return ffi::Error::Success();
}

// Payload: one grouped ncclSend/ncclRecv of exactly the planned rows.
ffi::Error issue_payload(CommState& st, const std::string& where, const Plan& plan, const char* in,
                         char* out, int64_t row_bytes) {
  if (row_bytes == 0 || (plan.sends.empty() && plan.recvs.empty())) return ffi::Error::Success();
  EP_NCCL(ncclGroupStart(), "ncclGroupStart");
  for (const Transfer& t : plan.sends) {
    EP_NCCL(ncclSend(in + t.row * row_bytes, static_cast<size_t>(t.rows * row_bytes), ncclUint8,
                     t.peer, st.comm, st.stream),
            "ncclSend of " + std::to_string(t.rows) + " rows to peer " + std::to_string(t.peer));
  }
  for (const Transfer& t : plan.recvs) {
    EP_NCCL(ncclRecv(out + t.row * row_bytes, static_cast<size_t>(t.rows * row_bytes), ncclUint8,
                     t.peer, st.comm, st.stream),
            "ncclRecv of " + std::to_string(t.rows) + " rows from peer " + std::to_string(t.peer));
  }
  EP_NCCL(ncclGroupEnd(), "ncclGroupEnd (payload)");
  return ffi::Error::Success();
}

ffi::Error Start(cudaStream_t xla_stream, int32_t ordinal, ffi::AnyBuffer operand, ffi::AnyBuffer output,
                 ffi::Buffer<ffi::S32> input_offsets, ffi::Buffer<ffi::S32> send_sizes,
                 ffi::Buffer<ffi::S32> output_offsets, ffi::Buffer<ffi::S32> recv_sizes,
                 ffi::Result<ffi::AnyBuffer> result, ffi::Result<ffi::Buffer<ffi::S64>> workspace,
                 int64_t comm_key, int64_t tag, int64_t op_id, std::string_view label) {
  const std::string transport = "nccl transport, device " + std::to_string(ordinal);
  CommState* stp = lookup(comm_key, ordinal);
  if (stp == nullptr) {
    return ffi::Error::Internal("ep_comm " + std::string(label) + " (" + transport +
                                "): communicator " + std::to_string(comm_key) +
                                " is not bootstrapped on this device (communicators are created "
                                "when the program is lowered; was collectives.finalize() called "
                                "in between?)");
  }
  CommState& st = *stp;
  std::lock_guard<std::mutex> lock(st.mu);
  const std::string where = call_site(label, transport, st.rank, st.size);
  const int n = st.size, me = st.rank;
  CallShape cs;
  ffi::Error begun = begin_call(where, st.broken, operand, output, input_offsets.element_count(), n,
                                &cs);
  if (begun.failure()) return begun;
  const int m = cs.m, L = message_len(m);
  const int64_t row_bytes = cs.row_bytes, n_in = cs.operand_rows;
  if (workspace->element_count() < static_cast<size_t>(2) * n * L) {
    return ffi::Error::InvalidArgument(where + ": workspace of " +
                                       std::to_string(workspace->element_count()) +
                                       " int64 is smaller than the " + std::to_string(2 * n * L) +
                                       " the exchange needs");
  }
  if (st.flag[1] != 0) {  // a self copy of an earlier single-rank call found a bad segment
    st.flag[1] = 0;
    return ffi::Error::InvalidArgument(
        where + ": an earlier exchange on this communicator had an ill-formed self segment "
                "(send_sizes != recv_sizes, or rows outside operand/output) and skipped it; "
                "check the offsets and sizes (single-rank exchanges report this on the next call)");
  }
  const char* in = static_cast<const char*>(operand.untyped_data());
  char* out = static_cast<char*>(result->untyped_data());
  int64_t* mine = workspace->typed_data();
  int64_t* theirs = mine + static_cast<int64_t>(n) * L;

  char range_name[256];
  std::snprintf(range_name, sizeof(range_name), "ep_comm %.*s: %d peers, operand %lld x %lld B",
                static_cast<int>(label.size()), label.data(), n, static_cast<long long>(n_in),
                static_cast<long long>(row_bytes));
  nvtxRangePushA(range_name);
  struct Pop { ~Pop() { nvtxRangePop(); } } pop;
  st.ranges[op_id] = nvtxRangeStartA(range_name);

  EP_CUDA(cudaEventRecord(st.ev_in, xla_stream), "cudaEventRecord on XLA's stream");
  EP_CUDA(cudaStreamWaitEvent(st.stream, st.ev_in, 0), "cudaStreamWaitEvent");
  if (out != output.untyped_data() && output.size_bytes() > 0) {  // XLA could not alias
    EP_CUDA(cudaMemcpyAsync(out, output.untyped_data(), output.size_bytes(), cudaMemcpyDeviceToDevice,
                            st.stream), "copy of output into the result");
  }
  const SelfArgs a{input_offsets.typed_data(), send_sizes.typed_data(), output_offsets.typed_data(),
                   recv_sizes.typed_data(), me, m, cs.segments, row_bytes, tag, n_in,
                   cs.output_rows};
  // EP_COMM_NCCL_SELF=1 sends the self segment through the host path and NCCL like any peer's
  // (a diagnostic: on one GPU it shows what the multi-rank path costs per call).
  const bool self_via_nccl = st.self_via_nccl;
  if (row_bytes > 0 && !self_via_nccl) {
    launch_self_copy(st, in, out, a);
    EP_CUDA(cudaGetLastError(), "launching the self-copy kernel");
  }
  Plan plan;
  if (n > 1 || self_via_nccl) {  // the metadata goes to the peers, then to the host
    ffi::Error e = plan_exchange(st, where, a, self_via_nccl, mine, theirs, &plan);
    if (e.failure()) return e;
    if (n > 1) inject_after_metadata(st.fault);
    e = issue_payload(st, where, plan, in, out, row_bytes);
    if (e.failure()) return e;
  }
  auto [it, fresh] = st.done.try_emplace(op_id, nullptr);
  if (fresh) EP_CUDA(cudaEventCreateWithFlags(&it->second, cudaEventDisableTiming), "cudaEventCreate");
  EP_CUDA(cudaEventRecord(it->second, st.stream), "cudaEventRecord on the communication stream");
  if (!plan.sends.empty() || !plan.recvs.empty()) {
    std::string peers;
    std::vector<int> seen;
    for (const auto* list : {&plan.sends, &plan.recvs}) {
      for (const Transfer& t : *list) {
        if (std::find(seen.begin(), seen.end(), t.peer) != seen.end()) continue;
        seen.push_back(t.peer);
        peers += (peers.empty() ? "" : ", ") + std::to_string(t.peer);
      }
    }
    watch_payload(st, op_id, it->second, where + ": the payload exchange with peers " + peers);
  }
  if (!plan.errors.empty()) {
    return ffi::Error::InvalidArgument(
        join_errors(where + ": invalid exchange, these transfers were skipped", plan.errors));
  }
  return ffi::Error::Success();
}

ffi::Error Done(cudaStream_t xla_stream, int32_t ordinal, ffi::AnyBuffer output,
                ffi::RemainingArgs /*kept alive*/, ffi::Result<ffi::AnyBuffer> result, int64_t comm_key, int64_t op_id,
                std::string_view label) {
  std::string where = "ep_comm " + std::string(label) + " done (nccl transport, device " +
                      std::to_string(ordinal) + ")";
  CommState* stp = lookup(comm_key, ordinal);
  if (stp == nullptr) return ffi::Error::Internal(where + ": communicator is not bootstrapped");
  CommState& st = *stp;
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.done.find(op_id);
  if (it == st.done.end()) return ffi::Error::Internal(where + ": no exchange was started (op " +
                                                       std::to_string(op_id) + ")");
  EP_CUDA(cudaStreamWaitEvent(xla_stream, it->second, 0), "cudaStreamWaitEvent on XLA's stream");
  if (st.size > 1 && result->size_bytes() > 0) {  // NaN bits if the watchdog aborted this call
    poison_if_aborted<<<64, 256, 0, xla_stream>>>(static_cast<char*>(result->untyped_data()),
                                                 static_cast<int64_t>(result->size_bytes()),
                                                 st.flag);
    EP_CUDA(cudaGetLastError(), "launching the abort check");
  }
  if (result->untyped_data() != output.untyped_data() && output.size_bytes() > 0) {
    EP_CUDA(cudaMemcpyAsync(result->untyped_data(), output.untyped_data(), output.size_bytes(),
                            cudaMemcpyDeviceToDevice, xla_stream), "copy of the result");
  }
  auto r = st.ranges.find(op_id);
  if (r != st.ranges.end()) {
    nvtxRangeEnd(r->second);
    st.ranges.erase(r);
  }
  return ffi::Error::Success();
}

// The ceiling the engine is measured against: one cudaMemcpyAsync of the same bytes, into a
// buffer passed in (aliased to the result), as the exchange writes into its `output`.
ffi::Error Copy(cudaStream_t stream, ffi::AnyBuffer src, ffi::AnyBuffer /*into*/,
                ffi::Result<ffi::AnyBuffer> dst) {
  const size_t bytes = std::min(src.size_bytes(), dst->size_bytes());
  cudaError_t e = cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(), bytes,
                                  cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess) return ffi::Error::Internal("ep_comm device copy: " + cuda_str(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_nccl_start, Start,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()         // operand
        .Arg<ffi::AnyBuffer>()         // output (aliased to result)
        .Arg<ffi::Buffer<ffi::S32>>()  // input_offsets
        .Arg<ffi::Buffer<ffi::S32>>()  // send_sizes
        .Arg<ffi::Buffer<ffi::S32>>()  // output_offsets
        .Arg<ffi::Buffer<ffi::S32>>()  // recv_sizes
        .Ret<ffi::AnyBuffer>()         // result
        .Ret<ffi::Buffer<ffi::S64>>()  // workspace (metadata)
        .Attr<int64_t>("comm_key")
        .Attr<int64_t>("tag")
        .Attr<int64_t>("op_id")
        .Attr<std::string_view>("label"));

// done takes the start's result and, to keep them alive until the exchange has read them, the
// workspace, operand and index arrays (their values are not used).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_nccl_done, Done,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()  // start's result (aliased to result)
        .RemainingArgs()
        .Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("comm_key")
        .Attr<int64_t>("op_id")
        .Attr<std::string_view>("label"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_device_copy, Copy,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()   // src
        .Arg<ffi::AnyBuffer>()   // into (aliased to the result)
        .Ret<ffi::AnyBuffer>());

std::string unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed: " + nccl_str(r));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

void init(int64_t key, const std::vector<Member>& members) {
  int prev = 0;
  cudaGetDevice(&prev);
  std::vector<std::unique_ptr<CommState>> states;
  for (const Member& mb : members) {
    if (mb.unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
      throw std::runtime_error("ep_comm nccl init: unique id of " + std::to_string(mb.unique_id.size()) +
                               " bytes, expected " + std::to_string(NCCL_UNIQUE_ID_BYTES));
    }
    if (has(key, mb.ordinal)) {
      throw std::runtime_error("ep_comm nccl init: communicator " + std::to_string(key) +
                               " already exists on device " + std::to_string(mb.ordinal));
    }
    auto st = std::make_unique<CommState>();
    st->rank = mb.rank;
    st->size = mb.size;
    st->device = mb.ordinal;
    st->timeout_s = timeout_seconds();
    const char* via = std::getenv("EP_COMM_NCCL_SELF");
    st->self_via_nccl = via != nullptr && via[0] == '1';
    // EP_COMM_SELF_COPY_BLOCKS=k: the self-copy kernel runs k blocks per segment, a link of a
    // few SMs' bandwidth (a diagnostic: on one GPU it gives the self exchange a peer link's time
    // and SM footprint, to see it overlap other work)
    const char* blocks = std::getenv("EP_COMM_SELF_COPY_BLOCKS");
    st->self_copy_blocks = blocks != nullptr ? std::max(0, std::atoi(blocks)) : 0;
    st->fault = fault_injection();
    states.push_back(std::move(st));
  }
  auto fail = [&](const std::string& what) {
    cudaSetDevice(prev);
    throw std::runtime_error("ep_comm nccl init of communicator " + std::to_string(key) + ": " + what);
  };
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) fail("ncclGroupStart: " + nccl_str(r));
  for (size_t i = 0; i < members.size(); ++i) {
    ncclUniqueId id;
    std::memcpy(id.internal, members[i].unique_id.data(), NCCL_UNIQUE_ID_BYTES);
    cudaError_t e = cudaSetDevice(members[i].ordinal);
    if (e != cudaSuccess) fail("cudaSetDevice(" + std::to_string(members[i].ordinal) + "): " + cuda_str(e));
    r = ncclCommInitRank(&states[i]->comm, members[i].size, id, members[i].rank);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      fail("ncclCommInitRank(rank " + std::to_string(members[i].rank) + " of " +
           std::to_string(members[i].size) + "): " + nccl_str(r));
    }
  }
  r = ncclGroupEnd();
  if (r != ncclSuccess) fail("ncclGroupEnd: " + nccl_str(r) + " (" + ncclGetLastError(nullptr) + ")");
  for (auto& st : states) {
    cudaSetDevice(st->device);
    int lo = 0, hi = 0;
    cudaDeviceGetStreamPriorityRange(&lo, &hi);
    cudaError_t e = cudaStreamCreateWithPriority(&st->stream, cudaStreamNonBlocking, hi);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&st->ev_in, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaHostAlloc(reinterpret_cast<void**>(&st->flag), 3 * sizeof(int64_t),
                                            cudaHostAllocMapped);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&st->sm_count, cudaDevAttrMultiProcessorCount, st->device);
    if (e != cudaSuccess) fail("creating the communication stream: " + cuda_str(e));
    st->flag[0] = st->flag[1] = st->flag[2] = 0;
    char name[64];
    std::snprintf(name, sizeof(name), "ep_comm comm %lld rank %d", static_cast<long long>(key), st->rank);
    nvtxNameCudaStreamA(st->stream, name);
  }
  cudaSetDevice(prev);
  std::lock_guard<std::mutex> lock(registry_mu());
  for (auto& st : states) {
    const int ordinal = st->device;
    registry()[{key, ordinal}] = std::move(st);
  }
}

bool has(int64_t key, int ordinal) { return lookup(key, ordinal) != nullptr; }

std::string status(int64_t key, int ordinal) {
  CommState* st = lookup(key, ordinal);
  if (st == nullptr) return "missing";
  std::lock_guard<std::mutex> lock(st->mu);
  return st->broken.empty() ? "ok" : "broken: " + st->broken;
}

void finalize() {
  std::map<std::pair<int64_t, int>, std::unique_ptr<CommState>> doomed;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    doomed.swap(registry());
  }
  doomed.clear();  // ~CommState: synchronize, destroy (or abort) each communicator
}

int built_version() { return NCCL_VERSION_CODE; }

int runtime_version() {
  int v = 0;
  ncclGetVersion(&v);
  return v;
}

}  // namespace ep_comm::nccl
