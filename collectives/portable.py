"""Portable ragged all-to-all transport built from XLA collectives every platform has.

XLA:CPU has no ``ragged-all-to-all``. This transport carries the same semantics with a fixed-size
``lax.all_to_all`` of per-segment slots:

1. pack: every send segment ``i`` (``operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]``)
   is gathered into slot ``i`` of a ``(K, S, ...)`` buffer, rows past ``send_sizes[i]`` zeroed;
2. exchange: one tiled ``lax.all_to_all`` moves slot block ``j`` to peer ``j`` (``K = n * m``, ``m``
   segments per peer); a second, tiny one moves ``output_offsets`` so that the receiver learns where
   each incoming segment lands (offsets are given in the receiver's frame by the sender);
3. unpack: every output row looks up the segment that covers it (``searchsorted`` over the segment
   starts) and takes its row from the received slots; rows no segment covers keep ``output``.

The slot size is ``S = min(operand rows, output rows)``: no segment can be longer without reading past
the operand or writing past the receiver's output, so nothing a well-formed call sends is lost
(callers that know a tighter static bound pass ``max_segment_rows``). The price is padding: every
call moves ``K * S`` rows per rank whatever the real sizes are.
:func:`wire_rows` reports that number so benchmarks can state the overhead.

Everything is plain ``lax`` (gathers, selects, ``all_to_all``), so ``jit``, ``grad`` (both operands),
``jvp`` and ``vmap`` work through the transport without custom rules, and the data movement is exact:
results are bit-identical to XLA's native op on well-formed inputs. As with ``lax.ragged_all_to_all``,
overlapping output segments are undefined behaviour (here: the segment with the larger offset wins).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ep_comm.collectives import barrier


def slot_rows(operand_rows: int, output_rows: int, max_segment_rows: int | None = None) -> int:
    """Rows per segment slot of the padded exchange."""
    rows = min(operand_rows, output_rows)
    return rows if max_segment_rows is None else min(rows, max_segment_rows)


def wire_rows(operand_rows: int, output_rows: int, num_segments: int,
              max_segment_rows: int | None = None) -> int:
    """Rows each rank puts on the wire for one call (the padded volume, sent and received alike)."""
    return num_segments * slot_rows(operand_rows, output_rows, max_segment_rows)


def _broadcast_rows(mask, like):
    """Broadcast a per-row boolean of shape ``(R,)``/``(A, R)`` against ``like``'s trailing dims."""
    return lax.broadcast_in_dim(mask, like.shape, tuple(range(mask.ndim)))


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups=None, max_segment_rows=None,
                      label=None, tag=None):
    """``lax.ragged_all_to_all`` semantics over ``lax.all_to_all``; arguments already validated.

    ``max_segment_rows``: a static bound on every segment's size that the caller guarantees (e.g.
    dispatch: a rank sends each token at most once to a peer, so at most ``T`` rows); it shrinks
    the slots and so the padding. Rows of a segment past the bound are not sent. ``label`` names
    the operation at the barrier in front of the exchange between CPU processes
    (:mod:`ep_comm.collectives.barrier`); ``tag`` (native-engine diagnostics) is accepted for a uniform
    signature and unused.
    """
    del tag
    num_segments = input_offsets.shape[0]
    n_rows_in, n_rows_out = operand.shape[0], output.shape[0]
    slot = slot_rows(n_rows_in, n_rows_out, max_segment_rows)
    if slot == 0:
        return output
    i32 = jnp.int32
    input_offsets = input_offsets.astype(i32)
    send_sizes = send_sizes.astype(i32)
    output_offsets = output_offsets.astype(i32)
    recv_sizes = recv_sizes.astype(i32)

    # 1. pack every segment into its own slot of `slot` rows.
    r = jnp.arange(slot, dtype=i32)
    src_row = input_offsets[:, None] + r[None, :]
    valid = (r[None, :] < send_sizes[:, None]) & (src_row >= 0) & (src_row < n_rows_in)
    packed = jnp.take(operand, jnp.clip(src_row, 0, n_rows_in - 1).reshape(-1), axis=0)
    packed = packed.reshape(num_segments, slot, *operand.shape[1:])
    packed = jnp.where(_broadcast_rows(valid, packed), packed, jnp.zeros((), packed.dtype))

    # 2. exchange slots and the receiver-frame offsets (between CPU processes, once every process
    # arrived: XLA's collectives there wait forever for a peer that never comes).
    exchange = lambda *a: tuple(lax.all_to_all(v, axis_name, 0, 0, tiled=True,  # noqa: E731
                                               axis_index_groups=axis_index_groups) for v in a)
    received, recv_offsets = barrier.guard(label or "ragged_all_to_all", axis_name, exchange,
                                           packed, output_offsets)

    # 3. unpack: find, for every output row, the (last-starting) non-empty segment covering it.
    big = jnp.iinfo(i32).max
    starts = jnp.where(recv_sizes > 0, recv_offsets, big)
    order = jnp.argsort(starts, stable=True).astype(i32)
    sorted_starts = starts[order]
    p = jnp.arange(n_rows_out, dtype=i32)
    pos = jnp.searchsorted(sorted_starts, p, side="right").astype(i32) - 1
    seg = order[jnp.clip(pos, 0, num_segments - 1)]
    within = p - recv_offsets[seg]
    covered = (pos >= 0) & (within >= 0) & (within < recv_sizes[seg]) & (within < slot)
    flat = received.reshape(num_segments * slot, *operand.shape[1:])
    src = jnp.where(covered, seg * slot + within, 0)
    taken = jnp.take(flat, src, axis=0)
    return jnp.where(_broadcast_rows(covered, taken), taken, output)
