"""Plain JAX, as a user writes it without ep_comm: the peers the benchmarks time ep_comm against
in the same run (``ep_comm.bench``, ``ep_comm.layer_bench``).

One rank's work only (no exchange): the (token, expert) pairs sorted by expert with an argsort
and gathered (MaxText's and most JAX MoE code's permute), gathered back and summed with the
router weights (unpermute), and the MoE layer built from them with ``jax.lax.ragged_dot`` (or
any grouped GEMM with its signature) and autodiff's gradients.
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


def moe_layer(x, topk_ids, topk_weights, w_in, w_out, gemm=jax.lax.ragged_dot):
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
