// Python bindings of the row kernels (nanobind): the FFI handlers as capsules.
#include <nanobind/nanobind.h>

#include "row_kernels.h"

namespace nb = nanobind;

NB_MODULE(_ep_rows, m) {
  m.doc() = "ep_comm row kernels: the gathers of dispatch and combine as XLA FFI handlers (CUDA)";
  m.def("gather_handler", []() { return nb::capsule(ep_comm::rows::gather_handler()); });
  m.def("gather_sum_handler", []() { return nb::capsule(ep_comm::rows::gather_sum_handler()); });
  m.def("empty_handler", []() { return nb::capsule(ep_comm::rows::empty_handler()); });
  m.def("scatter_dequant_handler",
        []() { return nb::capsule(ep_comm::rows::scatter_dequant_handler()); });
  m.def("scatter_handler", []() { return nb::capsule(ep_comm::rows::scatter_handler()); });
  m.def("key_count_handler", []() { return nb::capsule(ep_comm::rows::key_count_handler()); });
  m.def("key_rank_handler", []() { return nb::capsule(ep_comm::rows::key_rank_handler()); });
  m.def("expert_layout_handler",
        []() { return nb::capsule(ep_comm::rows::expert_layout_handler()); });
  m.def("scatter_fake_quant_handler",
        []() { return nb::capsule(ep_comm::rows::scatter_fake_quant_handler()); });
  m.def("scatter_quant_handler",
        []() { return nb::capsule(ep_comm::rows::scatter_quant_handler()); });
  m.def("token_routes_handler",
        []() { return nb::capsule(ep_comm::rows::token_routes_handler()); });
  m.def("local_layout_handler",
        []() { return nb::capsule(ep_comm::rows::local_layout_handler()); });
  m.def("selftest", &ep_comm::rows::selftest,
        "Run the kernels on malformed indices outside XLA (for compute-sanitizer); returns the "
        "number of wrong output values, or -1 when CUDA fails.");
}
