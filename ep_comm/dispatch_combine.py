"""Dropless MoE ``dispatch`` / ``combine`` over an expert-parallel mesh axis.

Both run inside ``jax.shard_map`` over ``config.axis_name``; every array below is one rank's block.

dispatch (per rank, ``T`` tokens, ``n`` ranks, ``E_local`` experts per rank):
  1. layout: which ranks each token goes to (a token goes **once per destination rank**, however
     many of that rank's experts it chose);
  2. counts: one ``all_gather`` of the per-destination token and pair counts gives every rank the
     full ``n x n`` traffic matrix, from which all offsets are derived identically on every rank;
  3. exchange: per leg of the plan (flat: one; hierarchical: the network stage, then the forward
     inside the node), two ragged all-to-alls: the token rows, and their routing (weights and
     global expert ids as float32), into a token receive buffer; the receiver reads it in the
     order (source rank, source token);
  4. expand: the receiver copies each received token once per chosen local expert into
     ``expert_x``, grouped contiguously by local expert (ordered by source rank, token, k inside
     a group), so ``handle.group_sizes`` feeds ``jax.lax.ragged_dot`` or a grouped GEMM directly;
     the groups' layout is a stable counting sort and each received row is read once
     (``ep_comm.collectives.row_kernels.expert_layout`` and ``scatter``).

With one rank and room for every token (``routes.is_local``) nothing moves between ranks: step 3
is skipped (the receive buffer is ``x`` itself) and so is combine's way back.

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

from ep_comm.collectives import row_kernels
from ep_comm.collectives.native import rows_covered
from ep_comm import plan as plans
from ep_comm.config import EPConfig
from ep_comm.expand import ZERO_TAIL_ROWS, expand, expert_rows_read
from ep_comm.handle import EPHandle
from ep_comm.layout import check_topk_ids, placement_routes
from ep_comm import wire
from ep_comm.overflow import first_invalid, invalid_ids_message, report, runtime_check
from ep_comm.rows import masked_gather_sum
from ep_comm.routes import (ExchangeCall, drive, exclusive_cumsum, flat_route, gather_counts,
                            hierarchical_route, is_local, link_rows, local_route)
from ep_comm.topology._jax_compat import axis_size


def check_float(api: str, name: str, a, shape) -> None:
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


def dispatch(x, topk_ids, topk_weights, config: EPConfig, *, return_quantized: bool = False):
    """Send each token to the ranks holding its experts; group received rows by local expert.

    Call inside ``jax.shard_map`` over ``config.axis_name``. ``config.plan`` picks the route
    (:mod:`ep_comm.plan`); every plan returns the same ``expert_x`` and ``group_sizes``, bit for
    bit, and the same drops.

    Args:
      x: ``(T, H)`` floating; this rank's tokens, ``T = config.tokens_per_rank``.
      topk_ids: ``(T, topk)`` integer expert ids in ``[0, num_experts)``; ``-1`` = no expert.
      topk_weights: ``(T, topk)`` floating router weights (differentiable).
      config: :class:`EPConfig`. With ``config.wire_format`` set, token rows cross the wire in
        FP8 (:mod:`ep_comm.wire`) and ``expert_x`` holds their dequantized values; the gradient
        with respect to ``x`` is straight-through (the quantization counts as the identity) and
        runs in full precision: an unweighted combine of ``d expert_x``.
      return_quantized: with ``config.wire_format`` set, return ``expert_x`` as the received
        ``(values, scales)`` (``float8_e4m3fn`` ``(expert_rows, H)`` and the per-block scales:
        float32, or uint8 e8m0 exponents for ``"mxfp8"``) for an FP8 grouped GEMM. Not
        differentiable in ``x`` (differentiating through it raises).

    Returns:
      ``(expert_x, handle)``: ``expert_x`` is ``(config.expert_rows, H)`` in ``x.dtype``, rows
      grouped by local expert as ``handle.group_sizes`` says (rows past the groups are
      unspecified, or zero with ``config.zero_fill``);
      ``handle`` is the :class:`EPHandle` that :func:`combine` consumes.
    """
    return drive(dispatch_steps(x, topk_ids, topk_weights, config,
                                return_quantized=return_quantized))


def dispatch_steps(x, topk_ids, topk_weights, config: EPConfig, *, return_quantized=False,
                   materialize=True):
    """:func:`dispatch` as a step generator (:func:`ep_comm.routes.drive`): it yields its
    exchanges and returns ``(expert_x, handle)``; with ``materialize=False`` (unquantized wire
    only; what the fused layer runs) ``((rows, sources), handle)`` instead: the receive buffer and
    the row of it each row of ``expert_x`` would hold (negative: zero), ``expert_x`` unwritten."""
    api = "dispatch"
    _check_axis(api, config)
    x = jnp.asarray(x)
    cfg = config
    T, K, n = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks
    if x.ndim != 2 or x.shape[0] != T or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (tokens_per_rank, hidden) = "
                         f"({T}, hidden), got {x.dtype} {tuple(x.shape)}")
    if return_quantized and cfg.wire_format is None:
        raise ValueError(f"{api}: return_quantized=True needs config.wire_format ('e4m3' or "
                         f"'mxfp8'), got None")
    topk_ids = check_topk_ids(api, topk_ids, T, K)
    topk_weights = jnp.asarray(topk_weights)
    check_float(api, "topk_weights", topk_weights, (T, K))
    plan = plans.resolve_plan(cfg, x.shape[1], x.dtype, api)
    R = cfg.recv_token_rows
    i32 = jnp.int32
    ax = cfg.axis_name
    me = lax.axis_index(ax)

    # 1. layout of this rank's tokens (one kernel on GPUs): their routing rows, destination
    # ranks and per-rank counts. One rank at decode sizes: with the expert layout of step 4 in
    # the same launch.
    local = is_local(cfg, plan.kind)
    if local and row_kernels.local_layout_fits(T, K, cfg.num_experts):
        tr, layout = row_kernels.local_layout(
            topk_ids, topk_weights, num_experts=cfg.num_experts, rows=cfg.expert_rows,
            fill_rows=ZERO_TAIL_ROWS, zero_fill=cfg.zero_fill)
    else:
        tr, layout = placement_routes(topk_ids, topk_weights, cfg.placement), None
    dest = tr.dest
    hierarchical = plan.kind == "hierarchical"
    if hierarchical:
        N, G = plan.shape
        node = dest // G  # N for ids that are not routed
        in_node = jnp.any(node[:, :, None] == jnp.arange(N, dtype=i32), axis=1)  # (T, N)

    # 2. the n x n traffic matrices (and tokens per node), identical on every rank.
    mine = [tr.tokens_per_rank, tr.pairs_per_rank]
    if hierarchical:
        mine.append(jnp.sum(in_node, axis=0, dtype=i32))
    bad_ids = first_invalid(topk_ids, cfg.num_experts)  # [count, token, k, value]
    checks_ids = cfg.ids_check != "ignore"
    if checks_ids:  # every rank's, with the traffic counts (no collective of its own)
        mine.append(bad_ids)
    counts = gather_counts(cfg, jnp.concatenate(mine), api)
    if checks_ids:
        ids_flag = report(cfg, counts[:, -4:], invalid_ids_message, cfg.ids_check)
        counts = counts[:, :-4]
    tok = counts[:, :n]  # [s, d] tokens s -> d
    pairs = counts[:, n:2 * n]  # [s, d] (token, expert) pairs s -> d
    recv_start = exclusive_cumsum(tok, axis=0)  # row of d's receive buffer for s, uncapped
    kept = jnp.clip(R - recv_start, 0, tok)  # [s, d]: what fits on d (a prefix of s's tokens)

    # 3. move tokens and routing (weights, and ids as float32: exact below 2**24) to the ranks.
    route = tr.route
    # the token rows as they cross the wire: x itself, or FP8 values and scales as bytes (with
    # no wire, one rank, expand quantizes x's rows as it places them: no wire rows exist)
    round_trip = local and cfg.wire_format is not None
    rows = x if cfg.wire_format is None or round_trip else wire.pack_rows(x, cfg.wire_format)
    if hierarchical:
        moved = yield from hierarchical_route(cfg, plan, rows, route, node, in_node, kept,
                                              counts[:, 2 * n:], me)
    elif local:
        moved = local_route(cfg, rows, route, tr.first, tok, kept)
    else:
        moved = yield from flat_route(cfg, plan, rows, route, dest, tr.in_rank, tr.first, tok,
                                      kept, me)

    # 4. expand into groups contiguous per local expert.
    num_recv = jnp.sum(kept[:, me])
    dequantize_to = (None if cfg.wire_format is None or return_quantized or round_trip
                     else (x.shape[1], x.dtype))
    # (a local route's buffer holds every token: all its rows count, those without an expert
    # here carry none)
    ex = expand(cfg, moved, R if local else num_recv, me, dequantize_to,
                split_at=x.shape[1] if return_quantized else None, round_trip=round_trip,
                layout=layout, materialize=materialize)
    sent = link_rows(plan, moved.legs, me)  # per link class, dispatch and combine
    expected = jnp.sum(pairs[:, me])
    handle = EPHandle(
        config=cfg,
        plan=plan.kind,
        group_sizes=ex.group_sizes,
        num_recv_tokens=num_recv.astype(i32)[None],
        num_dropped=(expected - ex.num_grouped).astype(i32)[None],
        num_invalid=tr.num_invalid[None] + (ids_flag if checks_ids else 0),
        first_invalid=bad_ids,
        traffic=jnp.stack([tok[me], kept[:, me]]),
        link_rows=sent,
        token_send_row=moved.token_send_row,
        legs=() if local else moved.legs,  # (no exchange to reverse: nothing to carry)
        forward_row=moved.forward_row,
        recv_weights=ex.recv_weights,
        recv_pos=ex.recv_pos,
        expert_token=ex.expert_token,
    )
    if cfg.overflow == "raise":
        handle = runtime_check(handle)
    if not materialize:
        return (ex.rows, ex.sources), handle
    if cfg.wire_format is None:
        return ex.expert_x, handle
    if return_quantized:
        values, scales = wire.from_bytes(*ex.expert_x, cfg.wire_format)
        return (_not_differentiable(values, x), scales), handle
    return _straight_through(ex.expert_x, x, handle), handle


def _float0_like(tree):
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0)
                        if not jnp.issubdtype(a.dtype, jnp.inexact) else jnp.zeros_like(a), tree)


@jax.custom_vjp
def _straight_through(expert_x, x, handle):
    """``expert_x`` (the dequantized received rows), differentiable in ``x`` as if the wire were
    exact: dispatch's transpose, an unweighted combine (each expert row once)."""
    return expert_x


def _straight_through_fwd(expert_x, x, handle):
    return expert_x, (handle, x[:0])


def _straight_through_bwd(res, g):
    handle, like = res
    C = handle.config.expert_rows
    first = expert_rows_read(handle.recv_pos, C) < C  # each expert row once
    unit = dataclasses.replace(handle, recv_weights=first.astype(jnp.float32))
    d_x = combine(g, unit).astype(like.dtype)
    return jnp.zeros_like(g), d_x, _float0_like(handle)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


@jax.custom_vjp
def _not_differentiable(values, x):
    return values


def _not_differentiable_fwd(values, x):
    return values, None


def _not_differentiable_bwd(_, g):
    raise NotImplementedError(
        "dispatch(return_quantized=True) is not differentiable in x: the FP8 values are bytes "
        "on the wire; differentiate with return_quantized=False (the dequantized expert_x, "
        "whose gradient is straight-through)")


_not_differentiable.defvjp(_not_differentiable_fwd, _not_differentiable_bwd)


def combine(expert_y, handle: EPHandle):
    """Return expert outputs to their tokens and sum them with the router weights.

    Call inside the same ``jax.shard_map`` as :func:`dispatch`.

    Args:
      expert_y: ``(config.expert_rows, H)`` floating; the experts' outputs, row for row aligned
        with ``expert_x`` (rows past ``sum(handle.group_sizes)`` are ignored).
      handle: the :class:`EPHandle` from :func:`dispatch`.

    Returns:
      ``(T, H)`` in ``expert_y.dtype``: ``y[t] = sum_k topk_weights[t, k] * expert_k(x[t])``,
      accumulated in float32. Flat plan: each rank sums its experts' outputs (k in order) and the
      source adds the per-rank partial sums in order of first choice. Hierarchical plan: the node's
      forwarding rank adds its ranks' partial sums (local rank in order), sends one row per token
      back, and the source adds the per-node sums; the result equals the flat plan's up to float32
      reassociation (and, with a 16-bit combine dtype, one extra rounding of the node sums).
      Pairs with id -1 (or dropped) contribute nothing.
    """
    return drive(combine_steps(expert_y, handle))


def combine_steps(expert_y, handle: EPHandle):
    """:func:`combine` as a step generator (:func:`ep_comm.routes.drive`): it yields its
    exchanges and returns the ``(T, H)`` output."""
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
    C, T, K = cfg.expert_rows, cfg.tokens_per_rank, cfg.topk
    wire = jnp.dtype(cfg.combine_dtype) if cfg.combine_dtype else expert_y.dtype
    plan = plans.replay(cfg, handle.plan, api)

    # Receiver: weighted sum over this rank's experts of each received token.
    partial = masked_gather_sum(expert_y, handle.recv_pos, handle.recv_pos < C, handle.recv_weights,
                         out_dtype=wire)
    if is_local(cfg, handle.plan):  # the receive buffer was the tokens: row t is token t's sum
        return partial.astype(expert_y.dtype)
    if handle.plan == "flat":
        (back,) = yield (ExchangeCall(cfg, plan.stages[0], handle.legs[0], partial, cfg.send_rows, T,
                                  "combine", reverse=True),)
    else:
        N, G = plan.shape
        leg1, leg2 = handle.legs
        # Stage 2 backwards: one partial per (token, rank) to the node's forwarding rank, which
        # sums them: one row per token and node.
        (back2,) = yield (ExchangeCall(cfg, plan.stages[1], leg2, partial, N * T * min(K, G), N * T,
                                   "combine (stage 2)", reverse=True),)
        node_sum = masked_gather_sum(back2, handle.forward_row, handle.forward_row >= 0,
                              out_dtype=wire)
        (back,) = yield (ExchangeCall(cfg, plan.stages[0], leg1, node_sum, T * min(K, N), T,
                                  "combine (stage 1)", reverse=True),)
    # Source: sum the partials of each token's ranks (or nodes), in order of first choice; only
    # the rows that came back (a row the destination did not keep, at a small recv_capacity, did
    # not: its receive row is unspecified).
    leg = handle.legs[0]
    came_back = rows_covered(back.shape[0], leg.input_offsets, leg.send_sizes)
    row = handle.token_send_row
    ok = (row >= 0) & came_back[jnp.clip(row, 0, back.shape[0] - 1)]
    return masked_gather_sum(back, row, ok, out_dtype=expert_y.dtype)
