// What both transports' handlers read off their buffers before anything moves, with one set of
// messages for calls that cannot proceed.
#pragma once

#include <cstdint>
#include <string>

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

}  // namespace ep_comm
