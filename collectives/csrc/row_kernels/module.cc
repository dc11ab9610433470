// Python bindings of the row kernels (nanobind): the FFI handlers as capsules (handlers.def).
#include <nanobind/nanobind.h>

#include "row_kernels.h"

namespace nb = nanobind;

NB_MODULE(_ep_rows, m) {
  m.doc() = "ep_comm row kernels: the gathers of dispatch and combine as XLA FFI handlers (CUDA)";
  m.def(
      "handlers",
      []() {
        using namespace ep_comm::rows;
        nb::dict table;
#define EP_COMM_HANDLER(target) EP_COMM_HANDLER_ENTRY(table, target)
#include "handlers.def"
#undef EP_COMM_HANDLER
        return table;
      },
      "{XLA FFI target name: handler capsule} for every row kernel.");
#ifdef EP_COMM_SELFTESTS
  m.def("selftest", &ep_comm::rows::selftest,
        "Run the kernels on malformed indices outside XLA (for compute-sanitizer); returns the "
        "number of wrong output values, or -1 when CUDA fails.");
#endif
}
