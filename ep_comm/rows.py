"""Row gathers whose transposes are gathers too.

Dispatch and combine move rows by index: the sender packs token rows into its send buffer, the
receiver expands received tokens into ``expert_x`` and sums expert outputs back per token, the
source sums the partials of a token's ranks. Left to autodiff, the transpose of each of these
gathers is a scatter-add of whole ``H``-wide rows, which on a GPU runs on atomics over colliding
rows: on one H200 such scatters took 5.3 of the 31.8 ms of a DeepSeek-shaped layer's
forward+backward. Every one of these maps has a known inverse (the rows that read a given row),
so the two ops here carry a custom VJP whose transpose is a gather over that inverse: no scatter
of rows, deterministic (a fixed summation order), float32 accumulation.

- :func:`gather_rows`: ``out[i] = table[idx[i]]`` with the inverse ``inv`` given (``inv[r]`` lists
  the ``i`` reading row ``r``); its transpose is ``masked_gather_sum`` over ``inv``.
- :func:`masked_gather_sum`: ``out[n] = sum_k ok[n, k] * w[n, k] * table[idx[n, k]]`` where each table row is
  read by at most one ``n`` (any number of its ``k``); its transpose in ``table`` is one gather of
  ``d_out`` rows scaled per row (the inverse found by a scatter of scalars, not of rows).

The row movement itself, forward and backward, is :mod:`ep_comm.collectives.row_kernels`: CUDA kernels on
GPUs, XLA elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm.collectives import row_kernels
from ep_comm.topology._jax_compat import cotangent_like


def _valid(idx, size):
    return (idx >= 0) & (idx < size)


def _take(table, idx):
    """``table[idx]`` (``idx`` of any shape), zero where ``idx`` is outside ``[0, len(table))``."""
    ok = _valid(idx, table.shape[0])
    rows = jnp.take(table, jnp.clip(idx, 0, table.shape[0] - 1), axis=0)
    return jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - ok.ndim)), rows,
                     jnp.zeros((), table.dtype))


def gather_rows(table, idx, inv, fill: bool = True):
    """``out[i] = table[idx[i]]``; where ``idx[i]`` is outside ``[0, len(table))``: zero. With
    ``fill=False``, only where ``idx[i] < 0``; rows with ``idx[i] >= len(table)`` are then
    unspecified (not written on GPUs: :func:`ep_comm.collectives.row_kernels.gather`).

    Args:
      table: ``(N, ...)``.
      idx: ``(M,)`` integer.
      inv: ``(N, J)`` integer; row ``r`` lists every ``i`` with ``idx[i] == r`` (each once; entries
        outside ``[0, M)`` are empty). The caller knows it from the same layout that made ``idx``;
        it makes the transpose ``d_table[r] = sum_j d_out[inv[r, j]]`` a gather.

    An integer ``table`` (FP8 rows as bytes on the wire) is gathered the same way; it has no
    gradient.
    """
    if fill:  # row_kernels.gather: negative indices give zero rows
        idx = jnp.where(_valid(idx, table.shape[0]), idx, -1)
    if not jnp.issubdtype(table.dtype, jnp.floating):
        return row_kernels.gather(table, idx)
    return _gather_rows(table, idx, inv)


@jax.custom_vjp
def _gather_rows(table, idx, inv):
    return row_kernels.gather(table, idx)


def _gather_rows_fwd(table, idx, inv):
    # no rows kept: the dtype and mesh axes only
    return row_kernels.gather(table, idx), (idx, inv, table[:0])


def _gather_rows_bwd(res, d_out):
    idx, inv, like = res
    d_table = masked_gather_sum(d_out, inv, _valid(inv, d_out.shape[0]), out_dtype=like.dtype)
    return cotangent_like(d_table, like), _int_zero(idx), _int_zero(inv)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _int_zero(a):
    return np.zeros(a.shape, jax.dtypes.float0)


def masked_gather_sum(table, idx, ok, weights=None, out_dtype=jnp.float32):
    """``sum_k ok[:, k] * weights[:, k] * table[idx[:, k]]`` in float32, adding k in order (a
    fixed order: deterministic), returned as ``out_dtype``. ``idx``/``ok``/``weights``:
    ``(N, K)``; masked entries may hold any index and contribute exactly zero, even where the table
    holds NaN.

    Differentiable in ``table`` and ``weights``. The transpose in ``table`` assumes each table row
    is read by at most one output row (through any number of its ``k``), which holds for every
    use in dispatch and combine (each expert row, send row or forwarded row belongs to one token).
    """
    out_dtype = jnp.dtype(out_dtype)
    if weights is None:
        return _masked_gather_sum(table, idx, ok, jnp.ones(idx.shape, jnp.float32), False, out_dtype)
    return _masked_gather_sum(table, idx, ok, weights, True, out_dtype)


def _masked_gather_sum_fwd_impl(table, idx, ok, weights, weighted, out_dtype):
    # masked slots stay exactly zero whatever their weight: the kernel skips them
    return row_kernels.gather_sum(table, jnp.where(ok, idx, -1),
                                  weights if weighted else None, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _masked_gather_sum(table, idx, ok, weights, weighted, out_dtype):
    return _masked_gather_sum_fwd_impl(table, idx, ok, weights, weighted, out_dtype)


def _masked_gather_sum_fwd(table, idx, ok, weights, weighted, out_dtype):
    return (_masked_gather_sum_fwd_impl(table, idx, ok, weights, weighted, out_dtype),
            (table, idx, ok, weights))


def _masked_gather_sum_bwd(weighted, out_dtype, res, d_out):
    table, idx, ok, weights = res
    Nt, (N, K) = table.shape[0], idx.shape
    i32 = jnp.int32
    live = ok & _valid(idx, Nt)
    # the output row reading each table row (a scatter of N*K scalars; the slots of one row
    # that read the same table row write the same value)
    n_of = jnp.broadcast_to(jnp.arange(N, dtype=i32)[:, None], (N, K))
    owner = jnp.full((Nt,), N, i32).at[jnp.where(live, idx, Nt).reshape(-1)].set(
        n_of.reshape(-1), mode="drop")
    has = owner < N
    o = jnp.minimum(owner, N - 1)
    # that row's total weight on each table row (its slots reading it), summed in k order
    q = jnp.arange(Nt, dtype=i32)[:, None]
    coef = jnp.sum(jnp.where(live[o] & (idx[o] == q), weights[o], 0.0), axis=1)
    d_table = row_kernels.gather_sum(d_out, jnp.where(has, o, -1)[:, None], coef[:, None],
                                     out_dtype=table.dtype)
    if weighted:  # d_w[n, k] = <table[idx[n, k]], d_out[n]> on live slots
        d_w = jnp.stack([
            jnp.sum(_take(table, jnp.where(live[:, k], idx[:, k], -1)).astype(jnp.float32)
                    * d_out, axis=1) for k in range(K)], axis=1).astype(weights.dtype)
    else:
        d_w = jnp.zeros_like(weights)
    return (cotangent_like(d_table, table), _int_zero(idx), _int_zero(ok),
            cotangent_like(d_w, weights))


_masked_gather_sum.defvjp(_masked_gather_sum_fwd, _masked_gather_sum_bwd)
