// Host-side interface of the row kernels, used by the Python bindings (module.cc).
#pragma once

#include <cstdint>

#include "ffi_handlers.h"

namespace ep_comm::rows {

#define EP_COMM_HANDLER(target) EP_COMM_DECLARE_HANDLER(target)
#include "handlers.def"
#undef EP_COMM_HANDLER

// The kernels on malformed indices outside XLA: wrong values, or -1 (selftest.cu, built when
// CMake's EP_COMM_SELFTESTS is on).
int64_t selftest();

}  // namespace ep_comm::rows
