"""The row kernels of dispatch and combine: the gathers that move token rows by index.

Each primitive here is lowered to a CUDA kernel (``collectives/csrc/row_kernels/``, module
``_ep_rows``) on GPUs where it is built, and to XLA everywhere else (:func:`primitive` defines
that choice once). Each has an XLA *reference* lowering, the definition the kernels equal
(``tests/test_row_kernels.py`` checks it on the GPU, bitwise for the gathers, scatters and the
counting sort, to float32 reassociation for :func:`gather_sum`), and most a *fast* XLA lowering,
the production path on TPUs and CPUs (sorts, whole-row gathers in clip mode, no scatter of rows
and no select over an output; equal to the reference the same way, checked on every platform).

- :func:`gather`: ``out[i] = table[idx[i]]``, rows of any dtype (FP8 rows as bytes too). A row
  with a negative index is zero; a row with an index ``>= len(table)`` is *unspecified*: the kernel
  does not write it (no memset of a worst-case buffer), and the XLA reference poisons it (NaN, or
  all bits set for integers), so that a test on any platform sees a consumer that reads such
  rows.
- :func:`gather_sum`: ``out[m] = sum_k w[m, k] * table[idx[m, k]]`` accumulated in float32 in
  ``k`` order, slots whose index is outside the table skipped (they add exactly nothing, even where
  the table holds NaN), written once in the requested dtype.
- :func:`scatter`: ``out[pos[n, k]] = table[n]``, each table row read once and written to its
  destinations (dispatch's expand), chosen rows zeroed, the others unspecified as :func:`gather`'s.
- :func:`rank_by_key`: a stable counting sort of integer keys (dispatch's expert-major layout),
  :func:`key_counts` and :func:`key_ranks` its two kernels.
- :func:`scatter_dequant`: :func:`scatter` of FP8 wire rows, each dequantized once on the way
  (dispatch's receive side with ``EPConfig(wire_format=...)``; :func:`quantize_blocks` and
  :func:`dequantize_blocks` are the FP8 formats' math, in XLA);
  :func:`scatter_fake_quant` the same values straight from unquantized rows (one rank: no wire),
  :func:`scatter_quant` the same rows kept as FP8 bytes.
- :func:`expert_layout`: dispatch's receive-side layout (the counting sort of the received
  (row, expert) pairs and every index expand and the handle need) as one op: three kernels.

And :func:`empty`: a buffer for an exchange to receive into, left uninitialised on GPUs (no
memset of a worst-case receive buffer), poisoned by the XLA lowering elsewhere.

``EP_COMM_ROW_KERNELS=0`` (read when a program is traced) or :func:`xla_only` use the fast XLA
lowerings on GPUs too, for A/B comparisons; ``EP_COMM_ROW_KERNELS=reference`` or
:func:`reference_only` the reference lowerings everywhere. ``gather`` and ``gather_sum`` are
linear in the table (and ``gather_sum`` in the weights) with jvp and transpose rules
(scatter-adds: ``ep_comm.rows`` gives dispatch and combine custom VJPs that avoid them);
``scatter_dequant`` moves bytes (no gradient); every one with operands batches through the XLA
lowering its ``kernel`` parameter picks.
"""


from __future__ import annotations

from ep_comm.collectives.row_kernels.primitive import (LOWERINGS, reference_only,
                                                       unavailable_reason, xla_only)
from ep_comm.collectives.row_kernels.moves import empty, gather, gather_sum, scatter
from ep_comm.collectives.row_kernels.layouts import (MAX_RANK_KEYS, RANK_CHUNK, ExpertLayout,
                                                     TokenRoutes, expert_layout, key_counts,
                                                     key_ranks, local_layout, local_layout_fits,
                                                     rank_by_key, sort_by_key, token_routes)
from ep_comm.collectives.row_kernels.fp8 import (E4M3_MAX, dequantize_blocks, e8m0_scales,
                                                 fp8_from_bytes, fp8_rows, quantize_blocks,
                                                 scale_bytes, scatter_dequant, scatter_fake_quant,
                                                 scatter_quant, split_fp8_rows)
