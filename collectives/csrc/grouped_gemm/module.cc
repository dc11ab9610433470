// Python bindings of the grouped GEMM (nanobind): the FFI handlers as capsules (handlers.def).
#include <nanobind/nanobind.h>

#include "grouped_gemm.h"

namespace nb = nanobind;

NB_MODULE(_ep_gemm, m) {
  m.doc() = "ep_comm grouped GEMM for the experts on Hopper (CUTLASS, sm_90a) as XLA FFI handlers";
  m.def(
      "handlers",
      []() {
        using namespace ep_comm::gemm;
        nb::dict table;
#define EP_COMM_HANDLER(target) EP_COMM_HANDLER_ENTRY(table, target)
#include "handlers.def"
#undef EP_COMM_HANDLER
        return table;
      },
      "{XLA FFI target name: handler capsule} for every pass.");
  m.def("workspace_bytes", &ep_comm::gemm::workspace_bytes, nb::arg("pass_index"),
        nb::arg("config"), nb::arg("groups"),
        "Bytes of the workspace result one call needs (queries the GPU's SM count).");
#ifdef EP_COMM_SELFTESTS
  m.def("selftest", &ep_comm::gemm::selftest,
        "Run the three passes on malformed and well-formed group sizes outside XLA (for "
        "compute-sanitizer); returns the number of wrong output values, -1 when CUDA fails, -2 "
        "when there is no Hopper GPU here.");
  m.def("fused_selftest", &ep_comm::gemm::fused_selftest,
        "Run the fused forward pass (gather, each epilogue) on malformed and well-formed sizes and "
        "indices outside XLA; returns wrong values, -1 when CUDA fails, -2 without a Hopper GPU.");
#endif
}
