// The ragged exchange protocol shared by every native transport (MPI on CPU, NCCL on GPU).
//
// A call has K = n * m segments per rank: segment j*m + s goes to group member j. Before any payload
// moves, every rank sends every peer one small metadata message (int64):
//
//   header  [kMagic, row_bytes, K, tag, operand_rows, output_rows]
//   slot s  [input_offset, send_size, output_offset, recv_size]   for s in 0..m-1
//
// where slot s of the message to peer j carries this rank's segment j*m + s (what it sends to j) and
// recv_sizes[j*m + s] (what it expects from j). With both messages of a pair in hand, sender and
// receiver decide *identically* whether each transfer is well formed (same header, sizes that
// agree, rows inside both buffers). Ill-formed transfers are skipped by both ends, so nobody waits
// for bytes that never come, and both ends report the error. Nothing is dropped silently.
#pragma once
#include <thread>
#include <chrono>

#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define EP_HD __host__ __device__
#else
#define EP_HD
#endif

namespace ep_comm {

inline constexpr int64_t kMagic = 0x65706331;  // "epc1": protocol version
inline constexpr int kHeader = 6;
inline constexpr int kSlot = 4;

EP_HD inline int message_len(int m) { return kHeader + kSlot * m; }

enum HeaderField { kHMagic = 0, kHRowBytes, kHSegments, kHTag, kHOperandRows, kHOutputRows };
enum SlotField { kSInputOffset = 0, kSSendSize, kSOutputOffset, kSRecvSize };

EP_HD inline int64_t slot(const int64_t* msg, int s, int field) { return msg[kHeader + kSlot * s + field]; }

// Fill `msg` (length message_len(m)) for peer `peer` from this rank's index arrays.
template <typename Index>
EP_HD void pack_message(int64_t* msg, int peer, int m, int64_t segments, int64_t row_bytes, int64_t tag,
                  int64_t operand_rows,
                  int64_t output_rows, const Index* input_offsets, const Index* send_sizes,
                  const Index* output_offsets, const Index* recv_sizes) {
  msg[kHMagic] = kMagic;
  msg[kHRowBytes] = row_bytes;
  msg[kHSegments] = segments;
  msg[kHTag] = tag;
  msg[kHOperandRows] = operand_rows;
  msg[kHOutputRows] = output_rows;
  for (int s = 0; s < m; ++s) {
    const int64_t i = static_cast<int64_t>(peer) * m + s;
    int64_t* d = msg + kHeader + kSlot * s;
    d[kSInputOffset] = input_offsets[i];
    d[kSSendSize] = send_sizes[i];
    d[kSOutputOffset] = output_offsets[i];
    d[kSRecvSize] = recv_sizes[i];
  }
}

inline std::string describe_header(const int64_t* msg) {
  std::ostringstream o;
  if (msg[kHMagic] != kMagic) {
    o << "an unknown protocol (magic " << msg[kHMagic] << ")";
    return o.str();
  }
  o << "rows of " << msg[kHRowBytes] << " bytes, " << msg[kHSegments] << " segments, config tag "
    << msg[kHTag] << ", operand " << msg[kHOperandRows] << " rows, output " << msg[kHOutputRows]
    << " rows";
  return o.str();
}

EP_HD inline bool headers_agree(const int64_t* a, const int64_t* b) {
  return a[kHMagic] == kMagic && b[kHMagic] == kMagic && a[kHRowBytes] == b[kHRowBytes] &&
         a[kHSegments] == b[kHSegments] && a[kHTag] == b[kHTag];
}

enum Verdict { kOk = 0, kHeaderMismatch, kNegativeSize, kSizeMismatch, kReadOutside, kWriteOutside };

// Is the transfer of slot s well formed? `from` is the sender's message to the receiver, `to` the
// receiver's message to the sender. Host and device code (the NCCL self copy) share this rule.
EP_HD inline Verdict transfer_verdict(const int64_t* from, const int64_t* to, int s) {
  if (!headers_agree(from, to)) return kHeaderMismatch;
  const int64_t in_off = slot(from, s, kSInputOffset), size = slot(from, s, kSSendSize);
  const int64_t out_off = slot(from, s, kSOutputOffset), expect = slot(to, s, kSRecvSize);
  if (size < 0) return kNegativeSize;
  if (size != expect) return kSizeMismatch;
  if (size > 0 && (in_off < 0 || in_off + size > from[kHOperandRows])) return kReadOutside;
  if (size > 0 && (out_off < 0 || out_off + size > to[kHOutputRows])) return kWriteOutside;
  return kOk;
}

// The same decision as a sentence ("" when well formed) for transfers from rank src to rank dst.
inline std::string check_transfer(const int64_t* from, const int64_t* to, int s, int src, int dst,
                                  int m) {
  const int64_t in_off = slot(from, s, kSInputOffset), size = slot(from, s, kSSendSize);
  const int64_t out_off = slot(from, s, kSOutputOffset), expect = slot(to, s, kSRecvSize);
  const int64_t seg_send = static_cast<int64_t>(dst) * m + s;  // sender's segment index
  const int64_t seg_recv = static_cast<int64_t>(src) * m + s;  // receiver's segment index
  std::ostringstream o;
  switch (transfer_verdict(from, to, s)) {
    case kOk:
    case kHeaderMismatch:  // reported once per peer by plan_pair
      break;
    case kNegativeSize:
      o << "rank " << src << " has send_sizes[" << seg_send << "]=" << size << " < 0";
      break;
    case kSizeMismatch:
      o << "rank " << src << " sends " << size << " rows (send_sizes[" << seg_send << "]) but rank "
        << dst << " expects " << expect << " (recv_sizes[" << seg_recv << "])";
      break;
    case kReadOutside:
      o << "rank " << src << " reads operand rows [" << in_off << ", " << in_off + size
        << ") (input_offsets[" << seg_send << "]) outside its " << from[kHOperandRows]
        << " operand rows";
      break;
    case kWriteOutside:
      o << "rank " << src << " writes rows [" << out_off << ", " << out_off + size
        << ") (output_offsets[" << seg_send << "]) outside rank " << dst << "'s "
        << to[kHOutputRows] << " output rows";
      break;
  }
  return o.str();
}

struct Transfer {
  int peer;
  int slot;
  int64_t row;   // first row in the local buffer (operand for sends, output for receives)
  int64_t rows;
};

struct Plan {
  std::vector<Transfer> sends, recvs;
  std::vector<std::string> errors;
};

// Decide every transfer between `me` and `peer`. `mine` is my message to peer, `theirs` the peer's
// message to me. Both ends of the pair compute the same decisions.
inline void plan_pair(Plan& plan, const int64_t* mine, const int64_t* theirs, int me, int peer,
                      int m) {
  if (!headers_agree(mine, theirs)) {
    plan.errors.push_back("rank " + std::to_string(me) + " exchanges " + describe_header(mine) +
                          " but rank " + std::to_string(peer) + " exchanges " +
                          describe_header(theirs) +
                          " (the ranks run different programs or configurations)");
    return;
  }
  for (int s = 0; s < m; ++s) {
    std::string why = check_transfer(mine, theirs, s, me, peer, m);  // me -> peer
    if (!why.empty()) {
      plan.errors.push_back(why);
    } else if (slot(mine, s, kSSendSize) > 0) {
      plan.sends.push_back({peer, s, slot(mine, s, kSInputOffset), slot(mine, s, kSSendSize)});
    }
    why = check_transfer(theirs, mine, s, peer, me, m);  // peer -> me
    if (!why.empty()) {
      if (peer != me) plan.errors.push_back(why);  // a self transfer was reported just above
    } else if (slot(theirs, s, kSSendSize) > 0) {
      plan.recvs.push_back({peer, s, slot(theirs, s, kSOutputOffset), slot(theirs, s, kSSendSize)});
    }
  }
}

// "what failed" followed by at most `limit` reasons.
inline std::string join_errors(const std::string& what, const std::vector<std::string>& errors,
                               size_t limit = 4) {
  std::string out = what;
  for (size_t i = 0; i < errors.size() && i < limit; ++i) out += (i ? "; " : ": ") + errors[i];
  if (errors.size() > limit) out += "; and " + std::to_string(errors.size() - limit) + " more";
  return out;
}

// Seconds a rank waits for its peers before it gives up (EP_COMM_TIMEOUT_S, default 300). Read
// once per communicator, when it is created: never on the hot path.
inline double timeout_seconds() {
  const char* v = std::getenv("EP_COMM_TIMEOUT_S");
  if (v == nullptr || *v == '\0') return 300.0;
  char* end = nullptr;
  double t = std::strtod(v, &end);
  return (end != v && t > 0) ? t : 300.0;
}

// Fault injection for the reliability tests (tests/faults.py), read when a communicator is
// created: EP_COMM_FAULT=exit_after_metadata makes this process exit (status 86) once the metadata
// of its first exchange with peers has arrived, stall_after_metadata makes it sleep there for good:
// a peer that dies, or stops, between the metadata and the payload.
enum class Fault { kNone, kExitAfterMetadata, kStallAfterMetadata };

inline Fault fault_injection() {
  const char* v = std::getenv("EP_COMM_FAULT");
  if (v == nullptr) return Fault::kNone;
  const std::string f(v);
  if (f == "exit_after_metadata") return Fault::kExitAfterMetadata;
  if (f == "stall_after_metadata") return Fault::kStallAfterMetadata;
  return Fault::kNone;
}

// Act on an injected fault between the metadata and the payload phase.
inline void inject_after_metadata(Fault f) {
  if (f == Fault::kExitAfterMetadata) std::_Exit(86);
  if (f == Fault::kStallAfterMetadata) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

}  // namespace ep_comm
