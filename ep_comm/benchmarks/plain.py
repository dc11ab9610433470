"""Plain JAX, as a user writes it without ep_comm: the peers the benchmarks time ep_comm against
in the same run (``ep_comm.benchmarks.dispatch``, ``ep_comm.benchmarks.layer``).

One rank's work only (no exchange): the (token, expert) pairs sorted by expert with an argsort
and gathered (MaxText's and most JAX MoE code's permute), gathered back and summed with the
router weights (unpermute), and the MoE layer built from them with ``jax.lax.ragged_dot`` (or
any grouped GEMM with its signature) and autodiff's gradients.

Across ranks (:func:`ep_permute`, :func:`ep_unpermute`): the same job as ep_comm's dispatch and
combine written in plain JAX with the collective every platform has, ``lax.all_to_all``: each
token once per destination rank into that rank's slot of ``T`` rows (the dropless bound), one
padded exchange of the rows and one of their routing, an argsort by local expert on the receiver;
back: a weighted segment sum per received token, the reverse exchange, a masked sum per token.
That is ep_comm's portable transport's wire volume, without its counting, handles and checks: the
peer its dispatch and combine are timed against on CPUs (``ep_comm.benchmarks.dispatch``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def permute(x, topk_ids):
    """``(x_sorted, order)``: ``x``'s rows once per (token, slot) pair, sorted stably by expert
    (``(T * K, H)``), and the pairs' order (``argsort`` of the flattened ids)."""
    K = topk_ids.shape[1]
    order = jnp.argsort(topk_ids.reshape(-1), stable=True)
    return jnp.take(x, order // K, axis=0), order


def unpermute(y_sorted, order, topk_weights, dtype=None):
    """``y[t] = sum_k w[t, k] * y_sorted[position of pair (t, k)]`` in float32, as ``dtype``
    (default: ``y_sorted``'s)."""
    T, K = topk_weights.shape
    back = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(T, K, -1)
    y = jnp.sum(back.astype(jnp.float32) * topk_weights[:, :, None].astype(jnp.float32), axis=1)
    return y.astype(dtype or y_sorted.dtype)


def round_trip(x, topk_ids, topk_weights):
    """:func:`permute` then :func:`unpermute` with identity experts."""
    xs, order = permute(x, topk_ids)
    return unpermute(xs, order, topk_weights)


def plain_layer(x, topk_ids, topk_weights, w_in, w_out, gemm=jax.lax.ragged_dot):
    """One rank's SwiGLU MoE layer over all ``E`` experts (``w_in`` ``(E, H, 2I)``, ``w_out``
    ``(E, I, H)``): :func:`permute`, ``bincount`` group sizes, two grouped GEMMs, :func:`unpermute`.
    Ids must lie in ``[0, E)``."""
    from ep_comm.layer import swiglu  # (the same activation as ep_comm's experts)
    E, inter = w_out.shape[0], w_out.shape[1]
    xs, order = permute(x, topk_ids)
    sizes = jnp.bincount(topk_ids.reshape(-1), length=E).astype(jnp.int32)
    u = gemm(xs, w_in, sizes)
    y = gemm(swiglu(u, inter), w_out, sizes)
    return unpermute(y, order, topk_weights, x.dtype)


def ep_permute(x, topk_ids, topk_weights, *, axis_name: str, num_experts: int, rows: int):
    """Plain-JAX dropless expert-parallel dispatch (inside ``shard_map`` over ``axis_name``):
    ``(expert_x, group_sizes, state)``. ``expert_x`` ``(rows, H)`` holds this rank's received
    (token, local expert) pairs sorted by local expert (pairs past ``rows`` are cut, rows past the
    pairs are unspecified); ``state`` is what :func:`ep_unpermute` needs."""
    T, K = topk_ids.shape
    n = jax.lax.axis_size(axis_name)
    L = num_experts // n
    me = jax.lax.axis_index(axis_name)
    i32 = jnp.int32
    ranks = jnp.arange(n, dtype=i32)
    in_rank = jnp.any((topk_ids // L)[:, :, None] == ranks, axis=1)  # (T, n)
    slot = jnp.where(in_rank, ranks[None] * T + jnp.cumsum(in_rank, 0, dtype=i32) - 1, n * T)
    src = jnp.full((n * T,), T, i32).at[slot.T.reshape(-1)].set(
        jnp.tile(jnp.arange(T, dtype=i32), n), mode="drop")  # token of each slot row, T: none
    pad = lambda a, v: jnp.concatenate([a, jnp.full((1, a.shape[1]), v, a.dtype)])[src]  # noqa
    a2a = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)  # noqa: E731
    recv_x, recv_ids, recv_w = a2a(pad(x, 0)), a2a(pad(topk_ids, -1)), a2a(pad(topk_weights, 0))
    local = recv_ids - me * L
    key = jnp.where((local >= 0) & (local < L), local, L).reshape(-1)  # (n T K,)
    order = jnp.argsort(key, stable=True)[:rows].astype(i32)
    sizes = jnp.bincount(key, length=L + 1)[:L].astype(i32)
    valid = jnp.arange(rows) < jnp.sum(sizes)
    return (jnp.take(recv_x, order // K, axis=0), sizes,
            (order, valid, recv_w.reshape(-1), in_rank, slot))


def ep_unpermute(expert_y, state, *, axis_name: str):
    """Plain-JAX combine of :func:`ep_permute`'s pairs: ``y[t] = sum_k w[t, k] * expert_y[pair
    (t, k)]`` summed in float32, as ``expert_y``'s dtype."""
    order, valid, recv_w, in_rank, slot = state
    T, n = in_rank.shape
    K = recv_w.shape[0] // (n * T)
    w = jnp.where(valid, jnp.take(recv_w, order), 0.0)
    partial = jax.ops.segment_sum(expert_y.astype(jnp.float32) * w[:, None], order // K,
                                  num_segments=n * T)  # one row per received token
    back = jax.lax.all_to_all(partial, axis_name, 0, 0, tiled=True)
    got = jnp.take(back, jnp.minimum(slot, n * T - 1), axis=0)  # (T, n, H)
    return jnp.sum(jnp.where(in_rank[:, :, None], got, 0.0), axis=1).astype(expert_y.dtype)


def ep_round_trip(x, topk_ids, topk_weights, *, axis_name: str, num_experts: int, rows: int):
    """:func:`ep_permute` then :func:`ep_unpermute` with identity experts."""
    expert_x, _, state = ep_permute(x, topk_ids, topk_weights, axis_name=axis_name,
                                    num_experts=num_experts, rows=rows)
    return ep_unpermute(expert_x, state, axis_name=axis_name)
