"""The row moves of dispatch and combine: :func:`gather`, :func:`scatter`, :func:`gather_sum` and
:func:`empty` (``collectives/csrc/row_kernels/moves.cu``)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from ep_comm.collectives.row_kernels.primitive import (lowering, poison, primitive, same_vma,
                                                       zero_tangent)

# --- gather ---------------------------------------------------------------------------------------

def gather(table, idx):
    """``table[idx]`` (rows); rows with a negative index: zero; with an index ``>= N``:
    unspecified. ``table``: ``(N, ...)``; ``idx``: ``(M,)`` integer. Returns ``(M, ...)``."""
    table = jnp.asarray(table)
    idx = jnp.asarray(idx).astype(jnp.int32)
    if table.ndim < 1 or idx.ndim != 1:
        raise ValueError(f"row_kernels.gather: table must have a row axis and idx be 1-D, got "
                         f"table {tuple(table.shape)} and idx {tuple(idx.shape)}")
    table, idx = same_vma(table, idx)
    return gather_p.bind(table, idx, kernel=lowering())


def _gather_reference(table, idx, kernel=None):
    del kernel
    n = table.shape[0]
    ok = (idx >= 0) & (idx < n)
    rows = jnp.take(table, jnp.clip(idx, 0, max(n - 1, 0)), axis=0) if n else \
        jnp.zeros((idx.shape[0], *table.shape[1:]), table.dtype)
    bcast = lambda a: a.reshape(a.shape + (1,) * (table.ndim - 1))  # noqa: E731
    other = jnp.where(bcast(idx < 0), jnp.zeros((), table.dtype), poison(table.dtype))
    return jnp.where(bcast(ok), rows, other)


def _gather_fast(table, idx, kernel=None):
    del kernel
    n = table.shape[0]
    return _take_rows(table, jnp.where(idx < 0, n, jnp.where(idx >= n, n + 1, idx)))


def _gather_abstract(table, idx, *, kernel):
    return table.update(shape=(idx.shape[0], *table.shape[1:]), weak_type=False)


def _gather_jvp(primals, tangents, *, kernel):
    table, idx = primals
    out = gather_p.bind(table, idx, kernel=kernel)
    t = tangents[0]
    if type(t) is ad.Zero:
        return out, zero_tangent(out)
    return out, gather_p.bind(ad.instantiate_zeros(t), idx, kernel=kernel)


def _gather_transpose(ct, table, idx, *, kernel):
    aval = table.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None]
    n = aval.shape[0]
    ok = (idx >= 0) & (idx < n)
    d = jnp.zeros(aval.shape, ct.dtype).at[jnp.where(ok, idx, n)].add(ct, mode="drop")
    return [d.astype(aval.dtype), None]


gather_p = primitive("ep_comm_rows_gather", _gather_reference, _gather_abstract, ("kernel",),
                      fast=_gather_fast)
ad.primitive_jvps[gather_p] = _gather_jvp
ad.primitive_transposes[gather_p] = _gather_transpose


# --- scatter --------------------------------------------------------------------------------------

def scatter(table, pos, fill, rows: int, columns=None, sources=None):
    """``(rows, ...)``: row ``pos[n, k]`` is ``table[n]`` (entries outside ``[0, rows)`` skipped),
    row ``fill[f]`` is zero (the same), every other row unspecified. A row must be the target of
    at most one entry of ``pos`` and not also be filled.
    ``table``: ``(N, ...)``; ``pos``: ``(N, K)`` integer; ``fill``: ``(F,)`` integer;
    ``columns``: ``(start, stop)``, a 2-D table's columns to move (``table[n, start:stop]``; the
    kernel, for byte tables, reads only those bytes), or None for whole rows;
    ``sources``: ``(rows,)`` integer, the inverse map when the caller knows it: the table row of
    each output row (``>= 0``), ``-1`` where it is filled, ``< -1`` where it is unspecified. It
    must agree with ``pos`` and ``fill``; the fast XLA lowering then gathers rows by it (no scatter
    at all: dispatch's layout has it from its sort), the CUDA kernel and the reference ignore it.

    Each table row is read once and written to its destinations: dispatch's expand of a received
    token into its expert rows moves exactly the compulsory bytes. Linear in the table; its
    transpose is :func:`gather_sum` over ``pos`` (a gather, no scatter-add)."""
    table = jnp.asarray(table)
    pos = jnp.asarray(pos).astype(jnp.int32)
    fill = jnp.asarray(fill).astype(jnp.int32)
    if table.ndim < 1 or pos.ndim != 2 or pos.shape[0] != table.shape[0] or fill.ndim != 1:
        raise ValueError(f"row_kernels.scatter: table must have a row axis, pos be (rows of table, "
                         f"K) and fill 1-D, got table {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)} and fill {tuple(fill.shape)}")
    if int(rows) < 0:
        raise ValueError(f"row_kernels.scatter: rows must be >= 0, got {rows}")
    if columns is not None:
        start, stop = (int(c) for c in columns)
        if table.ndim != 2 or not 0 <= start <= stop <= table.shape[1]:
            raise ValueError(f"row_kernels.scatter: columns must be (start, stop) with 0 <= start "
                             f"<= stop <= the columns of a 2-D table, got {tuple(columns)} for "
                             f"table {tuple(table.shape)}")
        columns = (start, stop)
    if sources is None:
        sources = jnp.zeros((0,), jnp.int32)  # unknown: the fast lowering finds it
    else:
        sources = jnp.asarray(sources)
        if sources.shape != (int(rows),) or not jnp.issubdtype(sources.dtype, jnp.integer):
            raise ValueError(f"row_kernels.scatter: sources must be an integer array of shape "
                             f"(rows,) = ({int(rows)},), got {sources.dtype} "
                             f"{tuple(sources.shape)}")
    table, pos, fill, sources = same_vma(table, pos, fill, sources.astype(jnp.int32))
    return scatter_p.bind(table, pos, fill, sources, rows=int(rows), columns=columns,
                          kernel=lowering())


def _columns(table, columns):
    return table if columns is None else table[:, columns[0]:columns[1]]


def scatter_reference(table, pos, fill, sources=None, *, rows, columns=None, kernel=None):
    del kernel, sources
    table = _columns(table, columns)
    N, K = pos.shape
    out = jnp.full((rows, *table.shape[1:]), poison(table.dtype))
    inside = lambda i: jnp.where((i >= 0) & (i < rows), i, rows)  # noqa: E731  (rows: dropped)
    src = jnp.repeat(jnp.arange(N, dtype=jnp.int32), K)
    out = out.at[inside(pos.reshape(-1))].set(jnp.take(table, src, axis=0), mode="drop")
    return out.at[inside(fill)].set(jnp.zeros((), table.dtype), mode="drop")


def _scatter_sources(pos, fill, rows: int):
    """``(rows,)`` int32: the table row each output row of a :func:`scatter` takes (``>= 0``),
    ``-1`` for a filled (zero) row, ``-2`` for an unspecified one; a scatter of ``N * K + F``
    scalars (the same precedence as the reference: fill last)."""
    N, K = pos.shape
    inside = lambda i: jnp.where((i >= 0) & (i < rows), i, rows)  # noqa: E731  (rows: dropped)
    src = jnp.full((rows,), -2, jnp.int32)
    src = src.at[inside(pos.reshape(-1))].set(
        jnp.repeat(jnp.arange(N, dtype=jnp.int32), K), mode="drop")
    return src.at[inside(fill)].set(-1, mode="drop")


def _take_rows(table, at):
    """Rows of ``table`` extended by a zero row (``at == N``) and a poison row (``at == N + 1``):
    one gather in clip mode, nothing else over the output (a select over ``(M, H)`` costs as much
    as the gather on TPUs); the table is copied once instead, which is at most as large."""
    tail = jnp.stack([jnp.zeros(table.shape[1:], table.dtype),
                      jnp.full(table.shape[1:], poison(table.dtype))])
    return jnp.take(jnp.concatenate([table, tail]), at, axis=0, mode="clip")


def _rows_from(table, src):
    """``table[src]`` where ``src >= 0``, zero where ``src == -1``, poison where ``src < -1``."""
    n = table.shape[0]
    return _take_rows(table, jnp.where((src >= 0) & (src < n), src,
                                       jnp.where(src == -1, n, n + 1)))


def scatter_fast(table, pos, fill, sources=None, *, rows, columns=None, kernel=None):
    # one gather of whole rows by the inverse map: the caller's, else a scatter of scalars (no
    # scatter of rows either way)
    del kernel
    if sources is None or sources.shape[0] != rows:
        sources = _scatter_sources(pos, fill, rows)
    return _rows_from(_columns(table, columns), sources)


def _scatter_jvp(primals, tangents, **params):
    table, pos, fill, sources = primals
    out = scatter_p.bind(table, pos, fill, sources, **params)
    t = tangents[0]
    if type(t) is ad.Zero:
        return out, zero_tangent(out)
    return out, scatter_p.bind(ad.instantiate_zeros(t), pos, fill, sources, **params)


def _scatter_transpose(ct, table, pos, fill, sources, *, rows, columns, kernel):
    aval = table.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None, None, None]
    # d table[n] = sum_k d out[pos[n, k]]: a gather (each target row belongs to one n)
    flat, pos, ones = same_vma(ct.reshape(ct.shape[0], -1), pos,
                                jnp.ones(pos.shape, jnp.float32))
    d = gather_sum_p.bind(flat, pos, ones, out_dtype=aval.dtype, kernel=kernel)
    if columns is None:
        return [d.reshape(aval.shape), None, None, None]
    return [jnp.zeros(aval.shape, aval.dtype).at[:, columns[0]:columns[1]].set(d), None, None,
            None]


def _scatter_abstract(table, pos, fill, sources, *, rows, columns, kernel):
    shape = table.shape[1:] if columns is None else (columns[1] - columns[0],)
    return table.update(shape=(rows, *shape), weak_type=False)


scatter_p = primitive("ep_comm_rows_scatter", scatter_reference, _scatter_abstract,
                       ("rows", "columns", "kernel"), fast=scatter_fast,
                       ffi_attrs=lambda *, columns, **_: dict(offset=np.int64(
                           0 if columns is None else columns[0])),
                       kernel_fits=lambda ctx, *, columns, **_: columns is None
                       or ctx.avals_in[0].dtype.itemsize == 1,
                       ffi_operands=3)  # (the kernel scatters: it takes no sources)
ad.primitive_jvps[scatter_p] = _scatter_jvp
ad.primitive_transposes[scatter_p] = _scatter_transpose


# --- gather_sum -----------------------------------------------------------------------------------

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # what the CUDA kernel sums
_SUMMABLE = _KERNEL_DTYPES + (jnp.float64,)  # float64 (x64 mode): the XLA lowering everywhere


def gather_sum(table, idx, weights=None, *, out_dtype=jnp.float32):
    """``sum_k weights[:, k] * table[idx[:, k]]`` in float32 (``k`` in order), as ``out_dtype``.

    ``table``: ``(N, H)`` float32/bfloat16/float16 (float64: XLA on every platform); ``idx``: ``(M, K)`` integer, entries outside
    ``[0, N)`` skipped; ``weights``: ``(M, K)`` (default: ones). Returns ``(M, H)``."""
    table = jnp.asarray(table)
    idx = jnp.asarray(idx).astype(jnp.int32)
    if table.ndim != 2 or idx.ndim != 2:
        raise ValueError(f"row_kernels.gather_sum: table must be (N, H) and idx (M, K), got "
                         f"table {tuple(table.shape)} and idx {tuple(idx.shape)}")
    out_dtype = jnp.dtype(out_dtype)
    if table.dtype not in _SUMMABLE or out_dtype not in _SUMMABLE:
        raise ValueError(f"row_kernels.gather_sum: table and out_dtype must be float32, bfloat16, "
                         f"float16 or float64, got {table.dtype} and {out_dtype}")
    weights = (jnp.ones(idx.shape, jnp.float32) if weights is None
               else jnp.asarray(weights).astype(jnp.float32))
    if weights.shape != idx.shape:
        raise ValueError(f"row_kernels.gather_sum: weights must have idx's shape {idx.shape}, "
                         f"got {weights.shape}")
    table, idx, weights = same_vma(table, idx, weights)
    return gather_sum_p.bind(table, idx, weights, out_dtype=out_dtype, kernel=lowering())


def _gather_sum_reference(table, idx, weights, *, out_dtype, kernel=None, mode=None):
    # (mode="clip": the fast lowering's gathers, with no fill mask: the indices are clipped)
    del kernel
    n = table.shape[0]
    acc_dtype = jnp.promote_types(table.dtype, jnp.float32)  # float32, or float64 under x64
    acc = jnp.zeros((idx.shape[0], table.shape[1]), acc_dtype)
    for k in range(idx.shape[1]):
        ok = (idx[:, k] >= 0) & (idx[:, k] < n)
        rows = jnp.take(table, jnp.clip(idx[:, k], 0, max(n - 1, 0)), axis=0,
                        mode=mode).astype(acc_dtype)
        acc = acc + jnp.where(ok[:, None], weights[:, k, None] * rows, 0.0)
    return acc.astype(out_dtype)


def _gather_sum_abstract(table, idx, weights, *, out_dtype, kernel):
    return table.update(shape=(idx.shape[0], table.shape[1]), dtype=out_dtype, weak_type=False)


def _gather_sum_jvp(primals, tangents, *, out_dtype, kernel):
    table, idx, weights = primals
    t_table, _, t_w = tangents
    out = gather_sum_p.bind(table, idx, weights, out_dtype=out_dtype, kernel=kernel)
    terms = []
    if type(t_table) is not ad.Zero:  # bilinear: d(table) with the weights, d(w) with the table
        terms.append(gather_sum_p.bind(t_table, idx, weights, out_dtype=out_dtype, kernel=kernel))
    if type(t_w) is not ad.Zero:
        terms.append(gather_sum_p.bind(table, idx, t_w, out_dtype=out_dtype, kernel=kernel))
    if not terms:
        return out, zero_tangent(out)
    return out, functools.reduce(jnp.add, terms)


def _gather_sum_transpose(ct, table, idx, weights, *, out_dtype, kernel):
    undefined_table, undefined_w = ad.is_undefined_primal(table), ad.is_undefined_primal(weights)
    t_aval = table.aval if undefined_table else jax.typeof(table)
    w_aval = weights.aval if undefined_w else jax.typeof(weights)
    if type(ct) is ad.Zero:
        return [ad.Zero(t_aval) if undefined_table else None, None,
                ad.Zero(w_aval) if undefined_w else None]
    n = t_aval.shape[0]
    ok = (idx >= 0) & (idx < n)
    ct = ct.astype(jnp.float32)
    d_table = d_w = None
    if undefined_table:  # scatter-add of w * ct rows (ep_comm.rows' custom VJP avoids it)
        rows = weights[:, :, None] * ct[:, None, :]
        d_table = jnp.zeros(t_aval.shape, jnp.float32).at[jnp.where(ok, idx, n)].add(
            rows, mode="drop").astype(t_aval.dtype)
    if undefined_w:
        rows = jnp.take(table, jnp.clip(idx, 0, n - 1), axis=0).astype(jnp.float32)
        d_w = jnp.where(ok, jnp.einsum("mkh,mh->mk", rows, ct), 0.0).astype(w_aval.dtype)
    return [d_table, None, d_w]


gather_sum_p = primitive(
    "ep_comm_rows_gather_sum", _gather_sum_reference, _gather_sum_abstract,
    ("out_dtype", "kernel"), fast=functools.partial(_gather_sum_reference, mode="clip"),
    kernel_fits=lambda ctx, *, out_dtype, kernel: all(
        d in _KERNEL_DTYPES for d in (ctx.avals_in[0].dtype, out_dtype)))
ad.primitive_jvps[gather_sum_p] = _gather_sum_jvp
ad.primitive_transposes[gather_sum_p] = _gather_sum_transpose


# --- empty ----------------------------------------------------------------------------------------

_empty_ids = itertools.count(1)


def empty(shape, dtype):
    """A ``shape`` buffer of ``dtype`` whose values are unspecified (GPU kernels: not written;
    XLA: NaN, or all bits set for integers). Each call is a distinct buffer."""
    shape = tuple(int(d) for d in shape)
    return empty_p.bind(shape=shape, dtype=np.dtype(dtype), uid=next(_empty_ids),
                        kernel=lowering())


def _empty_reference(*, shape, dtype, uid=None, kernel=None):
    return jnp.full(shape, poison(dtype))


empty_p = primitive(
    "ep_comm_rows_empty", _empty_reference,
    lambda *, shape, dtype, uid, kernel: jax.core.ShapedArray(shape, dtype),
    ("shape", "dtype", "uid", "kernel"), ffi_attrs=lambda *, uid, **_: dict(id=np.int64(uid)))
