"""Dropless MoE ``dispatch`` / ``combine`` over an expert-parallel mesh axis.

Both run inside ``jax.shard_map`` over ``config.axis_name``; every array below is one rank's block.

dispatch (per rank, ``T`` tokens, ``n`` ranks, ``E_local`` experts per rank):
  1. layout: which ranks each token goes to (a token goes **once per destination rank**, however
     many of that rank's experts it chose);
  2. counts: one ``all_gather`` of the per-destination token and pair counts gives every rank the
     full ``n x n`` traffic matrix, from which all offsets are derived identically on every rank;
  3. exchange: three ragged all-to-alls (token rows, their local expert ids, their weights) into a
     token receive buffer ordered by (source rank, source token);
  4. expand: the receiver copies each received token once per chosen local expert into
     ``expert_x``, grouped contiguously by local expert (ordered by source rank, token, k inside
     a group), so ``handle.group_sizes`` feeds ``jax.lax.ragged_dot`` or a grouped GEMM directly.

combine: every rank sums the outputs of its local experts for each received token weighted by the
router weights (float32), sends **one partial sum per (token, rank)** back with the reverse ragged
exchange, and the source sums the partials of a token's ranks in float32, in a fixed order.

Everything is static-shaped and deterministic, differentiable end to end (``x``, ``expert_y`` and
``topk_weights`` get gradients) and jit-able.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from ep_comm._compat import axis_size, is_tracer
from ep_comm.config import EPConfig
from ep_comm.layout import check_topk_ids, layout_and_routes, repeats_earlier
from ep_comm.ragged import _ragged_all_to_all


class EPOverflowError(RuntimeError):
    """(token, expert) pairs were dropped (a user-set ``recv_capacity`` overflowed) or expert ids
    were out of range."""


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPHandle:
    """What dispatch learned, consumed by :func:`combine`. One rank's view inside ``shard_map``.

    Shapes use ``T = tokens_per_rank``, ``K = topk``, ``n = num_ranks``, ``S = config.send_rows``,
    ``R = config.recv_token_rows``, ``C = config.expert_rows`` and ``L = experts_per_rank``. Every
    leaf has a leading axis, so ``out_specs=P(axis_name)`` returns a whole handle from
    ``shard_map`` (per-rank values stacked).

    Attributes:
      config: the static :class:`EPConfig`.
      group_sizes: ``(L,)`` int32; rows of ``expert_x`` per local expert, in order, contiguous
        from row 0. Rows past ``sum(group_sizes)`` are zero and ignored by combine.
      num_recv_tokens: ``(1,)`` int32; tokens received (rows of the token receive buffer used).
      num_dropped: ``(1,)`` int32; (token, expert) pairs destined to this rank that did not fit
        ``recv_capacity``. Always 0 with the default (worst-case) capacity.
      num_invalid: ``(1,)`` int32; expert ids of this rank's tokens outside ``[-1, num_experts)``
        (not routed).
      traffic: ``(2, n)`` int32; row 0: tokens this rank sends to each rank (before capacity
        clipping), row 1: tokens it receives from each rank (after clipping).
      token_send_row: ``(T, K)`` int32; send-buffer row carrying pair ``(t, k)`` when ``k`` is the
        first of ``t``'s choices on that rank, else -1. Combine sums over these.
      send_offsets: ``(n, n)`` int32; ``[s, d]``: first send-buffer row of rank ``s`` for rank ``d``.
      recv_offsets: ``(n, n)`` int32; ``[s, d]``: first row on rank ``d`` for tokens from ``s``.
      recv_counts: ``(n, n)`` int32; ``[s, d]``: tokens from ``s`` that fit on ``d``.
      recv_weights: ``(R, K)`` float32; router weight of each received token's local experts (0
        for slots that are not this rank's).
      recv_pos: ``(R, K)`` int32; row of ``expert_x`` holding each (received token, k) pair, or
        ``C`` when there is none.
      expert_token: ``(C,)`` int32; token-receive-buffer row behind each row of ``expert_x``
        (``R`` for unused rows).
    """

    config: EPConfig = dataclasses.field(metadata=dict(static=True))
    group_sizes: jax.Array
    num_recv_tokens: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    traffic: jax.Array
    token_send_row: jax.Array
    send_offsets: jax.Array
    recv_offsets: jax.Array
    recv_counts: jax.Array
    recv_weights: jax.Array
    recv_pos: jax.Array
    expert_token: jax.Array


def _check_float(api: str, name: str, a, shape) -> None:
    if not jnp.issubdtype(a.dtype, jnp.floating) or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{api}: {name} must be a floating array of shape {tuple(shape)}, "
                         f"got {a.dtype} {tuple(a.shape)}")


def _check_axis(api: str, config: EPConfig) -> None:
    if not isinstance(config, EPConfig):
        raise TypeError(f"{api}: config must be an ep_comm.EPConfig, got {type(config).__name__}")
    n = axis_size(config.axis_name, api)
    if n != config.num_ranks:
        raise ValueError(f"{api}: config.num_ranks={config.num_ranks} but mesh axis "
                         f"{config.axis_name!r} has size {n}")


def _raise_if_bad(num_dropped, num_invalid, config: EPConfig):
    dropped = np.asarray(num_dropped).reshape(-1)
    invalid = np.asarray(num_invalid).reshape(-1)
    if dropped.sum() == 0 and invalid.sum() == 0:
        return
    parts = []
    if dropped.sum():
        ranks = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(dropped) if v)
        parts.append(f"dropped {int(dropped.sum())} (token, expert) pairs ({ranks}): the expert "
                     f"buffer holds recv_capacity={config.expert_rows} rows per rank; the dropless "
                     f"worst case is {config.worst_case_rows} (EPConfig(recv_capacity=None))")
    if invalid.sum():
        parts.append(f"{int(invalid.sum())} expert ids outside [-1, {config.num_experts}) were not "
                     f"routed")
    raise EPOverflowError("ep_comm dispatch " + "; ".join(parts))


def _runtime_check(handle: EPHandle) -> EPHandle:
    """Inside shard_map: raise EPOverflowError at run time when anything was dropped."""
    cfg = handle.config
    everyone = lax.all_gather(jnp.concatenate([handle.num_dropped, handle.num_invalid]),
                              cfg.axis_name)  # (n, 2): per-rank counts, identical on all ranks

    def host_check(counts):
        _raise_if_bad(counts[:, 0], counts[:, 1], cfg)
        return np.zeros((1,), np.int32)

    ok = io_callback(host_check, jax.ShapeDtypeStruct((1,), jnp.int32), everyone)
    return dataclasses.replace(handle, num_dropped=handle.num_dropped + ok)


def check(handle: EPHandle) -> EPHandle:
    """Raise :class:`EPOverflowError` if dispatch dropped any pair or saw out-of-range ids.

    On a concrete handle (returned from ``shard_map``/``jit`` with ``out_specs=P(axis)``) it checks
    now and names the ranks. Inside ``shard_map`` it inserts a run-time check (the error surfaces
    when the results are computed) and returns the handle, which must be used for the check to stay
    in the program.
    """
    if not isinstance(handle, EPHandle):
        raise TypeError(f"check: expected an ep_comm.EPHandle, got {type(handle).__name__}")
    if is_tracer(handle.num_dropped):
        return _runtime_check(handle)
    if not getattr(handle.num_dropped, "is_fully_addressable", True):
        from jax.experimental import multihost_utils
        dropped, invalid = multihost_utils.process_allgather(
            (handle.num_dropped, handle.num_invalid), tiled=True)
    else:
        dropped, invalid = handle.num_dropped, handle.num_invalid
    _raise_if_bad(dropped, invalid, handle.config)
    return handle


def dispatch(x, topk_ids, topk_weights, config: EPConfig):
    """Send each token to the ranks holding its experts; group received rows by local expert.

    Call inside ``jax.shard_map`` over ``config.axis_name``.

    Args:
      x: ``(T, H)`` floating; this rank's tokens, ``T = config.tokens_per_rank``.
      topk_ids: ``(T, topk)`` integer expert ids in ``[0, num_experts)``; ``-1`` = no expert.
      topk_weights: ``(T, topk)`` floating router weights (differentiable).
      config: :class:`EPConfig`.

    Returns:
      ``(expert_x, handle)``: ``expert_x`` is ``(config.expert_rows, H)`` in ``x.dtype``, rows
      grouped by local expert as ``handle.group_sizes`` says (rows past the groups are zero);
      ``handle`` is the :class:`EPHandle` that :func:`combine` consumes.
    """
    api = "dispatch"
    _check_axis(api, config)
    x = jnp.asarray(x)
    cfg = config
    T, K, n, L = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks, cfg.experts_per_rank
    if x.ndim != 2 or x.shape[0] != T or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (tokens_per_rank, hidden) = "
                         f"({T}, hidden), got {x.dtype} {tuple(x.shape)}")
    topk_ids = check_topk_ids(api, topk_ids, T, K)
    topk_weights = jnp.asarray(topk_weights)
    _check_float(api, "topk_weights", topk_weights, (T, K))
    S, R, C = cfg.send_rows, cfg.recv_token_rows, cfg.expert_rows
    i32 = jnp.int32
    ax = cfg.axis_name
    me = lax.axis_index(ax)

    # 1. layout of this rank's tokens.
    layout, valid, dest, local = layout_and_routes(topk_ids, cfg.placement)

    # 2. the n x n traffic matrices, identical on every rank.
    counts = lax.all_gather(jnp.stack([layout.num_tokens_per_rank, layout.num_pairs_per_rank]), ax)
    tok = counts[:, 0, :]  # [s, d] tokens s -> d
    pairs = counts[:, 1, :]  # [s, d] (token, expert) pairs s -> d
    send_offsets = _exclusive_cumsum(tok, axis=1)  # row of s's send buffer where d's block starts
    recv_start = _exclusive_cumsum(tok, axis=0)  # row of d's receive buffer for s, uncapped
    recv_counts = jnp.clip(R - recv_start, 0, tok)  # what fits
    recv_offsets = jnp.minimum(recv_start, R)

    # 3. send buffer: tokens ordered by destination rank, then token index.
    in_rank = layout.is_token_in_rank  # (T, n)
    row_in_block = jnp.cumsum(in_rank, axis=0, dtype=i32) - 1
    send_row = jnp.where(in_rank, send_offsets[me][None, :] + row_in_block, -1)  # (T, n)
    t_idx = jnp.broadcast_to(jnp.arange(T, dtype=i32)[:, None], (T, n))
    d_idx = jnp.broadcast_to(jnp.arange(n, dtype=i32)[None, :], (T, n))
    scatter_to = jnp.where(in_rank, send_row, S + t_idx * n + d_idx).reshape(-1)  # unique; OOB drops
    send_token = jnp.full((S,), T, i32).at[scatter_to].set(
        t_idx.reshape(-1), mode="drop", unique_indices=True)
    send_dest = jnp.full((S,), n, i32).at[scatter_to].set(
        d_idx.reshape(-1), mode="drop", unique_indices=True)
    src_tok = jnp.minimum(send_token, T - 1)
    mine = (dest[src_tok] == send_dest[:, None]) & (send_token < T)[:, None]  # (S, K)
    send_x = jnp.take(x, src_tok, axis=0)
    send_ids = jnp.where(mine, local[src_tok], -1)
    send_w = jnp.where(mine, topk_weights[src_tok].astype(jnp.float32), 0.0)

    def exchange(operand, fill, what):
        out = jnp.full((R, *operand.shape[1:]), fill, operand.dtype)
        return _ragged_all_to_all(operand, out, send_offsets[me], recv_counts[me],
                                  recv_offsets[me], recv_counts[:, me], axis_name=ax,
                                  backend=cfg.backend, max_segment_rows=T,
                                  label=f"dispatch ({what})", tag=cfg.fingerprint)

    recv_x = exchange(send_x, 0, "tokens")
    # Weights and local expert ids travel together in one float32 exchange (ids < 2**24 are
    # exact in float32; the weights keep their gradient).
    routing = exchange(jnp.concatenate([send_w, send_ids.astype(jnp.float32)], 1), 0, "routing")
    received = (jnp.arange(R, dtype=i32) < jnp.sum(recv_counts[:, me]))[:, None]  # rows written
    recv_w = jnp.where(received, routing[:, :K], 0.0)
    recv_ids = jnp.where(received, routing[:, K:].astype(i32), -1)

    # 4. expand into groups contiguous per local expert (stable: source rank, token, k). A token
    # that lists one expert twice gets one row; both slots point at it (weights add up in combine).
    has_expert = recv_ids >= 0
    # first slot of each (row, k)'s expert in its row; a slot that is not its own first repeats it
    first_slot = jnp.argmax(recv_ids[:, :, None] == recv_ids[:, None, :], axis=2)  # (R, K)
    repeat = first_slot != jnp.arange(K)[None, :]
    key = jnp.where(has_expert & ~repeat, recv_ids, L).reshape(-1)  # (R*K,)
    order = jnp.argsort(key, stable=True).astype(i32)
    per_expert = jnp.bincount(key, length=L + 1)[:L].astype(i32)
    num_pairs = jnp.sum(per_expert)
    group_sizes = jnp.clip(C - _exclusive_cumsum(per_expert), 0, per_expert)
    inverse = jnp.zeros((R * K,), i32).at[order].set(jnp.arange(R * K, dtype=i32),
                                                       unique_indices=True)
    pos_first = jnp.where((key < L) & (inverse < C), inverse, C).reshape(R, K)
    recv_pos = jnp.where(has_expert, jnp.take_along_axis(pos_first, first_slot, axis=1), C)
    q = jnp.arange(C, dtype=i32)
    used = q < jnp.minimum(num_pairs, C)
    expert_token = jnp.where(used, order[jnp.minimum(q, R * K - 1)] // K, R)
    expert_x = jnp.take(recv_x, jnp.minimum(expert_token, R - 1), axis=0)
    expert_x = jnp.where(used[:, None], expert_x, jnp.zeros((), x.dtype))

    # First k of each token on each rank: the pair whose send row combine reads back.
    first = valid & ~repeats_earlier(dest)
    token_send_row = jnp.where(first, jnp.take_along_axis(send_row, jnp.minimum(dest, n - 1), 1), -1)

    expected = jnp.sum(pairs[:, me])
    handle = EPHandle(
        config=cfg,
        group_sizes=group_sizes,
        num_recv_tokens=jnp.sum(recv_counts[:, me], dtype=i32)[None],
        num_dropped=(expected - jnp.sum(group_sizes)).astype(i32)[None],
        num_invalid=layout.num_invalid[None],
        traffic=jnp.stack([tok[me], recv_counts[:, me]]),
        token_send_row=token_send_row,
        send_offsets=send_offsets,
        recv_offsets=recv_offsets,
        recv_counts=recv_counts,
        recv_weights=recv_w,
        recv_pos=recv_pos,
        expert_token=expert_token,
    )
    if cfg.overflow == "raise":
        handle = _runtime_check(handle)
    return expert_x, handle


def _gather_sum(table, idx, ok, weights=None):
    """``sum_k ok[:, k] * weights[:, k] * table[idx[:, k]]`` in float32, adding k in order (a
    fixed order: deterministic). ``idx``/``ok``/``weights``: ``(N, K)``; masked entries may hold
    any index and contribute exactly zero, even where the table holds NaN."""
    acc = None
    for k in range(idx.shape[1]):
        rows = jnp.take(table, jnp.clip(idx[:, k], 0, table.shape[0] - 1), axis=0)
        rows = rows.astype(jnp.float32)
        if weights is not None:
            rows = weights[:, k, None] * rows
        term = jnp.where(ok[:, k, None], rows, 0.0)
        acc = term if acc is None else acc + term
    return acc


def combine(expert_y, handle: EPHandle):
    """Return expert outputs to their tokens and sum them with the router weights.

    Call inside the same ``jax.shard_map`` as :func:`dispatch`.

    Args:
      expert_y: ``(config.expert_rows, H)`` floating; the experts' outputs, row for row aligned
        with ``expert_x`` (rows past ``sum(handle.group_sizes)`` are ignored).
      handle: the :class:`EPHandle` from :func:`dispatch`.

    Returns:
      ``(T, H)`` in ``expert_y.dtype``: ``y[t] = sum_k topk_weights[t, k] * expert_k(x[t])``,
      accumulated in float32 (k in order); pairs with id -1 (or dropped) contribute nothing.
    """
    api = "combine"
    if not isinstance(handle, EPHandle):
        raise TypeError(f"{api}: handle must be the EPHandle returned by dispatch, "
                        f"got {type(handle).__name__}")
    cfg = handle.config
    _check_axis(api, cfg)
    expert_y = jnp.asarray(expert_y)
    if (expert_y.ndim != 2 or expert_y.shape[0] != cfg.expert_rows
            or not jnp.issubdtype(expert_y.dtype, jnp.floating)):
        raise ValueError(f"{api}: expert_y must be a floating array of shape (expert_rows, hidden) "
                         f"= ({cfg.expert_rows}, hidden), got {expert_y.dtype} "
                         f"{tuple(expert_y.shape)}")
    C = cfg.expert_rows
    ax = cfg.axis_name
    me = lax.axis_index(ax)
    wire = jnp.dtype(cfg.combine_dtype) if cfg.combine_dtype else expert_y.dtype

    # Receiver: weighted sum over this rank's experts of each received token.
    partial = _gather_sum(expert_y, handle.recv_pos, handle.recv_pos < C, handle.recv_weights)

    # Reverse exchange: one partial sum per (token, rank) goes back to the source's send row.
    back = _ragged_all_to_all(
        partial.astype(wire), jnp.zeros((cfg.send_rows, expert_y.shape[1]), wire),
        handle.recv_offsets[:, me], handle.recv_counts[:, me], handle.send_offsets[:, me],
        handle.recv_counts[me], axis_name=ax, backend=cfg.backend,
        max_segment_rows=cfg.tokens_per_rank, label="combine", tag=cfg.fingerprint)

    # Source: sum the partials of each token's ranks (in order of first choice).
    y = _gather_sum(back, handle.token_send_row, handle.token_send_row >= 0)
    return y.astype(expert_y.dtype)
