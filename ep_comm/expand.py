"""Dispatch's last step on the receiver: received token rows into ``expert_x``, one row per
(token, local expert) pair, grouped contiguously per local expert."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from collectives import row_kernels
from ep_comm import wire
from ep_comm.config import EPConfig
from ep_comm.layout import repeats_earlier
from ep_comm.routes import Route, exclusive_cumsum


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
    buffer, ``expert_token`` ``(C,)``."""

    expert_x: jax.Array
    group_sizes: jax.Array
    recv_pos: jax.Array
    recv_weights: jax.Array
    expert_token: jax.Array


def expand(cfg: EPConfig, route: Route, num_recv, me, dequantize_to=None,
           split_at=None) -> Expanded:
    """Rows of ``route``'s receive buffer (the first ``num_recv`` in the flat order are used) into
    ``expert_x``: rows ordered by local expert, then (source rank, source token, k); the rows past
    ``sum(group_sizes)``: the first :data:`ZERO_TAIL_ROWS` zero, the others unspecified (zero with
    ``cfg.zero_fill``). ``dequantize_to=(hidden, dtype)``: the buffer holds FP8 wire rows
    (``cfg.wire_format``) and ``expert_x`` their dequantized values, gathered and dequantized in
    one pass; ``split_at=hidden``: the buffer holds FP8 wire rows and ``expert_x`` is their
    ``(values, scales)`` bytes, each written apart. Pairs past ``cfg.expert_rows`` are dropped
    (counted by dispatch)."""
    R, C, K, L = cfg.recv_token_rows, cfg.expert_rows, cfg.topk, cfg.experts_per_rank
    i32 = jnp.int32
    buf_x, buf_route, flat_to_buf = route.x, route.route, route.flat_to_buf
    # received rows in the flat order (source rank, source token), routing masked to this rank
    received = jnp.arange(R, dtype=i32) < num_recv
    # flat_to_buf: row of the receive buffer holding each flat-order row (None: the same row)
    row_route = buf_route if flat_to_buf is None else jnp.take(
        buf_route, jnp.minimum(flat_to_buf, R - 1), axis=0)
    gid = jnp.where(received[:, None], row_route[:, K:], -1.0).astype(i32)
    here = (gid >= 0) & (gid // L == me)
    recv_w = jnp.where(here, row_route[:, :K], 0.0)
    recv_ids = jnp.where(here, gid % L, -1)

    # groups contiguous per local expert (stable: source rank, token, k). A token that lists one
    # expert twice gets one row; both slots point at it (weights add up in combine).
    has_expert = recv_ids >= 0
    # first slot of each (row, k)'s expert in its row; a slot that is not its own first repeats it
    first_slot = jnp.argmax(recv_ids[:, :, None] == recv_ids[:, None, :], axis=2)  # (R, K)
    repeat = first_slot != jnp.arange(K)[None, :]
    key = jnp.where(has_expert & ~repeat, recv_ids, L).reshape(-1)  # (R*K,)
    # a counting sort (histogram and scans; no radix sort): inverse[i] is pair i's position
    inverse, order, per_key = row_kernels.rank_by_key(key, L + 1)
    per_expert = per_key[:L]
    num_pairs = jnp.sum(per_expert)
    group_sizes = jnp.clip(C - exclusive_cumsum(per_expert), 0, per_expert)
    pos_first = jnp.where((key < L) & (inverse < C), inverse, C).reshape(R, K)
    recv_pos = jnp.where(has_expert, jnp.take_along_axis(pos_first, first_slot, axis=1), C)
    q = jnp.arange(C, dtype=i32)
    used = q < jnp.minimum(num_pairs, C)
    expert_token = jnp.where(used, order[jnp.minimum(q, R * K - 1)] // K, R)
    if flat_to_buf is not None:  # combine reads the receive buffer in its own (stage-2) order
        buf_rows = jnp.where(received, flat_to_buf, R)
        recv_pos = jnp.full((R, K), C, i32).at[buf_rows].set(recv_pos, mode="drop")
        recv_w = jnp.zeros((R, K), jnp.float32).at[buf_rows].set(recv_w, mode="drop")
    # rows past the groups: zero (config.zero_fill, or the first ZERO_TAIL_ROWS of them), else
    # unspecified
    filled = jnp.minimum(num_pairs, C)
    # each received row read once and written to its expert rows; the transpose (dispatch's
    # backward) gathers each row's expert rows
    fill = (jnp.where(q >= filled, q, -1) if cfg.zero_fill
            else filled + jnp.arange(min(ZERO_TAIL_ROWS, C), dtype=i32))
    targets = expert_rows_read(recv_pos, C)
    if cfg.wire_format is not None:
        block, mx = wire.BLOCK[cfg.wire_format], cfg.wire_format == "mxfp8"
    if dequantize_to is not None:  # FP8 rows: each dequantized once, on the way
        hidden, dtype = dequantize_to
        expert_x = row_kernels.scatter_dequant(buf_x, targets, fill, C, hidden=hidden,
                                               block=block, mx=mx, dtype=dtype)
    elif split_at is not None:  # FP8 rows kept: their values and scales bytes, apart
        end = split_at + row_kernels.scale_bytes(split_at, block, mx)
        expert_x = tuple(row_kernels.scatter(buf_x, targets, fill, C, columns=c)
                         for c in ((0, split_at), (split_at, end)))
    else:
        expert_x = row_kernels.scatter(buf_x, targets, fill, C)

    return Expanded(expert_x, group_sizes, recv_pos, recv_w, expert_token)
