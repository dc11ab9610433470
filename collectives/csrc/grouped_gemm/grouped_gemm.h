// ep_comm's grouped GEMM for the experts on Hopper (sm_90a), built on CUTLASS 3.x: pointer-array
// grouped problems on the warp-specialized TMA + GMMA kernels, the group sizes read on the device
// (no host synchronization), as XLA FFI handlers (handlers.def). See passes.cu for the passes and
// layouts, gather.cu for the fused forward and backward kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi_handlers.h"

namespace ep_comm::gemm {

#define EP_COMM_HANDLER(target) EP_COMM_DECLARE_HANDLER(target)
#include "handlers.def"
#undef EP_COMM_HANDLER

// Bytes of the workspace result one call of `pass` (0 forward, 1 dlhs, 2 drhs) with tile config
// `config` over `groups` groups needs (the group arguments and CUTLASS's own; queries the GPU's
// SM count).
size_t workspace_bytes(int64_t pass, int64_t config, int64_t groups);

// The selftests, compiled when CMake's EP_COMM_SELFTESTS is on (for compute-sanitizer): wrong
// output values, -1 when CUDA fails, -2 when this GPU (or none) is not a Hopper.
// Each pass on small malformed and well-formed problems outside XLA (passes.cu).
long long selftest();
// The fused forward pass, the dSwiGLU dlhs and the gathered weight gradient on small problems
// with malformed sizes and indices, each epilogue and tile config (gather.cu).
long long fused_selftest();

}  // namespace ep_comm::gemm
