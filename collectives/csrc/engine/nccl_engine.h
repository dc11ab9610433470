// Host-side interface of the NCCL engine (nccl_engine.cu), used by the Python bindings.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "ffi_handlers.h"

namespace ep_comm::nccl {

// One local member of a communicator: CUDA device ordinal, rank in the group, group size, and the
// group's ncclUniqueId (NCCL_UNIQUE_ID_BYTES bytes).
struct Member {
  int ordinal;
  int rank;
  int size;
  std::string unique_id;
};

std::string unique_id();                      // a fresh ncclUniqueId as bytes
void init(int64_t key, const std::vector<Member>& members);  // throws std::runtime_error
bool has(int64_t key, int ordinal);
std::string status(int64_t key, int ordinal);  // "missing", "ok" or "broken: ..."
void finalize();                                // destroys every communicator
int built_version();                            // NCCL_VERSION_CODE at build time
int runtime_version();                          // ncclGetVersion of the loaded library

#define EP_COMM_HANDLER(target) EP_COMM_DECLARE_HANDLER(target)
#include "nccl_handlers.def"
#undef EP_COMM_HANDLER

}  // namespace ep_comm::nccl
