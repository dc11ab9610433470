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

from ep_comm import plan as plans
from ep_comm._compat import axis_size, is_tracer
from ep_comm.config import EPConfig
from ep_comm.layout import check_topk_ids, layout_and_routes, repeats_earlier
from ep_comm.ragged import _ragged_all_to_all
from topology.machine import LINK_CLASSES
from topology.traffic import link_matrix, row_bytes as _traffic_row_bytes


class EPOverflowError(RuntimeError):
    """(token, expert) pairs were dropped (a user-set ``recv_capacity`` overflowed) or expert ids
    were out of range."""


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Leg:
    """One rank's view of one ragged exchange of a plan and of its reverse (combine's). Every
    field is ``(P,)`` int32 over the ``P`` members of the rank's exchange group.

    Attributes:
      input_offsets, send_sizes: where the rows for each member start in this rank's send buffer,
        and how many go.
      output_offsets: where they land in that member's receive buffer.
      recv_sizes, recv_offsets: rows this rank receives from each member, and where they land in
        its own receive buffer.
      peer_input_offsets: where those rows started in the member's send buffer (where combine
        sends them back to).
      peers: global expert-parallel rank of each member.
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    peer_input_offsets: jax.Array
    peers: jax.Array


def _leg(counts, send_starts, me, peers) -> Leg:
    """Rank ``me``'s :class:`Leg` from the group's ``(P, P)`` matrices: ``counts[s, d]`` rows
    member ``s`` sends member ``d``; ``send_starts[s, d]`` the first row of that block in ``s``'s
    send buffer. Receive buffers take blocks in member order."""
    recv_starts = _exclusive_cumsum(counts, axis=0)
    return Leg(send_starts[me], counts[me], recv_starts[me], counts[:, me], recv_starts[:, me],
               send_starts[:, me], peers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPHandle:
    """What dispatch learned, consumed by :func:`combine`. One rank's view inside ``shard_map``.

    Shapes use ``T = tokens_per_rank``, ``K = topk``, ``n = num_ranks``,
    ``R = config.recv_token_rows``, ``C = config.expert_rows`` and ``L = experts_per_rank``; for
    the hierarchical plan ``N`` nodes of ``G`` ranks. Every leaf has a leading axis, so ``out_specs=P(axis_name)`` returns a whole
    handle from ``shard_map`` (per-rank values stacked).

    Attributes:
      config: the static :class:`EPConfig`.
      plan: ``"flat"`` or ``"hierarchical"`` (static; what ``config.plan`` resolved to).
      group_sizes: ``(L,)`` int32; rows of ``expert_x`` per local expert, in order, contiguous
        from row 0. Rows past ``sum(group_sizes)`` are zero and ignored by combine.
      num_recv_tokens: ``(1,)`` int32; tokens received (rows of the token receive buffer used).
      num_dropped: ``(1,)`` int32; (token, expert) pairs destined to this rank that did not fit
        ``recv_capacity``. Always 0 with the default (worst-case) capacity.
      num_invalid: ``(1,)`` int32; expert ids of this rank's tokens outside ``[-1, num_experts)``
        (not routed).
      traffic: ``(2, n)`` int32; row 0: tokens this rank sends to each rank (before capacity
        clipping), row 1: tokens it receives from each rank (after clipping), whatever the plan.
      link_rows: ``(2, len(topology.LINK_CLASSES))`` int32; rows this rank sends over each link
        class (``self``, ``nvlink``, ``pcie``, ``network``) in dispatch (row 0; each row carries
        ``H`` elements of ``x`` and ``2K`` float32 of routing) and in combine (row 1; ``H``
        elements of the combine dtype). :func:`link_bytes` turns them into bytes.
      token_send_row: ``(T, K)`` int32; row of this rank's (first-stage) send buffer carrying
        pair ``(t, k)`` when ``k`` is the first of ``t``'s choices on that rank (flat) or node
        (hierarchical), else -1. Combine sums over these.
      legs: the exchanges of the plan (one :class:`Leg` for flat; stage 1 then stage 2 for
        hierarchical).
      forward_row: hierarchical only (else ``None``): ``(N * T, G)`` int32; row of the stage-2
        send buffer that forwarded stage-1 row ``i`` to local rank ``g``, or -1.
      recv_weights: ``(R, K)`` float32; router weight of each received token's local experts (0
        for slots that are not this rank's), per row of the (last-stage) receive buffer.
      recv_pos: ``(R, K)`` int32; row of ``expert_x`` holding each (received token, k) pair, or
        ``C`` when there is none.
      expert_token: ``(C,)`` int32; token behind each row of ``expert_x``, as its row in the
        receive buffer ordered by (source rank, source token) -- the flat plan's order -- or
        ``R`` for unused rows.
    """

    config: EPConfig = dataclasses.field(metadata=dict(static=True))
    plan: str = dataclasses.field(metadata=dict(static=True))
    group_sizes: jax.Array
    num_recv_tokens: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    traffic: jax.Array
    link_rows: jax.Array
    token_send_row: jax.Array
    legs: tuple
    forward_row: jax.Array | None
    recv_weights: jax.Array
    recv_pos: jax.Array
    expert_token: jax.Array


def link_bytes(handle: "EPHandle", hidden: int, dtype) -> jax.Array:
    """``(2, len(topology.LINK_CLASSES))`` float32 bytes this rank sent per link class in dispatch
    (row 0) and combine (row 1) for tokens of ``hidden`` elements of ``dtype``; see
    ``EPHandle.link_rows``."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"link_bytes: handle must be the EPHandle returned by dispatch, "
                        f"got {type(handle).__name__}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"link_bytes: hidden must be a positive int, got {hidden!r}")
    dispatch_row, combine_row = row_bytes(handle.config, hidden, dtype)
    per_row = jnp.array([dispatch_row, combine_row], jnp.float32)[:, None]
    return handle.link_rows.astype(jnp.float32) * per_row


def row_bytes(cfg: EPConfig, hidden: int, dtype) -> tuple[int, int]:
    """Bytes of one dispatch row (token + routing) and of one combine row (partial sum)."""
    return _traffic_row_bytes(hidden, dtype, cfg.topk, cfg.combine_dtype)


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

    Call inside ``jax.shard_map`` over ``config.axis_name``. ``config.plan`` picks the route
    (:mod:`ep_comm.plan`); every plan returns the same ``expert_x`` and ``group_sizes``, bit for
    bit, and the same drops.

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
    plan = plans.resolve(cfg, x.shape[1], x.dtype, api)
    R, C = cfg.recv_token_rows, cfg.expert_rows
    i32 = jnp.int32
    ax = cfg.axis_name
    me = lax.axis_index(ax)

    # 1. layout of this rank's tokens.
    layout, valid, dest, local = layout_and_routes(topk_ids, cfg.placement)
    hierarchical = plan.kind == "hierarchical"
    if hierarchical:
        N, G = plan.shape
        node = dest // G  # N for ids that are not routed
        in_node = jnp.any(node[:, :, None] == jnp.arange(N, dtype=i32), axis=1)  # (T, N)

    # 2. the n x n traffic matrices (and tokens per node), identical on every rank.
    mine = [layout.num_tokens_per_rank, layout.num_pairs_per_rank]
    if hierarchical:
        mine.append(jnp.sum(in_node, axis=0, dtype=i32))
    counts = lax.all_gather(jnp.concatenate(mine), ax)
    tok = counts[:, :n]  # [s, d] tokens s -> d
    pairs = counts[:, n:2 * n]  # [s, d] (token, expert) pairs s -> d
    recv_start = _exclusive_cumsum(tok, axis=0)  # row of d's receive buffer for s, uncapped
    kept = jnp.clip(R - recv_start, 0, tok)  # [s, d]: what fits on d (a prefix of s's tokens)

    # 3. move tokens and routing (weights, and ids as float32: exact below 2**24) to the ranks.
    route = jnp.concatenate([topk_weights.astype(jnp.float32), topk_ids.astype(jnp.float32)], 1)
    if hierarchical:
        moved = _hierarchical_dispatch(cfg, plan, x, route, node, in_node, kept,
                                       counts[:, 2 * n:], me)
    else:
        moved = _flat_dispatch(cfg, plan, x, route, dest, tok, kept, me)
    buf_x, buf_route, flat_to_buf = moved["x"], moved["route"], moved["flat_to_buf"]

    # received rows in the flat order (source rank, source token), routing masked to this rank
    num_recv = jnp.sum(kept[:, me])
    received = jnp.arange(R, dtype=i32) < num_recv
    # flat_to_buf: row of the receive buffer holding each flat-order row (None: the same row)
    row_route = buf_route if flat_to_buf is None else jnp.take(
        buf_route, jnp.minimum(flat_to_buf, R - 1), axis=0)
    gid = jnp.where(received[:, None], row_route[:, K:], -1.0).astype(i32)
    here = (gid >= 0) & (gid // L == me)
    recv_w = jnp.where(here, row_route[:, :K], 0.0)
    recv_ids = jnp.where(here, gid % L, -1)

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
    src_row = jnp.minimum(expert_token, R - 1)
    if flat_to_buf is not None:
        src_row = jnp.take(flat_to_buf, src_row)
    expert_x = jnp.take(buf_x, src_row, axis=0)
    expert_x = jnp.where(used[:, None], expert_x, jnp.zeros((), x.dtype))
    if flat_to_buf is not None:  # combine reads the receive buffer in its own (stage-2) order
        buf_rows = jnp.where(received, flat_to_buf, R)
        recv_pos = jnp.full((R, K), C, i32).at[buf_rows].set(recv_pos, mode="drop")
        recv_w = jnp.zeros((R, K), jnp.float32).at[buf_rows].set(recv_w, mode="drop")

    # rows sent per link class, dispatch and combine (combine sends back what it received)
    links = jnp.asarray(link_matrix(plan.topology))[me]  # (n,) class of the link to each rank
    nc = len(LINK_CLASSES)
    sent = [jnp.zeros((nc,), i32), jnp.zeros((nc,), i32)]
    for leg in moved["legs"]:
        cls = links[leg.peers]
        sent[0] = sent[0].at[cls].add(leg.send_sizes)
        sent[1] = sent[1].at[cls].add(leg.recv_sizes)

    expected = jnp.sum(pairs[:, me])
    handle = EPHandle(
        config=cfg,
        plan=plan.kind,
        group_sizes=group_sizes,
        num_recv_tokens=num_recv.astype(i32)[None],
        num_dropped=(expected - jnp.sum(group_sizes)).astype(i32)[None],
        num_invalid=layout.num_invalid[None],
        traffic=jnp.stack([tok[me], kept[:, me]]),
        link_rows=jnp.stack(sent),
        token_send_row=moved["token_send_row"],
        legs=moved["legs"],
        forward_row=moved.get("forward_row"),
        recv_weights=recv_w,
        recv_pos=recv_pos,
        expert_token=expert_token,
    )
    if cfg.overflow == "raise":
        handle = _runtime_check(handle)
    return expert_x, handle


def _pack(in_dest, starts, rows: int):
    """Order items by destination: ``in_dest`` ``(I, P)`` bool (item ``i`` goes to member ``p``),
    ``starts`` ``(P,)`` first row of each member's block. Returns ``(item, dest, row)``:
    ``item``/``dest`` ``(rows,)`` (``I``/``P`` past the used rows), ``row`` ``(I, P)`` the send row
    of each (item, member) or -1. Blocks keep item order."""
    I, P = in_dest.shape
    i32 = jnp.int32
    row_in_block = jnp.cumsum(in_dest, axis=0, dtype=i32) - 1
    row = jnp.where(in_dest, starts[None, :] + row_in_block, -1)
    i_idx = jnp.broadcast_to(jnp.arange(I, dtype=i32)[:, None], (I, P))
    p_idx = jnp.broadcast_to(jnp.arange(P, dtype=i32)[None, :], (I, P))
    to = jnp.where(in_dest, row, rows + i_idx * P + p_idx).reshape(-1)  # unique; OOB drops
    item = jnp.full((rows,), I, i32).at[to].set(i_idx.reshape(-1), mode="drop",
                                               unique_indices=True)
    dest = jnp.full((rows,), P, i32).at[to].set(p_idx.reshape(-1), mode="drop",
                                               unique_indices=True)
    return item, dest, row


def _send_buffer(x, route, item, dest, slot_dest, K):
    """Rows ``x[item]`` with their routing masked to the slots whose destination
    (``slot_dest[item]``, ``(rows, K)``) is the row's ``dest`` (weight 0 and id -1 elsewhere)."""
    src = jnp.minimum(item, x.shape[0] - 1)
    ok = (slot_dest[src] == dest[:, None]) & (item < x.shape[0])[:, None]
    r = route[src]
    return jnp.take(x, src, axis=0), jnp.concatenate(
        [jnp.where(ok, r[:, :K], 0.0), jnp.where(ok, r[:, K:], -1.0)], axis=1)


def _exchange(cfg, stage, leg, operand, rows, segment_rows, what, reverse=False):
    """One leg (or its reverse) of ``stage`` into a fresh zero buffer of ``rows`` rows."""
    out = jnp.zeros((rows, *operand.shape[1:]), operand.dtype)
    args = ((leg.recv_offsets, leg.recv_sizes, leg.peer_input_offsets, leg.send_sizes) if reverse
            else (leg.input_offsets, leg.send_sizes, leg.output_offsets, leg.recv_sizes))
    return _ragged_all_to_all(operand, out, *args, axis_name=stage.axis_name,
                              axis_index_groups=stage.groups, backend=cfg.backend,
                              max_segment_rows=segment_rows, label=what, tag=cfg.fingerprint)


def _move(cfg, stage, leg, x, route, rows, segment_rows, what):
    """Dispatch's two exchanges of one leg: token rows, then their routing (float32)."""
    return (_exchange(cfg, stage, leg, x, rows, segment_rows, f"dispatch ({what}tokens)"),
            _exchange(cfg, stage, leg, route, rows, segment_rows, f"dispatch ({what}routing)"))


def _flat_dispatch(cfg, plan, x, route, dest, tok, kept, me):
    T, K, n = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks
    R = cfg.recv_token_rows
    send_starts = _exclusive_cumsum(tok, axis=1)  # row of s's send buffer where d's block starts
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(n, dtype=jnp.int32), axis=1)  # (T, n)
    item, to, send_row = _pack(in_rank, send_starts[me], cfg.send_rows)
    send_x, send_route = _send_buffer(x, route, item, to, dest, K)
    leg = _leg(kept, send_starts, me, jnp.arange(n, dtype=jnp.int32))
    recv_x, recv_route = _move(cfg, plan.stages[0], leg, send_x, send_route, R, T, "")
    return dict(x=recv_x, route=recv_route, flat_to_buf=None,
                legs=(leg,), token_send_row=_first_rows(dest, send_row, n))


def _first_rows(dest, send_row, P):
    """``(T, K)`` send row of slot ``k`` when it is the first of its token's slots to its
    destination (``dest`` in ``[0, P)``; ``P`` = not routed), else -1."""
    first = (dest < P) & ~repeats_earlier(dest)
    return jnp.where(first, jnp.take_along_axis(send_row, jnp.minimum(dest, P - 1), 1), -1)


def _hierarchical_dispatch(cfg, plan, x, route, node, in_node, kept, node_tok, me):
    T, K, n, L = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks, cfg.experts_per_rank
    R = cfg.recv_token_rows
    N, G = plan.shape
    i32 = jnp.int32
    a0, l0 = me // G, me % G
    stage1, stage2 = plan.stages

    # Stage 1: each token once per destination node, to the rank with this local index there.
    M1 = node_tok.reshape(N, G, N)[:, l0, :]  # [a, b]: tokens (a, l0) -> node b
    starts1 = _exclusive_cumsum(M1, axis=1)
    item, to, send_row = _pack(in_node, starts1[a0], T * min(K, N))
    send_x, send_route = _send_buffer(x, route, item, to, node, K)
    leg1 = _leg(M1, starts1, a0, jnp.arange(N, dtype=i32) * G + l0)
    R1 = N * T
    fx, froute = _move(cfg, stage1, leg1, send_x, send_route, R1, T, "stage 1 ")

    # Stage 2: forward each received token to the ranks of this node holding its experts, in
    # stage-1 order (source node, token), only the ones that fit there (the flat plan's rule).
    kept4 = kept.reshape(N, G, N, G)  # [a, l, b, l']
    F = jnp.sum(kept4[:, :, a0, :], axis=0)  # [l, l']: rows (a0, l) -> (a0, l')
    rows1 = jnp.arange(R1, dtype=i32)
    arrived = jnp.sum(M1[:, a0])
    src_node = jnp.searchsorted(jnp.cumsum(M1[:, a0]), rows1, side="right").astype(i32)
    gid = froute[:, K:].astype(i32)  # global ids routed to this node, -1 elsewhere
    target = jnp.where(gid >= 0, gid // L - a0 * G, G)  # local rank of each slot, G: none
    hits = jnp.any(target[:, :, None] == jnp.arange(G, dtype=i32), axis=1)  # (R1, G)
    hits = hits & (rows1 < arrived)[:, None]
    excl = jnp.cumsum(hits, axis=0, dtype=i32) - hits
    block_start = leg1.recv_offsets[jnp.minimum(src_node, N - 1)]
    j = excl - jnp.take(excl, jnp.minimum(block_start, R1 - 1), axis=0)  # index in its block
    src_rank = jnp.minimum(src_node, N - 1) * G + l0
    limit = kept[src_rank][:, a0 * G + jnp.arange(G)]  # (R1, G) what each destination keeps
    fwd = hits & (j < limit)
    starts2 = _exclusive_cumsum(F, axis=1)
    item2, to2, forward_row = _pack(fwd, starts2[l0], R1 * min(K, G))
    send2_x, send2_route = _send_buffer(fx, froute, item2, to2, target, K)
    leg2 = _leg(F, starts2, l0, a0 * G + jnp.arange(G, dtype=i32))
    rx, rroute = _move(cfg, stage2, leg2, send2_x, send2_route, R, R1, "stage 2 ")

    # Where each flat-order row (source rank s, token) sits in the stage-2 receive buffer:
    # forwarder l's block, then source nodes in order.
    kin = kept[:, me].reshape(N, G)  # [a, l]: rows from (a, l) kept here
    st2 = (leg2.recv_offsets[None, :] + _exclusive_cumsum(kin, axis=0)).reshape(n)
    flat_start = _exclusive_cumsum(kept[:, me])
    q = jnp.arange(R, dtype=i32)
    s_of_q = jnp.minimum(jnp.searchsorted(jnp.cumsum(kept[:, me]), q, side="right"), n - 1)
    flat_to_buf = st2[s_of_q] + q - flat_start[s_of_q]
    return dict(x=rx, route=rroute, flat_to_buf=flat_to_buf.astype(i32), legs=(leg1, leg2),
                forward_row=forward_row, token_send_row=_first_rows(node, send_row, N))


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
      accumulated in float32. Flat plan: each rank sums its experts' outputs (k in order) and the
      source adds the per-rank partial sums in order of first choice. Hierarchical plan: the node's
      forwarding rank adds its ranks' partial sums (local rank in order), sends one row per token
      back, and the source adds the per-node sums; the result equals the flat plan's up to float32
      reassociation (and, with a 16-bit combine dtype, one extra rounding of the node sums).
      Pairs with id -1 (or dropped) contribute nothing.
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
    C, T, K = cfg.expert_rows, cfg.tokens_per_rank, cfg.topk
    wire = jnp.dtype(cfg.combine_dtype) if cfg.combine_dtype else expert_y.dtype
    plan = plans.replay(cfg, handle.plan, api)

    # Receiver: weighted sum over this rank's experts of each received token.
    partial = _gather_sum(expert_y, handle.recv_pos, handle.recv_pos < C, handle.recv_weights)
    if handle.plan == "flat":
        back = _exchange(cfg, plan.stages[0], handle.legs[0], partial.astype(wire),
                         cfg.send_rows, T, "combine", reverse=True)
    else:
        N, G = plan.shape
        leg1, leg2 = handle.legs
        # Stage 2 backwards: one partial per (token, rank) to the node's forwarding rank, which
        # sums them: one row per token and node.
        back2 = _exchange(cfg, plan.stages[1], leg2, partial.astype(wire),
                          N * T * min(K, G), N * T, "combine (stage 2)", reverse=True)
        node_sum = _gather_sum(back2, handle.forward_row, handle.forward_row >= 0)
        back = _exchange(cfg, plan.stages[0], leg1, node_sum.astype(wire), T * min(K, N), T,
                         "combine (stage 1)", reverse=True)
    # Source: sum the partials of each token's ranks (or nodes), in order of first choice.
    y = _gather_sum(back, handle.token_send_row, handle.token_send_row >= 0)
    return y.astype(expert_y.dtype)
