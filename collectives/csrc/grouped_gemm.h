// ep_comm's grouped GEMM for the experts on Hopper (sm_90a), built on CUTLASS 3.x: pointer-array
// grouped problems on the warp-specialized TMA + GMMA kernels, the group sizes read on the device
// (no host synchronization), as XLA FFI handlers. See grouped_gemm.cu for the passes and layouts.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ep_comm::gemm {

void* grouped_gemm_handler();  // XLA FFI handler ep_comm_grouped_gemm

// Bytes of the workspace result one call of `pass` (0 forward, 1 dlhs, 2 drhs) with tile config
// `config` over `groups` groups needs (the group arguments and CUTLASS's own; queries the GPU's
// SM count).
size_t workspace_bytes(int64_t pass, int64_t config, int64_t groups);

// Runs each pass on small malformed and well-formed problems outside XLA (for
// compute-sanitizer); returns the number of wrong output values, -1 when CUDA fails, -2 when this
// GPU (or none) is not a Hopper.
long long selftest();

// XLA FFI handler ep_comm_grouped_gemm_fused: the forward pass with A's rows gathered by index
// and the SwiGLU or per-row scale epilogue (grouped_gemm_gather.cu).
void* fused_handler();

// XLA FFI handler ep_comm_grouped_gemm_drhs_gather: the weight gradient with x's rows gathered
// by index (grouped_gemm_gather.cu).
void* drhs_gather_handler();

// XLA FFI handler ep_comm_grouped_gemm_dswiglu: the down projection's dlhs with SwiGLU's
// derivative and the router weights' partial gradients in its epilogue.
void* dswiglu_handler();

// The fused forward pass, the dSwiGLU dlhs and the gathered weight gradient on small problems with malformed sizes and indices, each epilogue and
// tile config, outside XLA: wrong values, -1 when CUDA fails, -2 without a Hopper GPU.
long long fused_selftest();

}  // namespace ep_comm::gemm
