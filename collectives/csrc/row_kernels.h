// Host-side interface of the row kernels (row_kernels.cu), used by the Python bindings.
#pragma once

#include <cstdint>

namespace ep_comm::rows {

void* gather_handler();      // XLA FFI handler ep_comm_rows_gather
void* gather_sum_handler();  // XLA FFI handler ep_comm_rows_gather_sum
void* empty_handler();       // XLA FFI handler ep_comm_rows_empty
void* scatter_dequant_handler();  // XLA FFI handler ep_comm_rows_scatter_dequant
void* scatter_handler();     // XLA FFI handler ep_comm_rows_scatter
void* key_count_handler();   // XLA FFI handler ep_comm_rows_key_count
void* key_rank_handler();    // XLA FFI handler ep_comm_rows_key_rank
void* expert_layout_handler();  // XLA FFI handler ep_comm_rows_expert_layout
void* scatter_fake_quant_handler();  // XLA FFI handler ep_comm_rows_scatter_fake_quant
void* scatter_quant_handler();  // XLA FFI handler ep_comm_rows_scatter_quant
void* token_routes_handler();  // XLA FFI handler ep_comm_rows_token_routes
void* local_layout_handler();  // XLA FFI handler ep_comm_rows_local_layout
int64_t selftest();          // the kernels on malformed indices outside XLA: wrong values, or -1

}  // namespace ep_comm::rows
