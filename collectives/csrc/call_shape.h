// What both transports' handlers read off their buffers before anything moves, with one set of
// messages for calls that cannot proceed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace ep_comm {

struct CallShape {
  int m = 0;                 // segments per peer
  int64_t segments = 0;      // K = n * m
  int64_t row_bytes = 0;     // bytes of one row (every dimension but the first)
  int64_t operand_rows = 0;
  int64_t output_rows = 0;
};

inline int64_t rows_of(const xla::ffi::AnyBuffer& b) {
  return b.dimensions().size() ? b.dimensions()[0] : 0;
}

inline int64_t row_bytes_of(const xla::ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  int64_t elems = 1;
  for (size_t i = 1; i < dims.size(); ++i) elems *= dims[i];
  return elems * static_cast<int64_t>(xla::ffi::ByteWidth(b.element_type()));
}

// Fill `shape` for a call over a group of n ranks; returns "" or why the call cannot proceed.
inline std::string read_call_shape(const xla::ffi::AnyBuffer& operand,
                                   const xla::ffi::AnyBuffer& output, int64_t segments, int n,
                                   CallShape* shape) {
  if (segments % n != 0) {
    return std::to_string(segments) + " segments is not a multiple of the group size " +
           std::to_string(n);
  }
  shape->m = static_cast<int>(segments / n);
  shape->segments = segments;
  shape->row_bytes = row_bytes_of(operand);
  shape->operand_rows = rows_of(operand);
  shape->output_rows = rows_of(output);
  return "";
}

inline std::string broken_message(const std::string& why) {
  return "the communicator is unusable after an earlier failure (" + why +
         "); restart the processes";
}

// How every message of a call names it: "ep_comm <label> (<transport>) on rank r of n".
inline std::string call_site(std::string_view label, const std::string& transport, int rank,
                             int size) {
  return "ep_comm " + std::string(label) + " (" + transport + ") on rank " +
         std::to_string(rank) + " of " + std::to_string(size);
}

// Every handler's first step once it holds its communicator: refuse a broken one, then read the
// call's shape (`segments` index entries over a group of n ranks).
inline xla::ffi::Error begin_call(const std::string& where, const std::string& broken,
                                  const xla::ffi::AnyBuffer& operand,
                                  const xla::ffi::AnyBuffer& output, int64_t segments, int n,
                                  CallShape* shape) {
  if (!broken.empty()) return xla::ffi::Error::Internal(where + ": " + broken_message(broken));
  std::string bad = read_call_shape(operand, output, segments, n, shape);
  if (!bad.empty()) return xla::ffi::Error::InvalidArgument(where + ": " + bad);
  return xla::ffi::Error::Success();
}

}  // namespace ep_comm
