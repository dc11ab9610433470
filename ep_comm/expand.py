"""Dispatch's last step on the receiver: received token rows into ``expert_x``, one row per
(token, local expert) pair, grouped contiguously per local expert."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ep_comm.collectives import row_kernels
from ep_comm import wire
from ep_comm.config import EPConfig
from ep_comm.layout import repeats_earlier
from ep_comm.routes import Route


# Rows of expert_x right after the groups that are always zero: grouped GEMM kernels whose row
# tiles run past the last group read them (tokamax's weight-gradient kernel masks such rows by
# multiplying with zero, so they must be finite); at most one tile of rows.
ZERO_TAIL_ROWS = 256


def expert_rows_read(recv_pos, C):
    """``(R, K)``: the rows of ``expert_x`` each receive-buffer row fills, each once (a slot
    repeating an earlier slot's expert, which points at the same row, and dropped slots: ``C``)."""
    return jnp.where(repeats_earlier(recv_pos), C, recv_pos)


@dataclasses.dataclass(frozen=True)
class Expanded:
    """``expert_x`` ``(C, H)`` and the handle fields that describe it (see ``EPHandle``):
    ``group_sizes`` ``(L,)``, ``recv_pos`` and ``recv_weights`` ``(R, K)`` per row of the receive
    buffer, ``expert_token`` ``(C,)``; ``num_grouped``: ``sum(group_sizes)``; ``sources``
    ``(C,)``: the receive-buffer row each row of ``expert_x`` holds (negative: a zero row or past
    them), so that ``expert_x`` is ``rows`` gathered by it (``expert_x`` is None where the caller
    gathers the rows itself: :func:`ep_comm.fused` reads them in its GEMM's prologue)."""

    expert_x: jax.Array
    group_sizes: jax.Array
    recv_pos: jax.Array
    recv_weights: jax.Array
    expert_token: jax.Array
    num_grouped: jax.Array
    sources: jax.Array
    rows: jax.Array


def expand(cfg: EPConfig, route: Route, num_recv, me, dequantize_to=None,
           split_at=None, round_trip=False, layout=None, materialize=True) -> Expanded:
    """Rows of ``route``'s receive buffer (the first ``num_recv`` in the flat order are used) into
    ``expert_x``: rows ordered by local expert, then (source rank, source token, k); the rows past
    ``sum(group_sizes)``: the first :data:`ZERO_TAIL_ROWS` zero, the others unspecified (zero with
    ``cfg.zero_fill``). ``dequantize_to=(hidden, dtype)``: the buffer holds FP8 wire rows
    (``cfg.wire_format``) and ``expert_x`` their dequantized values, gathered and dequantized in
    one pass; ``split_at=hidden``: the buffer holds FP8 wire rows and ``expert_x`` is their
    ``(values, scales)`` bytes, each written apart; ``round_trip``: the buffer holds unquantized
    rows (one rank, no wire) and ``expert_x`` what the FP8 wire would deliver (its values, or
    with ``split_at`` its bytes), quantized on the way in one pass. Pairs past
    ``cfg.expert_rows`` are dropped (counted by dispatch). ``layout``: the buffer's
    :class:`~ep_comm.collectives.row_kernels.ExpertLayout` when the caller has it already (one rank:
    ``row_kernels.local_layout``). ``materialize=False``: ``expert_x`` is not written (None; an
    unquantized buffer only), the caller gathers ``rows`` by ``sources``."""
    R, C, L = cfg.recv_token_rows, cfg.expert_rows, cfg.experts_per_rank
    buf_x, buf_route, flat_to_buf = route.x, route.route, route.flat_to_buf
    # routing in the flat order (source rank, source token); flat_to_buf: the receive-buffer row
    # holding each flat-order row (None: the same row)
    row_route = buf_route if flat_to_buf is None else jnp.take(
        buf_route, jnp.minimum(flat_to_buf, R - 1), axis=0)
    # groups contiguous per local expert (stable: source rank, token, k); a token that lists one
    # expert twice gets one row, both slots point at it (weights add up in combine)
    lay = layout if layout is not None else row_kernels.expert_layout(
        row_route, num_recv, me, experts=L, rows=C, fill_rows=ZERO_TAIL_ROWS,
        zero_fill=cfg.zero_fill)
    recv_pos, recv_w, targets = lay.recv_pos, lay.recv_weights, lay.targets
    if flat_to_buf is not None:  # combine reads the receive buffer in its own (stage-2) order
        buf_rows = jnp.where(jnp.arange(R) < num_recv, flat_to_buf, R)
        at = lambda a, v: jnp.full(a.shape, v, a.dtype).at[buf_rows].set(a, mode="drop")  # noqa: E731
        recv_pos, recv_w, targets = at(recv_pos, C), at(recv_w, 0.0), at(targets, C)
    # each received row read once and written to its expert rows (targets: each once); rows past
    # the groups: zero (config.zero_fill, or the first ZERO_TAIL_ROWS of them), else unspecified;
    # the transpose (dispatch's backward) gathers each row's expert rows
    fill = lay.fill
    # the inverse of the placement, which the layout's sort gives: the receive-buffer row of
    # each expert row, -1 for the zero rows, -2 past them (the XLA lowering off CUDA gathers
    # rows by it instead of scattering them)
    q = jnp.arange(C, dtype=jnp.int32)
    filled = jnp.minimum(lay.num_pairs, C)
    token = lay.expert_token if flat_to_buf is None else jnp.take(
        flat_to_buf, jnp.minimum(lay.expert_token, R - 1))
    sources = jnp.where(q < filled, token, jnp.where(q < filled + fill.shape[0], -1, -2))
    if cfg.wire_format is not None:
        block, mx = wire.BLOCK[cfg.wire_format], cfg.wire_format == "mxfp8"
    if not materialize:
        if cfg.wire_format is not None:
            raise ValueError("expand: materialize=False takes unquantized rows (wire_format None)")
        expert_x = None
    elif round_trip:  # no wire: each row quantized in registers, written as codes and scales or
        # dequantized
        quantizing = row_kernels.scatter_quant if split_at else row_kernels.scatter_fake_quant
        expert_x = quantizing(buf_x, targets, fill, C, block=block, mx=mx)
    elif dequantize_to is not None:  # FP8 rows: each dequantized once, on the way
        hidden, dtype = dequantize_to
        expert_x = row_kernels.scatter_dequant(buf_x, targets, fill, C, hidden=hidden,
                                               block=block, mx=mx, dtype=dtype)
    elif split_at is not None:  # FP8 rows kept: their values and scales bytes, apart
        end = split_at + row_kernels.scale_bytes(split_at, block, mx)
        expert_x = tuple(row_kernels.scatter(buf_x, targets, fill, C, columns=c,
                                             sources=sources)
                         for c in ((0, split_at), (split_at, end)))
    else:
        expert_x = row_kernels.scatter(buf_x, targets, fill, C, sources=sources)

    return Expanded(expert_x, lay.group_sizes, recv_pos, recv_w, lay.expert_token, filled,
                    sources, buf_x)
