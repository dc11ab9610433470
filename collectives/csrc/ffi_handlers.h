// The handler tables. Each native module lists its XLA FFI handlers once, in its component's
// handlers.def, as EP_COMM_HANDLER(target) lines; `target` is both the name XLA calls and the C
// symbol that XLA_FFI_DEFINE_HANDLER_SYMBOL(target, ...) defines. Three readers expand the list:
//   the component's header declares every handler:
//     #define EP_COMM_HANDLER(target) EP_COMM_DECLARE_HANDLER(target)
//     #include "handlers.def"
//   the nanobind module's handlers() returns {target: capsule} (EP_COMM_HANDLER_ENTRY);
//   collectives/bootstrap.py registers whatever handlers() returns.
// A handler listed but not defined fails the link; one defined but not listed is never
// registered, which the tests of its op catch.
#pragma once

#include "xla/ffi/api/c_api.h"

#define EP_COMM_DECLARE_HANDLER(target) \
  extern "C" XLA_FFI_Error* target(XLA_FFI_CallFrame* call_frame);

// {target: capsule of the handler} into the nanobind dict `table`
#define EP_COMM_HANDLER_ENTRY(table, target) \
  table[#target] = nanobind::capsule(reinterpret_cast<void*>(&target));
