"""Group-limited (node-limited) top-k routing, as in DeepSeek-V3.

DeepSeek-V3 bounds the nodes a token reaches: experts are split into ``num_groups`` equal groups
(one per node when experts are placed node by node, which ep_comm's contiguous placement over a
node-major expert-parallel axis does), each group is scored by the sum of its best
``group_score_topk`` expert scores, the ``topk_groups`` best groups are kept and the ``topk``
experts are chosen among theirs. A token then reaches at most ``topk_groups`` nodes, which bounds
the hierarchical plan's network traffic at ``topk_groups`` rows per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ep_comm.topology._checks import int_in_range


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Result of a router: ``topk_ids`` ``(T, topk)`` int32 expert ids (best first) and
    ``topk_weights`` ``(T, topk)``: the scores of those experts (without ``bias``), in the
    scores' dtype, normalised to sum to 1 per token when asked."""

    topk_ids: jax.Array
    topk_weights: jax.Array


def group_limited_topk(scores, topk: int, *, num_groups: int, topk_groups: int,
                       group_score_topk: int = 2, bias=None, normalize: bool = False) -> Routing:
    """DeepSeek-V3 group-limited top-k.

    Args:
      scores: ``(T, E)`` floating router scores (DeepSeek-V3: sigmoid of the logits). Higher is
        better.
      topk: experts per token.
      num_groups: groups of ``E // num_groups`` consecutive experts (e.g. one per node).
      topk_groups: groups a token may use (DeepSeek-V3: 4 of 8).
      group_score_topk: a group's score is the sum of its best this-many expert scores
        (DeepSeek-V3: 2).
      bias: optional ``(E,)`` per-expert bias added to the scores for the *selection* only
        (DeepSeek-V3's auxiliary-loss-free load balancing); weights use the raw scores.
      normalize: divide the weights by their sum per token.

    Returns:
      :class:`Routing`. Differentiable with respect to ``scores`` (through the weights).
    """
    api = "group_limited_topk"
    scores = jnp.asarray(scores)
    if scores.ndim != 2 or not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"{api}: scores must be a floating array of shape (tokens, experts), "
                         f"got {scores.dtype} {tuple(scores.shape)}")
    T, E = scores.shape
    int_in_range(api, "num_groups", num_groups, 1, E)
    if E % num_groups:
        raise ValueError(f"{api}: the {E} experts must split evenly into num_groups={num_groups} "
                         f"groups")
    per_group = E // num_groups
    int_in_range(api, "topk_groups", topk_groups, 1, num_groups)
    int_in_range(api, "group_score_topk", group_score_topk, 1, per_group)
    int_in_range(api, "topk", topk, 1, topk_groups * per_group)
    choice = scores
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (E,) or not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"{api}: bias must be a floating array of shape ({E},), got "
                             f"{bias.dtype} {tuple(bias.shape)}")
        choice = scores + bias.astype(scores.dtype)
    choice = lax.stop_gradient(choice)
    grouped = choice.reshape(T, num_groups, per_group)
    group_score = jnp.sum(lax.top_k(grouped, group_score_topk)[0], axis=-1)  # (T, groups)
    _, best_groups = lax.top_k(group_score, topk_groups)
    keep = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best_groups].set(True)
    masked = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
    _, ids = lax.top_k(masked, topk)
    ids = ids.astype(jnp.int32)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if normalize:
        w = w / jnp.sum(w, axis=1, keepdims=True)
    return Routing(ids, w)


def node_limited_topk(scores, topk: int, *, num_nodes: int, max_nodes: int, **kwargs) -> Routing:
    """:func:`group_limited_topk` with one group per node: each token reaches at most
    ``max_nodes`` of ``num_nodes`` nodes (experts placed in contiguous blocks per node).
    ``num_nodes``: e.g. ``ep_comm.topology.current().num_nodes``."""
    return group_limited_topk(scores, topk, num_groups=num_nodes, topk_groups=max_nodes, **kwargs)
