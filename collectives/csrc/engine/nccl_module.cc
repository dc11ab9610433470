// Python bindings of the NCCL engine (nanobind): handlers as capsules, communicator bootstrap.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "nccl_engine.h"

namespace nb = nanobind;
namespace en = ep_comm::nccl;

NB_MODULE(_ep_nccl, m) {
  m.doc() = "ep_comm NCCL transport: XLA FFI handlers (start/done) and communicator registry";
  m.def(
      "handlers",
      []() {
        using namespace ep_comm::nccl;
        nb::dict table;
#define EP_COMM_HANDLER(target) EP_COMM_HANDLER_ENTRY(table, target)
#include "nccl_handlers.def"
#undef EP_COMM_HANDLER
        return table;
      },
      "{XLA FFI target name: handler capsule} of the NCCL transport.");
  m.def("unique_id", []() {
    std::string id = en::unique_id();
    return nb::bytes(id.data(), id.size());
  });
  m.def(
      "init",
      [](int64_t key, const std::vector<std::tuple<int, int, int, nb::bytes>>& members) {
        std::vector<en::Member> ms;
        for (const auto& [ordinal, rank, size, id] : members) {
          ms.push_back({ordinal, rank, size, std::string(id.c_str(), id.size())});
        }
        nb::gil_scoped_release release;  // ncclCommInitRank waits for the other ranks
        en::init(key, ms);
      },
      nb::arg("key"), nb::arg("members"),
      "Create the communicator `key` for local members [(cuda ordinal, rank, size, unique id)].");
  m.def("has", &en::has);
  m.def("status", &en::status);
  m.def("finalize", []() {
    nb::gil_scoped_release release;
    en::finalize();
  });
  m.def("built_version", &en::built_version);
  m.def("runtime_version", &en::runtime_version);
}
