"""``dispatch_layout``: who sends what where, from the router's top-k expert ids."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm.collectives import row_kernels
from ep_comm.placement import ExpertPlacement


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Per-rank routing layout (DeepEP ``get_dispatch_layout`` semantics).

    Attributes:
      num_tokens_per_rank: ``(num_ranks,)`` int32; tokens that go to each rank (a token counts once
        per rank however many of its experts that rank holds).
      num_tokens_per_expert: ``(num_experts,)`` int32; tokens per expert (a token that lists the
        same expert twice counts once: dispatch merges such duplicates into one expert row whose
        output is weighted by the sum of their weights).
      is_token_in_rank: ``(T, num_ranks)`` bool; whether token ``t`` goes to rank ``r``.
      num_pairs_per_rank: ``(num_ranks,)`` int32; distinct (token, expert) pairs per destination
        rank: the expert rows that rank needs for this rank's tokens.
      num_invalid: ``()`` int32; ids outside ``[-1, num_experts)`` (they are not routed; dispatch
        counts them in its handle and :func:`ep_comm.check` reports them).
    """

    num_tokens_per_rank: jax.Array
    num_tokens_per_expert: jax.Array
    is_token_in_rank: jax.Array
    num_pairs_per_rank: jax.Array
    num_invalid: jax.Array


def check_topk_ids(api_name: str, topk_ids, tokens: int | None = None, topk: int | None = None):
    """Validate a ``(T, topk)`` integer id array; return it as a jax array."""
    topk_ids = jnp.asarray(topk_ids)
    if not jnp.issubdtype(topk_ids.dtype, np.integer) or topk_ids.ndim != 2:
        raise ValueError(f"{api_name}: topk_ids must be an integer array of shape (tokens, topk), "
                         f"got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    want = (tokens if tokens is not None else topk_ids.shape[0],
            topk if topk is not None else topk_ids.shape[1])
    if tuple(topk_ids.shape) != want:
        raise ValueError(f"{api_name}: topk_ids must have shape (tokens, topk) = {want}, "
                         f"got {tuple(topk_ids.shape)}")
    return topk_ids


def repeats_earlier(ids):
    """``(.., K)`` bool: True where the id also appears at an earlier k of the same row."""
    same = ids[..., :, None] == ids[..., None, :]
    return jnp.any(jnp.tril(same, k=-1), axis=-1)


def dispatch_layout(topk_ids, *, num_experts: int, num_ranks: int) -> DispatchLayout:
    """Count, for one rank's tokens, how many go to each rank and expert.

    Args:
      topk_ids: ``(T, topk)`` integer expert ids; ``-1`` means "no expert" and is skipped.
      num_experts: total experts, placed in contiguous blocks of ``num_experts // num_ranks``.
      num_ranks: expert-parallel size.

    Works anywhere (inside or outside ``shard_map``): it is local to the calling rank.
    """
    placement = ExpertPlacement(num_experts, num_ranks)
    ids = check_topk_ids("dispatch_layout", topk_ids).astype(jnp.int32)
    return layout_of(ids, placement_routes(ids, jnp.zeros(ids.shape, jnp.float32), placement),
                     placement)


def placement_routes(topk_ids, topk_weights, placement: ExpertPlacement):
    """:func:`ep_comm.collectives.row_kernels.token_routes` for a placement (one kernel on GPUs)."""
    return row_kernels.token_routes(topk_ids, topk_weights, num_experts=placement.num_experts,
                                    num_ranks=placement.num_ranks)


def layout_of(ids, routes, placement: ExpertPlacement) -> DispatchLayout:
    """The :class:`DispatchLayout` of validated ids ``(T, K)`` int32 and their token routes (the
    per-expert counts, which dispatch does not use, from the ids)."""
    E = placement.num_experts
    distinct = (ids >= 0) & (ids < E) & ~repeats_earlier(ids)
    per_expert = jnp.bincount(jnp.where(distinct, ids, E).reshape(-1), length=E + 1)[:E]
    return DispatchLayout(
        num_tokens_per_rank=routes.tokens_per_rank,
        num_tokens_per_expert=per_expert.astype(jnp.int32),
        is_token_in_rank=routes.in_rank,
        num_pairs_per_rank=routes.pairs_per_rank,
        num_invalid=routes.num_invalid,
    )
