// The dlhs pass's CUTLASS kernels (bfloat16 and float16, every tile config): impl.cuh.
#include "impl.cuh"

namespace ep_comm::gemm::detail {
EP_COMM_GEMM_INSTANCES(, kDlhs)
}  // namespace ep_comm::gemm::detail
