"""The routes of dispatch: how token rows and their routing reach the ranks holding their experts.

A plan is a sequence of legs (:class:`Leg`: one rank's view of one ragged exchange and its
reverse). The flat plan has one leg (each token once to every rank holding one of its experts); the
hierarchical plan two (each token once per destination node, then forwarded inside the node).
Both pack their send buffers with :func:`pack` and :func:`send_buffer` and move rows with
:class:`ExchangeCall`; each returns a :class:`Route`. Combine runs the legs backwards
(``ExchangeCall(..., reverse=True)``). Routes are step generators (:func:`drive`): they yield their
exchanges, so that a driver can run them at once or overlap them with other work
(:mod:`ep_comm.pipeline`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from ep_comm.layout import repeats_earlier
from ep_comm.ragged import PendingExchange, _ragged_all_to_all, _ragged_all_to_all_start
from ep_comm import collectives
from ep_comm.collectives import barrier, row_kernels
from ep_comm.rows import gather_rows
from ep_comm.topology._jax_compat import match_vma
from ep_comm.topology.machine import LINK_CLASSES
from ep_comm.topology.traffic import link_matrix


def exclusive_cumsum(x, axis=0):
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


def make_leg(counts, send_starts, me, peers) -> Leg:
    """Rank ``me``'s :class:`Leg` from the group's ``(P, P)`` matrices: ``counts[s, d]`` rows
    member ``s`` sends member ``d``; ``send_starts[s, d]`` the first row of that block in ``s``'s
    send buffer. Receive buffers take blocks in member order."""
    recv_starts = exclusive_cumsum(counts, axis=0)
    return Leg(send_starts[me], counts[me], recv_starts[me], counts[:, me], recv_starts[:, me],
               send_starts[:, me], peers)


@dataclasses.dataclass(frozen=True)
class Route:
    """What a plan's dispatch delivered to this rank, and how it got there.

    Attributes:
      x: ``(R, H)``; token rows of the (last-stage) receive buffer.
      route: ``(R, 2K)`` float32; their routing: weights, then global expert ids (-1: not for this
        rank's node or rank).
      flat_to_buf: ``(R,)`` int32 row of the receive buffer holding each row of the flat order
        (source rank, source token), or ``None`` when that is the buffer's own order (flat plan).
      legs: the plan's exchanges, one :class:`Leg` each.
      token_send_row: ``(T, K)`` int32; ``EPHandle.token_send_row``.
      forward_row: hierarchical only: ``EPHandle.forward_row``.
    """

    x: jax.Array
    route: jax.Array
    flat_to_buf: jax.Array | None
    legs: tuple
    token_send_row: jax.Array
    forward_row: jax.Array | None


def link_rows(plan, legs, me) -> jax.Array:
    """``(2, len(LINK_CLASSES))`` int32 rows this rank sends per link class in dispatch (row 0)
    and combine (row 1: combine sends back what dispatch delivered)."""
    links = jnp.asarray(link_matrix(plan.topology))[me]  # (n,) class of the link to each rank
    classes = jnp.arange(len(LINK_CLASSES), dtype=jnp.int32)
    sent = jnp.zeros((2, classes.shape[0]), jnp.int32)
    for leg in legs:  # (a masked sum over the peers, not a scatter: scatters are slow on TPUs)
        of_class = links[leg.peers][None, :] == classes[:, None]  # (class, peer)
        sizes = jnp.stack([leg.send_sizes, leg.recv_sizes]).astype(jnp.int32)  # (2, peer)
        sent = sent + jnp.sum(jnp.where(of_class[None], sizes[:, None, :], 0), axis=2,
                              dtype=jnp.int32)
    return sent


def pack(in_dest, starts, rows: int):
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


def send_buffer(x, route, item, dest, row, slot_dest, K):
    """Rows ``x[item]`` (unspecified past the used rows) with their routing masked to the slots whose
    destination (``slot_dest[item]``, ``(rows, K)``) is the row's ``dest`` (weight 0 and id -1
    elsewhere); ``item``, ``dest``, ``row`` as :func:`pack` returns them (``row`` is the gather's
    inverse: its transpose gathers each item's send rows)."""
    src = jnp.minimum(item, x.shape[0] - 1)
    ok = (slot_dest[src] == dest[:, None]) & (item < x.shape[0])[:, None]
    r = route[src]
    return gather_rows(x, item, row, fill=False), jnp.concatenate(
        [jnp.where(ok, r[:, :K], 0.0), jnp.where(ok, r[:, K:], -1.0)], axis=1)


@dataclasses.dataclass(frozen=True)
class ExchangeCall:
    """One ragged exchange a step function (a generator: :func:`drive`) asks its driver to run:
    one leg of ``stage`` (or its reverse) into a fresh buffer of ``rows`` rows."""

    cfg: object
    stage: object
    leg: Leg
    operand: jax.Array
    rows: int
    segment_rows: int
    what: str
    reverse: bool = False

    def call_args(self):
        """The ragged all-to-all's arguments and keywords: the output buffer is typed varying like
        ``operand`` (the result differs per rank); rows no segment covers are unspecified (not
        written on GPUs): every reader masks them."""
        op, leg = self.operand, self.leg
        out = match_vma(row_kernels.empty((self.rows, *op.shape[1:]), op.dtype), op)
        idx = ((leg.recv_offsets, leg.recv_sizes, leg.peer_input_offsets, leg.send_sizes)
               if self.reverse else
               (leg.input_offsets, leg.send_sizes, leg.output_offsets, leg.recv_sizes))
        return (op, out, *idx), dict(axis_name=self.stage.axis_name,
                                     axis_index_groups=self.stage.groups,
                                     backend=self.cfg.backend,
                                     max_segment_rows=self.segment_rows, label=self.what,
                                     tag=self.cfg.fingerprint)

    def run(self):
        """The exchange, start and done fused (differentiable)."""
        args, kw = self.call_args()
        return _ragged_all_to_all(*args, **kw)

    def start(self) -> PendingExchange:
        """The exchange issued (on the nccl transport it runs on the engine's stream until
        :func:`ep_comm.ragged.ragged_all_to_all_done`; the others complete here). Not
        differentiable."""
        args, kw = self.call_args()
        return _ragged_all_to_all_start(*args, **kw)


def drive(steps):
    """Run a step generator to its end and return its value. A step generator yields tuples of
    :class:`ExchangeCall` and is sent back their results (a tuple, in order); here each is run at
    once (differentiable). :mod:`ep_comm.pipeline` drives the same generators with the
    exchanges started and finished around other work."""
    try:
        requests = next(steps)
        while True:
            requests = steps.send(tuple(r.run() for r in requests))
    except StopIteration as stop:
        return stop.value


def gather_counts(cfg, v, what):
    """``lax.all_gather(v, cfg.axis_name)`` of a small int32 vector: ``(n, len(v))``, identical on
    every rank. With the mpi transport it goes through the engine's own exchange instead, so that
    it joins that transport's chain of exchanges and its timeout; otherwise it is an XLA
    collective, behind :mod:`ep_comm.collectives.barrier` between CPU processes (gloo has no timeout)."""
    v = v.astype(jnp.int32)
    if cfg.num_ranks == 1:  # nothing to gather: no collective in the program (as routes.is_local)
        return v[None]
    if collectives.resolve_transport(cfg.backend, caller=what)[0] != "mpi":
        return barrier.guard(f"{what} (counts)", cfg.axis_name,
                             lambda a: jax.lax.all_gather(a, cfg.axis_name), v)
    n, m = cfg.num_ranks, v.shape[0]
    me = jax.lax.axis_index(cfg.axis_name)
    i32 = jnp.int32
    out = _ragged_all_to_all(
        v[:, None], match_vma(row_kernels.empty((n * m, 1), jnp.int32), v),
        jnp.zeros((n,), i32), jnp.full((n,), m, i32), jnp.full((n,), me * m, i32),
        jnp.full((n,), m, i32), axis_name=cfg.axis_name, backend=cfg.backend,
        max_segment_rows=m, label=f"{what} (counts)", tag=cfg.fingerprint)
    return out.reshape(n, m)


def _move(cfg, stage, leg, x, route, rows, segment_rows, what):
    """Dispatch's two exchanges of one leg (token rows, then their routing as float32), yielded
    together; returns what they delivered."""
    return (yield (ExchangeCall(cfg, stage, leg, x, rows, segment_rows, f"dispatch ({what}tokens)"),
                   ExchangeCall(cfg, stage, leg, route, rows, segment_rows,
                            f"dispatch ({what}routing)")))


def flat_route(cfg, plan, x, route, dest, in_rank, first, tok, kept, me):
    """Each token once to every rank holding one of its experts (one leg). ``in_rank``,
    ``first``: the token routes' (``ep_comm.layout.placement_routes``). A step generator
    (:func:`drive`) returning the :class:`Route`."""
    T, K, n = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks
    R = cfg.recv_token_rows
    send_starts = exclusive_cumsum(tok, axis=1)  # row of s's send buffer where d's block starts
    item, to, send_row = pack(in_rank, send_starts[me], cfg.send_rows)
    send_x, send_route = send_buffer(x, route, item, to, send_row, dest, K)
    leg = make_leg(kept, send_starts, me, jnp.arange(n, dtype=jnp.int32))
    recv_x, recv_route = yield from _move(cfg, plan.stages[0], leg, send_x, send_route, R, T, "")
    return Route(recv_x, recv_route, None, (leg,), first_rows(dest, send_row, n, first), None)


def is_local(cfg, plan_kind: str) -> bool:
    """Whether dispatch moves nothing between ranks: one rank (flat plan) with room for every
    token. Then the receive buffer is the token rows themselves (:func:`local_route`) and combine
    has no exchange to run back. ``EP_COMM_LOCAL_EXCHANGE=1`` (read when a program is traced)
    makes one rank run its exchanges through the transport anyway (a self-exchange): benchmarks on
    one GPU use it to time what dispatch, combine and the layer's overlap cost once there are
    peers."""
    return (plan_kind == "flat" and cfg.num_ranks == 1
            and cfg.recv_token_rows >= cfg.tokens_per_rank
            and os.environ.get("EP_COMM_LOCAL_EXCHANGE", "0") != "1")


def local_route(cfg, x, route, first, tok, kept) -> Route:
    """The flat route when :func:`is_local`: no pack and no exchange (a self-copy), the receive
    buffer is ``x`` itself, row ``t`` token ``t``, and its routing the token routes' (every
    valid slot is this rank's; the others carry weight 0 and id -1); so dispatch's expand is the
    only pass over the rows. ``first``: the token routes' first slot per rank. The leg still
    describes the (self) traffic, for ``link_rows``; the handle carries no legs (combine has
    nothing to reverse)."""
    T = cfg.tokens_per_rank
    leg = make_leg(kept, exclusive_cumsum(tok, axis=1), 0, jnp.zeros((1,), jnp.int32))
    token_send_row = jnp.where(first, jnp.arange(T, dtype=jnp.int32)[:, None], -1)
    return Route(x, route, None, (leg,), token_send_row, None)


def first_rows(dest, send_row, P, first=None):
    """``(T, K)`` send row of slot ``k`` when it is the first of its token's slots to its
    destination (``dest`` in ``[0, P)``; ``P`` = not routed; ``first``: that mask when known),
    else -1."""
    if first is None:
        first = (dest < P) & ~repeats_earlier(dest)
    return jnp.where(first, jnp.take_along_axis(send_row, jnp.minimum(dest, P - 1), 1), -1)


def hierarchical_route(cfg, plan, x, route, node, in_node, kept, node_tok, me):
    """Each token once per destination node (stage 1), then forwarded inside the node to the
    ranks holding its experts (stage 2). A step generator (:func:`drive`, one yield per stage)
    returning the :class:`Route`."""
    T, K, n, L = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks, cfg.experts_per_rank
    R = cfg.recv_token_rows
    N, G = plan.shape
    i32 = jnp.int32
    a0, l0 = me // G, me % G
    stage1, stage2 = plan.stages

    # Stage 1: each token once per destination node, to the rank with this local index there.
    M1 = node_tok.reshape(N, G, N)[:, l0, :]  # [a, b]: tokens (a, l0) -> node b
    starts1 = exclusive_cumsum(M1, axis=1)
    item, to, send_row = pack(in_node, starts1[a0], T * min(K, N))
    send_x, send_route = send_buffer(x, route, item, to, send_row, node, K)
    leg1 = make_leg(M1, starts1, a0, jnp.arange(N, dtype=i32) * G + l0)
    R1 = N * T
    fx, froute = yield from _move(cfg, stage1, leg1, send_x, send_route, R1, T, "stage 1 ")

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
    starts2 = exclusive_cumsum(F, axis=1)
    item2, to2, forward_row = pack(fwd, starts2[l0], R1 * min(K, G))
    send2_x, send2_route = send_buffer(fx, froute, item2, to2, forward_row, target, K)
    leg2 = make_leg(F, starts2, l0, a0 * G + jnp.arange(G, dtype=i32))
    rx, rroute = yield from _move(cfg, stage2, leg2, send2_x, send2_route, R, R1, "stage 2 ")

    # Where each flat-order row (source rank s, token) sits in the stage-2 receive buffer:
    # forwarder l's block, then source nodes in order.
    kin = kept[:, me].reshape(N, G)  # [a, l]: rows from (a, l) kept here
    st2 = (leg2.recv_offsets[None, :] + exclusive_cumsum(kin, axis=0)).reshape(n)
    flat_start = exclusive_cumsum(kept[:, me])
    q = jnp.arange(R, dtype=i32)
    s_of_q = jnp.minimum(jnp.searchsorted(jnp.cumsum(kept[:, me]), q, side="right"), n - 1)
    flat_to_buf = st2[s_of_q] + q - flat_start[s_of_q]
    return Route(rx, rroute, flat_to_buf.astype(i32), (leg1, leg2), first_rows(node, send_row, N),
                 forward_row)
