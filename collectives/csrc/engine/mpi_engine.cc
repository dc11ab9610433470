// MPI transport (CPU): the ragged exchange as an XLA FFI handler, built against the MPI library that
// mpi4py loads. Metadata and payload go by point-to-point messages (so a missing peer is named),
// each waited for with a deadline. Communicators are created by Python (mpi4py Split along the mesh
// axis) and registered here by key; this module never owns them (mpi4py frees them before
// MPI_Finalize).
//
// Ordering: XLA:CPU runs independent custom calls of one program in an order that can differ
// between processes (or on several threads at once). Two defences: the lowering chains the
// exchanges of one block by data dependence (the `after` operand: the previous exchange's result),
// so every process runs them in program order; and every call carries its own message tags,
// derived from the program's channel id for it (the same in every process, unique within the
// program), with no collective MPI call, so exchanges that still run at once (e.g. in different
// blocks) cannot match each other's messages. That needs MPI_THREAD_MULTIPLE (checked at
// bootstrap).
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "call_shape.h"
#include "exchange_plan.h"
#include "ffi_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace ep_comm {
namespace {

// Tags of one call: metadata and payload, from its channel id. Several segments to one peer share
// the payload tag; MPI's non-overtaking rule matches them in slot order, the order both ends post.
struct Tags {
  int meta, data;
};

Tags tags_of(int64_t channel) {
  static const int tag_ub = [] {
    void* v = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);
    return flag && v ? *static_cast<int*>(v) : 32767;  // the standard's guaranteed minimum
  }();
  const int64_t span = (tag_ub - 2) / 2;
  const int base = 2 + 2 * static_cast<int>(channel % span);
  return {base, base + 1};
}

struct MpiComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::string broken;  // non-empty once a timeout left the communicator unusable
  double timeout_s = 300.0;  // EP_COMM_TIMEOUT_S when the communicator was registered
  Fault fault = Fault::kNone;  // EP_COMM_FAULT (tests only)
};

std::mutex g_mu;
std::map<int64_t, MpiComm> g_comms;

template <typename Comm>
Comm comm_from_handle(intptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);  // Open MPI: a pointer
  } else {
    return static_cast<Comm>(handle);  // MPICH: an int
  }
}

std::string mpi_error(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

// Wait for every request until the deadline. On timeout, returns the peers whose request did not
// complete (cancelling point-to-point ones); "" on success; an MPI error string on failure.
std::string wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& peers, double timeout_s,
                     bool* timed_out) {
  *timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int spins = 0;
  while (true) {
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return "MPI_Testall failed: " + mpi_error(rc);
    if (done) return "";
    if (std::chrono::steady_clock::now() > deadline) break;
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  *timed_out = true;
  std::string missing;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Test(&reqs[i], &done, MPI_STATUS_IGNORE);
    if (done) continue;
    if (!missing.empty()) missing += ", ";
    missing += peers[i] < 0 ? std::string("all (collective)") : std::to_string(peers[i]);
    if (peers[i] >= 0) {
      MPI_Cancel(&reqs[i]);
      MPI_Request_free(&reqs[i]);
    }
  }
  return missing;
}

ffi::Error Exchange(ffi::AnyBuffer operand, ffi::AnyBuffer output, ffi::Buffer<ffi::S32> input_offsets,
                    ffi::Buffer<ffi::S32> send_sizes, ffi::Buffer<ffi::S32> output_offsets,
                    ffi::Buffer<ffi::S32> recv_sizes, ffi::AnyBuffer /*after: ordering only*/,
                    ffi::Result<ffi::AnyBuffer> result, int64_t comm_key, int64_t tag,
                    int64_t channel, std::string_view label) {
  MpiComm c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(comm_key);
    if (it == g_comms.end()) {
      return ffi::Error::Internal(
          "ep_comm " + std::string(label) + " (mpi transport): communicator " +
          std::to_string(comm_key) +
          " is not bootstrapped in this process (it is created when the program is lowered; "
          "was collectives.finalize() called in between?)");
    }
    c = it->second;
  }
  const std::string where = call_site(label, "mpi transport", c.rank, c.size);
  const int n = c.size, me = c.rank;
  CallShape cs;
  ffi::Error begun = begin_call(where, c.broken, operand, output, input_offsets.element_count(), n,
                                &cs);
  if (begun.failure()) return begun;
  const int m = cs.m;
  const int64_t K = cs.segments, row_bytes = cs.row_bytes, n_in = cs.operand_rows,
                n_out = cs.output_rows;
  char* out = static_cast<char*>(result->untyped_data());
  if (out != output.untyped_data() && output.size_bytes() > 0) {
    std::memcpy(out, output.untyped_data(), output.size_bytes());  // XLA could not alias
  }
  const double timeout_s = c.timeout_s;
  const Tags tags = tags_of(channel);

  // 1. metadata: one message to and from every peer (self included, by copy).
  const int L = message_len(m);
  std::vector<int64_t> mine(static_cast<size_t>(n) * L), theirs(static_cast<size_t>(n) * L);
  for (int p = 0; p < n; ++p) {
    pack_message(mine.data() + static_cast<size_t>(p) * L, p, m, K, row_bytes, tag, n_in, n_out,
                 input_offsets.typed_data(), send_sizes.typed_data(), output_offsets.typed_data(),
                 recv_sizes.typed_data());
  }
  std::memcpy(theirs.data() + static_cast<size_t>(me) * L, mine.data() + static_cast<size_t>(me) * L,
              L * sizeof(int64_t));
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    reqs.emplace_back();
    peers.push_back(p);
    int rc = MPI_Irecv(theirs.data() + static_cast<size_t>(p) * L, L, MPI_INT64_T, p, tags.meta,
                       c.comm, &reqs.back());
    if (rc != MPI_SUCCESS) return ffi::Error::Internal(where + ": MPI_Irecv of metadata from peer " +
                                                       std::to_string(p) + " failed: " + mpi_error(rc));
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    reqs.emplace_back();
    peers.push_back(p);
    int rc = MPI_Isend(mine.data() + static_cast<size_t>(p) * L, L, MPI_INT64_T, p, tags.meta,
                       c.comm, &reqs.back());
    if (rc != MPI_SUCCESS) return ffi::Error::Internal(where + ": MPI_Isend of metadata to peer " +
                                                       std::to_string(p) + " failed: " + mpi_error(rc));
  }
  Plan plan;
  auto fail_timeout = [&](const std::string& phase, const std::string& missing) {
    std::string why = phase + " timed out after " + std::to_string(timeout_s) + " s";
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto it = g_comms.find(comm_key);
      if (it != g_comms.end()) it->second.broken = why;
    }
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      join_errors(where + ": " + why + " waiting for peer(s) " + missing +
                                      " (they never reached this exchange: a crashed process, or "
                                      "ranks running different programs). Set EP_COMM_TIMEOUT_S to "
                                      "change the limit",
                                  plan.errors));
  };
  bool timed_out = false;
  std::string err = wait_all(reqs, peers, timeout_s, &timed_out);
  if (timed_out) return fail_timeout("metadata exchange", err);
  if (!err.empty()) return ffi::Error::Internal(where + ": metadata exchange: " + err);

  // 2. decide every transfer; both ends of each pair decide alike.
  for (int p = 0; p < n; ++p) {
    plan_pair(plan, mine.data() + static_cast<size_t>(p) * L,
              theirs.data() + static_cast<size_t>(p) * L, me, p, m);
  }

  // 3. payload: the planned point-to-point transfers (a rank's rows to itself included).
  if (n > 1) inject_after_metadata(c.fault);
  if (!plan.sends.empty() || !plan.recvs.empty()) {
    for (const auto* list : {&plan.sends, &plan.recvs}) {
      for (const Transfer& t : *list) {
        if (t.row > INT_MAX || t.rows > INT_MAX) {
          return ffi::Error::InvalidArgument(where + ": a segment at row " + std::to_string(t.row) +
                                             " of " + std::to_string(t.rows) +
                                             " rows is beyond MPI's int counts");
        }
      }
    }
    if (row_bytes > INT_MAX) {
      return ffi::Error::InvalidArgument(where + ": rows of " + std::to_string(row_bytes) +
                                         " bytes are beyond MPI's int counts");
    }
    MPI_Datatype row_type;
    MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row_type);
    MPI_Type_commit(&row_type);
    const char* in = static_cast<const char*>(operand.untyped_data());
    reqs.clear();
    peers.clear();
    int rc = MPI_SUCCESS;
    for (const Transfer& t : plan.recvs) {
      reqs.emplace_back();
      peers.push_back(t.peer);
      rc = MPI_Irecv(out + t.row * row_bytes, int(t.rows), row_type, t.peer, tags.data, c.comm,
                     &reqs.back());
      if (rc != MPI_SUCCESS) break;
    }
    for (const Transfer& t : plan.sends) {
      if (rc != MPI_SUCCESS) break;
      reqs.emplace_back();
      peers.push_back(t.peer);
      rc = MPI_Isend(in + t.row * row_bytes, int(t.rows), row_type, t.peer, tags.data, c.comm,
                     &reqs.back());
    }
    if (rc != MPI_SUCCESS) {
      MPI_Type_free(&row_type);
      return ffi::Error::Internal(where + ": posting the payload exchange failed: " + mpi_error(rc));
    }
    err = wait_all(reqs, peers, timeout_s, &timed_out);
    MPI_Type_free(&row_type);
    if (timed_out) return fail_timeout("payload exchange", err);
    if (!err.empty()) return ffi::Error::Internal(where + ": payload exchange: " + err);
  }
  if (!plan.errors.empty()) {
    return ffi::Error::InvalidArgument(
        join_errors(where + ": invalid exchange, these transfers were skipped", plan.errors));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ep_comm_mpi_exchange, Exchange,
    ffi::Ffi::Bind()
        .Arg<ffi::AnyBuffer>()       // operand
        .Arg<ffi::AnyBuffer>()       // output (aliased to the result)
        .Arg<ffi::Buffer<ffi::S32>>()  // input_offsets
        .Arg<ffi::Buffer<ffi::S32>>()  // send_sizes
        .Arg<ffi::Buffer<ffi::S32>>()  // output_offsets
        .Arg<ffi::Buffer<ffi::S32>>()  // recv_sizes
        .Arg<ffi::AnyBuffer>()  // after: the previous exchange's result
        .Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("comm_key")
        .Attr<int64_t>("tag")
        .Attr<int64_t>("channel")
        .Attr<std::string_view>("label"));

namespace {

void register_comm(int64_t key, intptr_t handle) {
  MPI_Comm comm = comm_from_handle<MPI_Comm>(handle);
  MpiComm c;
  c.comm = comm;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm, &c.rank);
  MPI_Comm_size(comm, &c.size);
  c.timeout_s = timeout_seconds();
  c.fault = fault_injection();
  std::lock_guard<std::mutex> lock(g_mu);
  g_comms[key] = c;
}

}  // namespace
}  // namespace ep_comm

NB_MODULE(_ep_mpi, m) {
  m.doc() = "ep_comm MPI transport: XLA FFI handler for the ragged exchange on CPU";
  m.def(
      "handlers",
      []() {
        using namespace ep_comm;
        nb::dict table;
#define EP_COMM_HANDLER(target) EP_COMM_HANDLER_ENTRY(table, target)
#include "mpi_handlers.def"
#undef EP_COMM_HANDLER
        return table;
      },
      "{XLA FFI target name: handler capsule} of the MPI transport.");
  m.def("register_comm", &ep_comm::register_comm, nb::arg("key"), nb::arg("handle"),
        "Make an MPI communicator (mpi4py handle) usable under `key` by the handler.");
  m.def("unregister_comm", [](int64_t key) {
    std::lock_guard<std::mutex> lock(ep_comm::g_mu);
    return ep_comm::g_comms.erase(key) > 0;
  });
  m.def("unregister_all", []() {
    std::lock_guard<std::mutex> lock(ep_comm::g_mu);
    ep_comm::g_comms.clear();
  });
  m.def("comm_status", [](int64_t key) -> std::string {
    std::lock_guard<std::mutex> lock(ep_comm::g_mu);
    auto it = ep_comm::g_comms.find(key);
    if (it == ep_comm::g_comms.end()) return "missing";
    return it->second.broken.empty() ? "ok" : "broken: " + it->second.broken;
  });
  m.def("library_version", []() {
    char buf[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(buf, &len);
    return std::string(buf, len);
  });
}
