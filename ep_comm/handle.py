"""The handle dispatch returns and combine consumes (:class:`EPHandle`), and what it says about
bytes on the wire (:func:`link_bytes`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ep_comm.config import EPConfig
from ep_comm.topology._checks import positive_int
from ep_comm.topology.traffic import row_bytes as _traffic_row_bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EPHandle:
    """What dispatch learned, consumed by :func:`combine`. One rank's view inside ``shard_map``.

    Shapes use ``T = tokens_per_rank``, ``K = topk``, ``n = num_ranks``,
    ``R = config.recv_token_rows``, ``C = config.expert_rows`` and ``L = experts_per_rank``; for
    the hierarchical plan ``N`` nodes of ``G`` ranks. Every leaf has a leading axis, so
    ``out_specs=P(axis_name)`` returns a whole handle from ``shard_map`` (per-rank values stacked).

    Attributes:
      config: the static :class:`EPConfig`.
      plan: ``"flat"`` or ``"hierarchical"`` (static; what ``config.plan`` resolved to).
      group_sizes: ``(L,)`` int32; rows of ``expert_x`` per local expert, in order, contiguous
        from row 0. Rows past ``sum(group_sizes)`` are ignored by combine (their values: see
        ``EPConfig.zero_fill``).
      num_recv_tokens: ``(1,)`` int32; tokens received (rows of the token receive buffer used).
      num_dropped: ``(1,)`` int32; (token, expert) pairs destined to this rank that did not fit
        ``recv_capacity``. Always 0 with the default (worst-case) capacity.
      num_invalid: ``(1,)`` int32; expert ids of this rank's tokens outside ``[-1, num_experts)``
        (not routed).
      first_invalid: ``(4,)`` int32; ``[count, token, k, value]`` of this rank's first such id in
        ``topk_ids`` (row-major; ``[0, -1, -1, 0]`` when there is none): what
        :func:`ep_comm.check` names.
      traffic: ``(2, n)`` int32; row 0: tokens this rank sends to each rank (before capacity
        clipping), row 1: tokens it receives from each rank (after clipping), whatever the plan.
      link_rows: ``(2, len(topology.LINK_CLASSES))`` int32; rows this rank sends over each link
        class (``self``, ``nvlink``, ``pcie``, ``network``) in dispatch (row 0; each row carries
        ``H`` elements of ``x`` and ``2K`` float32 of routing) and in combine (row 1; ``H``
        elements of the combine dtype). :func:`link_bytes` turns them into bytes.
      token_send_row: ``(T, K)`` int32; row of this rank's (first-stage) send buffer carrying
        pair ``(t, k)`` when ``k`` is the first of ``t``'s choices on that rank (flat) or node
        (hierarchical), else -1. Combine sums over these.
      legs: the exchanges of the plan (one ``ep_comm.routes.Leg`` for flat; stage 1 then stage 2
        for hierarchical); ``()`` when dispatch exchanged nothing (one rank with room for every
        token: ``ep_comm.routes.is_local``).
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
    first_invalid: jax.Array
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
    positive_int("link_bytes", "hidden", hidden)
    dispatch_row, combine_row = row_bytes(handle.config, hidden, dtype)
    per_row = jnp.array([dispatch_row, combine_row], jnp.float32)[:, None]
    return handle.link_rows.astype(jnp.float32) * per_row


def row_bytes(cfg: EPConfig, hidden: int, dtype) -> tuple[int, int]:
    """Bytes of one dispatch row (token + routing) and of one combine row (partial sum)."""
    return _traffic_row_bytes(hidden, dtype, cfg.topk, cfg.combine_dtype, cfg.wire_format)
