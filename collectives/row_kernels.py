"""The row kernels of dispatch and combine: the gathers that move token rows by index.

Each primitive here is lowered to a CUDA kernel (``collectives/csrc/row_kernels.cu``, module
``_ep_rows``) on GPUs where it is built, and to XLA everywhere else (:func:`_primitive` defines
that choice once). Each has an XLA *reference* lowering, the definition the kernels equal
(``tests/test_row_kernels.py`` checks it on the GPU, bitwise for the gathers, scatters and the
counting sort, to float32 reassociation for :func:`gather_sum`), and most a *fast* XLA lowering,
the production path on TPUs and CPUs (sorts, whole-row gathers in clip mode, no scatter of rows
and no select over an output; equal to the reference the same way, checked on every platform).

- :func:`gather`: ``out[i] = table[idx[i]]``, rows of any dtype (FP8 rows as bytes too). A row
  with a negative index is zero; a row with an index ``>= len(table)`` is *unspecified*: the kernel
  does not write it (no memset of a worst-case buffer), and the XLA reference poisons it (NaN, or
  all bits set for integers), so that a test on any platform sees a consumer that reads such
  rows.
- :func:`gather_sum`: ``out[m] = sum_k w[m, k] * table[idx[m, k]]`` accumulated in float32 in
  ``k`` order, slots whose index is outside the table skipped (they add exactly nothing, even where
  the table holds NaN), written once in the requested dtype.
- :func:`scatter`: ``out[pos[n, k]] = table[n]``, each table row read once and written to its
  destinations (dispatch's expand), chosen rows zeroed, the others unspecified as :func:`gather`'s.
- :func:`rank_by_key`: a stable counting sort of integer keys (dispatch's expert-major layout),
  :func:`key_counts` and :func:`key_ranks` its two kernels.
- :func:`scatter_dequant`: :func:`scatter` of FP8 wire rows, each dequantized once on the way
  (dispatch's receive side with ``EPConfig(wire_format=...)``; :func:`quantize_blocks` and
  :func:`dequantize_blocks` are the FP8 formats' math, in XLA);
  :func:`scatter_fake_quant` the same values straight from unquantized rows (one rank: no wire),
  :func:`scatter_quant` the same rows kept as FP8 bytes.
- :func:`expert_layout`: dispatch's receive-side layout (the counting sort of the received
  (row, expert) pairs and every index expand and the handle need) as one op: three kernels.

And :func:`empty`: a buffer for an exchange to receive into, left uninitialised on GPUs (no
memset of a worst-case receive buffer), poisoned by the XLA lowering elsewhere.

``EP_COMM_ROW_KERNELS=0`` (read when a program is traced) or :func:`xla_only` use the fast XLA
lowerings on GPUs too, for A/B comparisons; ``EP_COMM_ROW_KERNELS=reference`` or
:func:`reference_only` the reference lowerings everywhere. ``gather`` and ``gather_sum`` are
linear in the table (and ``gather_sum`` in the weights) with jvp and transpose rules
(scatter-adds: ``ep_comm.rows`` gives dispatch and combine custom VJPs that avoid them);
``scatter_dequant`` moves bytes (no gradient); every one with operands batches through the XLA
lowering its ``kernel`` parameter picks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ep_comm.collectives import bootstrap
from ep_comm.topology.jax_compat import match_vma

LOWERINGS = ("cuda", "xla", "reference")
_forced: list[str] = []  # the lowering the innermost xla_only() / reference_only() block asks for


def available() -> str | None:
    """None when the CUDA row kernels are built and loadable here, else why not."""
    return bootstrap.load("rows")[1]


@contextlib.contextmanager
def _forcing(lowering: str):
    _forced.append(lowering)
    try:
        yield
    finally:
        _forced.pop()


def xla_only():
    """Trace with the fast XLA lowerings on every platform inside this block (no CUDA kernels):
    the production path off CUDA, for A/B comparisons on GPUs."""
    return _forcing("xla")


def reference_only():
    """Trace with the XLA *reference* lowerings inside this block: the definitions the CUDA
    kernels and the fast XLA lowerings are tested against (per-element scatters, poisoned rows;
    written to be checked, not to be fast)."""
    return _forcing("reference")


def _lowering() -> str:
    """The lowering a primitive bound now asks for (one of :data:`LOWERINGS`):
    ``EP_COMM_ROW_KERNELS=0`` (read when a program is traced) means ``"xla"``,
    ``EP_COMM_ROW_KERNELS=reference`` ``"reference"``; ``"cuda"`` falls back to ``"xla"`` where
    no kernel is built or fits."""
    if _forced:
        return _forced[-1]
    env = os.environ.get("EP_COMM_ROW_KERNELS", "1")
    return {"0": "xla", "reference": "reference"}.get(env, "cuda")


def _same_vma(*xs):
    """Every operand marked varying over the mesh axes any of them varies over."""
    out = list(xs)
    for i in range(len(out)):
        for other in xs:
            out[i] = match_vma(out[i], other)
    return out


def _zero_tangent(out):
    """The symbolic zero tangent of a primitive's output (float0 for integer outputs)."""
    return ad.Zero(jax.typeof(out).to_tangent_aval())


def _constant_jvp(p):
    """Register ``p`` as constant in its operands (it moves bytes: no gradient flows)."""
    def jvp(primals, tangents, **params):
        out = p.bind(*primals, **params)
        return out, ([_zero_tangent(o) for o in out] if p.multiple_results
                     else _zero_tangent(out))
    ad.primitive_jvps[p] = jvp


def _poison(dtype):
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.array(jnp.nan, dtype)
    return jnp.array(np.array(-1, np.int64).astype(dtype))  # all bits set


def _primitive(name, reference, abstract, static, ffi_attrs=lambda **params: {},
               kernel_fits=lambda ctx, **params: True, multiple_results=False, fast=None,
               ffi_operands=None):
    """The primitive ``name`` (also its FFI target's name). Its ``kernel`` parameter (one of
    :data:`LOWERINGS`, :func:`_lowering` at bind time) picks the lowering: ``"reference"``:
    ``reference`` (an XLA function of the operands and every parameter); ``"xla"``: ``fast``
    (the same function written for speed on TPUs and CPUs: sorts and whole-row gathers, no scatter
    of rows; equal to ``reference``, bitwise for moves) or ``reference`` when there is none;
    ``"cuda"``: on GPUs the CUDA kernel when ``kernel_fits`` and the kernels are built here (with
    the attributes ``ffi_attrs(**params)``), else as ``"xla"``. Outside ``jit`` it runs jitted
    (``static``: its parameters), so eager calls take the same lowering; batching goes through the
    XLA function the parameter picks. ``ffi_operands``: how many of the leading operands the
    kernel takes (default all; the others only serve the XLA lowerings)."""
    p = Primitive(name)
    p.multiple_results = multiple_results

    def chosen(params):
        return reference if fast is None or params["kernel"] == "reference" else fast

    def xla(ctx, *args, **params):
        return mlir.lower_fun(functools.partial(chosen(params), **params),
                              multiple_results=multiple_results)(ctx, *args)

    def cuda(ctx, *args, **params):
        if params["kernel"] == "cuda" and kernel_fits(ctx, **params) and _registered():
            used = len(args) if ffi_operands is None else ffi_operands
            return jax.ffi.ffi_lowering(name)(ctx.replace(avals_in=ctx.avals_in[:used]),
                                              *args[:used], **ffi_attrs(**params))
        return xla(ctx, *args, **params)

    def batch(args, dims, **params):
        out = jax.vmap(functools.partial(chosen(params), **params), in_axes=dims)(*args)
        return out, ([0] * len(out) if multiple_results else 0)

    p.def_impl(functools.partial(jax.jit, static_argnames=static)(
        lambda *args, **params: p.bind(*args, **params)))
    p.def_abstract_eval(abstract)
    batching.primitive_batchers[p] = batch
    mlir.register_lowering(p, xla)
    mlir.register_lowering(p, cuda, platform="cuda")
    return p


# --- gather ---------------------------------------------------------------------------------------

def gather(table, idx):
    """``table[idx]`` (rows); rows with a negative index: zero; with an index ``>= N``:
    unspecified. ``table``: ``(N, ...)``; ``idx``: ``(M,)`` integer. Returns ``(M, ...)``."""
    table = jnp.asarray(table)
    idx = jnp.asarray(idx).astype(jnp.int32)
    if table.ndim < 1 or idx.ndim != 1:
        raise ValueError(f"row_kernels.gather: table must have a row axis and idx be 1-D, got "
                         f"table {tuple(table.shape)} and idx {tuple(idx.shape)}")
    table, idx = _same_vma(table, idx)
    return gather_p.bind(table, idx, kernel=_lowering())


def _gather_reference(table, idx, kernel=None):
    del kernel
    n = table.shape[0]
    ok = (idx >= 0) & (idx < n)
    rows = jnp.take(table, jnp.clip(idx, 0, max(n - 1, 0)), axis=0) if n else \
        jnp.zeros((idx.shape[0], *table.shape[1:]), table.dtype)
    bcast = lambda a: a.reshape(a.shape + (1,) * (table.ndim - 1))  # noqa: E731
    other = jnp.where(bcast(idx < 0), jnp.zeros((), table.dtype), _poison(table.dtype))
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
        return out, _zero_tangent(out)
    return out, gather_p.bind(ad.instantiate_zeros(t), idx, kernel=kernel)


def _gather_transpose(ct, table, idx, *, kernel):
    aval = table.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None]
    n = aval.shape[0]
    ok = (idx >= 0) & (idx < n)
    d = jnp.zeros(aval.shape, ct.dtype).at[jnp.where(ok, idx, n)].add(ct, mode="drop")
    return [d.astype(aval.dtype), None]


gather_p = _primitive("ep_comm_rows_gather", _gather_reference, _gather_abstract, ("kernel",),
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
    table, pos, fill, sources = _same_vma(table, pos, fill, sources.astype(jnp.int32))
    return scatter_p.bind(table, pos, fill, sources, rows=int(rows), columns=columns,
                          kernel=_lowering())


def _columns(table, columns):
    return table if columns is None else table[:, columns[0]:columns[1]]


def _scatter_reference(table, pos, fill, sources=None, *, rows, columns=None, kernel=None):
    del kernel, sources
    table = _columns(table, columns)
    N, K = pos.shape
    out = jnp.full((rows, *table.shape[1:]), _poison(table.dtype))
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
                      jnp.full(table.shape[1:], _poison(table.dtype))])
    return jnp.take(jnp.concatenate([table, tail]), at, axis=0, mode="clip")


def _rows_from(table, src):
    """``table[src]`` where ``src >= 0``, zero where ``src == -1``, poison where ``src < -1``."""
    n = table.shape[0]
    return _take_rows(table, jnp.where((src >= 0) & (src < n), src,
                                       jnp.where(src == -1, n, n + 1)))


def _scatter_fast(table, pos, fill, sources=None, *, rows, columns=None, kernel=None):
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
        return out, _zero_tangent(out)
    return out, scatter_p.bind(ad.instantiate_zeros(t), pos, fill, sources, **params)


def _scatter_transpose(ct, table, pos, fill, sources, *, rows, columns, kernel):
    aval = table.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None, None, None]
    # d table[n] = sum_k d out[pos[n, k]]: a gather (each target row belongs to one n)
    flat, pos, ones = _same_vma(ct.reshape(ct.shape[0], -1), pos,
                                jnp.ones(pos.shape, jnp.float32))
    d = gather_sum_p.bind(flat, pos, ones, out_dtype=aval.dtype, kernel=kernel)
    if columns is None:
        return [d.reshape(aval.shape), None, None, None]
    return [jnp.zeros(aval.shape, aval.dtype).at[:, columns[0]:columns[1]].set(d), None, None,
            None]


def _scatter_abstract(table, pos, fill, sources, *, rows, columns, kernel):
    shape = table.shape[1:] if columns is None else (columns[1] - columns[0],)
    return table.update(shape=(rows, *shape), weak_type=False)


scatter_p = _primitive("ep_comm_rows_scatter", _scatter_reference, _scatter_abstract,
                       ("rows", "columns", "kernel"), fast=_scatter_fast,
                       ffi_attrs=lambda *, columns, **_: dict(offset=np.int64(
                           0 if columns is None else columns[0])),
                       kernel_fits=lambda ctx, *, columns, **_: columns is None
                       or ctx.avals_in[0].dtype.itemsize == 1,
                       ffi_operands=3)  # (the kernel scatters: it takes no sources)
ad.primitive_jvps[scatter_p] = _scatter_jvp
ad.primitive_transposes[scatter_p] = _scatter_transpose


# --- rank_by_key (a stable counting sort) ---------------------------------------------------------

RANK_CHUNK = 256      # entries per chunk of the counting sort (the kernels' kRankChunk)
MAX_RANK_KEYS = 12288  # keys whose running counts fit a block's shared memory (the kernels')


def _chunks(m: int) -> int:
    """Chunks of :data:`RANK_CHUNK` entries covering ``m``."""
    return -(-m // RANK_CHUNK)


def rank_by_key(key, num_keys: int):
    """A stable counting sort of integer keys in ``[0, num_keys)`` (others count as
    ``num_keys - 1``): ``(rank, order, counts)``, ``rank[i]`` entry ``i``'s position in the order
    sorted by key then ``i``, ``order`` its inverse (``order[rank[i]] = i``), ``counts[k]`` the
    entries with key ``k``. ``key``: ``(M,)`` integer.

    Two passes instead of a radix sort (dispatch's expert-major layout): per chunk of
    :data:`RANK_CHUNK` entries, the count of each key (:func:`key_counts`); their scans over
    chunks and keys give each chunk's first position per key; then each entry's rank
    (:func:`key_ranks`: one warp per chunk on GPUs, lanes with equal keys ranked together)."""
    key = jnp.asarray(key)
    if key.ndim != 1 or not jnp.issubdtype(key.dtype, jnp.integer):
        raise ValueError(f"row_kernels.rank_by_key: key must be a 1-D integer array, got "
                         f"{key.dtype} {tuple(key.shape)}")
    if not 1 <= int(num_keys) <= np.iinfo(np.int32).max:
        raise ValueError(f"row_kernels.rank_by_key: num_keys must be >= 1, got {num_keys}")
    counts = key_counts(key, num_keys)
    totals = jnp.sum(counts, axis=0, dtype=jnp.int32)
    base = ((jnp.cumsum(totals, dtype=jnp.int32) - totals)[None, :]
            + jnp.cumsum(counts, axis=0, dtype=jnp.int32) - counts)
    rank, order = key_ranks(key, base)
    return rank, order, totals


def key_counts(key, num_keys: int):
    """``(ceil(M / RANK_CHUNK), num_keys)`` int32: entries of each chunk of ``key`` ``(M,)`` with
    each key (a key outside ``[0, num_keys)`` counts as ``num_keys - 1``)."""
    key = jnp.asarray(key).astype(jnp.int32)
    return key_count_p.bind(key, num_keys=int(num_keys), kernel=_lowering())


def key_ranks(key, base):
    """``(rank, order)``: ``rank[i] = base[c, k] +`` the entries of chunk ``c`` (entry ``i``'s)
    before ``i`` with its key ``k``; ``order[rank[i]] = i`` where ``rank[i]`` is in ``[0, M)``,
    positions no rank names unspecified. ``base``: ``(ceil(M / RANK_CHUNK), num_keys)``."""
    key = jnp.asarray(key).astype(jnp.int32)
    base = jnp.asarray(base).astype(jnp.int32)
    chunks = _chunks(key.shape[0])
    if key.ndim != 1 or base.ndim != 2 or base.shape[0] != chunks or base.shape[1] < 1:
        raise ValueError(f"row_kernels.key_ranks: key must be 1-D and base (ceil(M / "
                         f"{RANK_CHUNK}), num_keys), got key {tuple(key.shape)} and base "
                         f"{tuple(base.shape)}")
    key, base = _same_vma(key, base)
    out = key_rank_p.bind(key, base, kernel=_lowering())
    return out[0], out[1]


def _chunk_and_key(key, num_keys):
    ok = (key >= 0) & (key < num_keys)
    return (jnp.arange(key.shape[0], dtype=jnp.int32) // RANK_CHUNK,
            jnp.where(ok, key, num_keys - 1))


def _key_count_reference(key, *, num_keys, kernel=None):
    del kernel
    chunk, k = _chunk_and_key(key, num_keys)
    chunks = _chunks(key.shape[0])
    return jnp.zeros((chunks, num_keys), jnp.int32).at[chunk, k].add(1)


def _key_rank_reference(key, base, *, kernel=None):
    del kernel
    (chunks, num_keys), M = base.shape, key.shape[0]
    chunk, k = _chunk_and_key(key, num_keys)
    cell = chunk * num_keys + k  # entries of one (chunk, key) cell, in order
    order = jnp.argsort(cell, stable=True).astype(jnp.int32)
    i = jnp.arange(M, dtype=jnp.int32)
    position = jnp.zeros((M,), jnp.int32).at[order].set(i, unique_indices=True)
    per_cell = jnp.bincount(cell, length=chunks * num_keys).astype(jnp.int32)
    rank = base[chunk, k] + position - (jnp.cumsum(per_cell) - per_cell)[cell]
    inverse = jnp.full((M,), _poison(jnp.int32)).at[jnp.where((rank >= 0) & (rank < M), rank, M)
                                                     ].set(i, mode="drop")
    return jnp.stack([rank, inverse])


key_count_p = _primitive(
    "ep_comm_rows_key_count", _key_count_reference,
    lambda key, *, num_keys, kernel: key.update(
        shape=(_chunks(key.shape[0]), num_keys), dtype=jnp.int32, weak_type=False),
    ("num_keys", "kernel"), kernel_fits=lambda ctx, *, num_keys, kernel: num_keys <= MAX_RANK_KEYS)
key_rank_p = _primitive(
    "ep_comm_rows_key_rank", _key_rank_reference,
    lambda key, base, *, kernel: key.update(shape=(2, key.shape[0]), dtype=jnp.int32,
                                            weak_type=False),
    ("kernel",), kernel_fits=lambda ctx, *, kernel: ctx.avals_in[1].shape[1] <= MAX_RANK_KEYS)


# --- token_routes (dispatch's sender-side layout, one kernel) -------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRoutes:
    """Where each token goes (see :func:`token_routes`).

    Attributes:
      route: ``(T, 2K)`` float32; the token's weights then its expert ids (as float32, exact below
        2**24), for its valid slots (weight 0 and id -1 elsewhere): the routing that travels.
      dest: ``(T, K)`` int32; the rank holding each slot's expert (``num_ranks``: not routed).
      in_rank: ``(T, num_ranks)`` bool; whether the token goes to each rank.
      first: ``(T, K)`` bool; the slot is the token's first to its rank.
      tokens_per_rank, pairs_per_rank: ``(num_ranks,)`` int32; tokens to each rank (once per rank)
        and distinct (token, expert) pairs to it.
      num_invalid: ``()`` int32; ids outside ``[-1, num_experts)`` (not routed).
    """

    route: jax.Array
    dest: jax.Array
    in_rank: jax.Array
    first: jax.Array
    tokens_per_rank: jax.Array
    pairs_per_rank: jax.Array
    num_invalid: jax.Array


def _routing(api, topk_ids, topk_weights):
    """``(ids, weights)`` as int32 and float32 ``(T, K)`` arrays, checked (``api`` names the op
    in the error)."""
    ids = jnp.asarray(topk_ids)
    w = jnp.asarray(topk_weights)
    if (ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or w.shape != ids.shape
            or not jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(f"row_kernels.{api}: topk_ids must be integer (T, K) and topk_weights "
                         f"floating of the same shape, got {ids.dtype} {tuple(ids.shape)} and "
                         f"{w.dtype} {tuple(w.shape)}")
    return _same_vma(ids.astype(jnp.int32), w.astype(jnp.float32))


def token_routes(topk_ids, topk_weights, *, num_experts: int, num_ranks: int) -> TokenRoutes:
    """Dispatch's sender-side layout: for each token, the ranks holding its experts (placed in
    contiguous blocks of ``num_experts // num_ranks``) and the per-rank counts; ``topk_ids``
    ``(T, K)`` integer (-1: no expert), ``topk_weights`` ``(T, K)`` floating. On GPUs one kernel;
    elsewhere (and as its reference) XLA. Returns a :class:`TokenRoutes`."""
    ids, w = _routing("token_routes", topk_ids, topk_weights)
    E, n = int(num_experts), int(num_ranks)
    if n < 1 or E < n or E % n:
        raise ValueError(f"row_kernels.token_routes: num_ranks must divide num_experts, got "
                         f"num_experts={num_experts} and num_ranks={num_ranks}")
    route, dest, in_rank, first, counts, invalid = token_routes_p.bind(
        ids, w, num_experts=E, num_ranks=n, kernel=_lowering())
    return TokenRoutes(route, dest, in_rank, first, counts[:n], counts[n:], invalid[0])


def _token_routes_reference(ids, w, *, num_experts, num_ranks, kernel=None):
    del kernel
    E, n, i32 = num_experts, num_ranks, jnp.int32
    L = E // n
    valid = (ids >= 0) & (ids < E)
    dest = jnp.where(valid, ids // L, n)
    earlier = jnp.tril(jnp.ones((ids.shape[1],) * 2, bool), k=-1)  # [k, j]: j before k
    repeats = lambda a: jnp.any((a[:, :, None] == a[:, None, :]) & earlier, axis=2)  # noqa: E731
    first = (dest < n) & ~repeats(dest)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(n, dtype=i32), axis=1)
    distinct = valid & ~repeats(ids)
    pairs = jnp.sum(distinct[:, :, None] & (dest[:, :, None] == jnp.arange(n, dtype=i32)),
                    axis=(0, 1), dtype=i32)
    route = jnp.concatenate([jnp.where(valid, w, 0.0), jnp.where(valid, ids, -1)
                             .astype(jnp.float32)], axis=1)
    invalid = jnp.sum((ids != -1) & ~valid, dtype=i32)
    return [route, dest.astype(i32), in_rank, first,
            jnp.concatenate([jnp.sum(in_rank, axis=0, dtype=i32), pairs]), invalid[None]]


def _token_routes_abstract(ids, w, *, num_experts, num_ranks, kernel):
    T, K = ids.shape
    like = lambda shape, dtype: ids.update(shape=shape, dtype=dtype, weak_type=False)  # noqa: E731
    return [like((T, 2 * K), jnp.float32), like((T, K), jnp.int32),
            like((T, num_ranks), jnp.bool_), like((T, K), jnp.bool_),
            like((2 * num_ranks,), jnp.int32), like((1,), jnp.int32)]


def _token_routes_jvp(primals, tangents, **params):
    """Only the weights (in ``route``'s first K columns) are differentiable: a masked copy."""
    out = token_routes_p.bind(*primals, **params)
    tangent_out = [_zero_tangent(o) for o in out]
    t = tangents[1]
    if type(t) is not ad.Zero:
        tangent_out[0] = _route_tangent(primals[0], t, params["num_experts"])[0]
    return out, tangent_out


def _route_tangent(ids, t, num_experts):
    """``route``'s tangent (the weights' where the slot is valid, zero ids) and the valid
    slots' weight tangent alone."""
    valid_t = jnp.where((ids >= 0) & (ids < num_experts), t, 0.0)
    return jnp.concatenate([valid_t, jnp.zeros_like(t)], axis=1), valid_t


token_routes_p = _primitive(
    "ep_comm_rows_token_routes", _token_routes_reference, _token_routes_abstract,
    ("num_experts", "num_ranks", "kernel"),
    ffi_attrs=lambda *, num_experts, **_: dict(num_experts=np.int64(num_experts)),
    kernel_fits=lambda ctx, *, num_ranks, **_: (num_ranks <= 5631
                                                and 1 <= ctx.avals_in[0].shape[1] <= 1024),
    multiple_results=True)
ad.primitive_jvps[token_routes_p] = _token_routes_jvp


# --- expert_layout (dispatch's receive-side layout, fused) ----------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where the received (row, expert) pairs go in ``expert_x`` (see :func:`expert_layout`).

    Attributes:
      recv_pos: ``(R, K)`` int32; the expert row of each slot (``C``: none); slots repeating an
        earlier slot's expert point at that slot's row.
      targets: ``(R, K)`` int32; the rows each receive-buffer row fills, each once (``recv_pos``
        with repeated slots at ``C``): the scatter's destinations.
      recv_weights: ``(R, K)`` float32; each slot's router weight, 0 where it has no expert here.
      expert_token: ``(C,)`` int32; the receive-buffer row of each expert row (``R`` past them).
      group_sizes: ``(L,)`` int32; rows per local expert (capped at ``C`` in all).
      num_pairs: ``()`` int32; the pairs routed here, uncapped (some are dropped when it is > C).
      fill: the expert rows to zero: the first ``fill_rows`` past the groups, or with
        ``zero_fill`` every row past them (``(C,)``: the row, or -1 for a row in a group).
    """

    recv_pos: jax.Array
    targets: jax.Array
    recv_weights: jax.Array
    expert_token: jax.Array
    group_sizes: jax.Array
    num_pairs: jax.Array
    fill: jax.Array


def expert_layout(route, num_recv, me, *, experts: int, rows: int, fill_rows: int = 0,
                  zero_fill: bool = False) -> ExpertLayout:
    """Dispatch's receive-side layout: the received token rows' (row, expert) pairs sorted
    stably by local expert into the first ``rows`` (``C``) rows of ``expert_x``.

    ``route``: ``(R, 2K)`` float32, each receive-buffer row's K router weights then K global
    expert ids (-1: none); rows ``[0, num_recv)`` were received. A slot whose id lies in
    ``[experts * me, experts * (me + 1))`` routes to local expert ``id - experts * me``; a slot
    repeating an earlier slot's expert in its row shares that slot's expert row. Pairs are ordered
    by local expert, then row, then slot; those past ``C`` are dropped (``num_pairs`` counts them
    all). ``num_recv``, ``me``: int32 scalars (traced). Returns an :class:`ExpertLayout`.

    On GPUs three kernels (a per-chunk count and rank, a scan, the placement); elsewhere, and as
    their reference, XLA's ops with :func:`rank_by_key`."""
    route = jnp.asarray(route)
    if route.ndim != 2 or route.shape[1] < 2 or route.shape[1] % 2 or route.dtype != jnp.float32:
        raise ValueError(f"row_kernels.expert_layout: route must be float32 (R, 2K) with K >= 1, "
                         f"got {route.dtype} {tuple(route.shape)}")
    for name, v in (("experts", experts), ("rows", rows), ("fill_rows", fill_rows)):
        if not isinstance(v, (int, np.integer)) or v < (1 if name == "experts" else 0):
            raise ValueError(f"row_kernels.expert_layout: {name} must be an int >= "
                             f"{1 if name == 'experts' else 0}, got {v!r}")
    scalars = [jnp.asarray(v).astype(jnp.int32).reshape(1) for v in (num_recv, me)]
    route, *scalars = _same_vma(route, *scalars)
    out = expert_layout_p.bind(route, *scalars, experts=int(experts), rows=int(rows),
                               fill_rows=int(rows if zero_fill else min(fill_rows, rows)),
                               zero_fill=bool(zero_fill), kernel=_lowering())
    recv_pos, targets, recv_w, expert_token, sizes, num_pairs, fill, _ = out
    return ExpertLayout(recv_pos, targets, recv_w, expert_token, sizes, num_pairs[0], fill)


def _expert_layout_reference(route, num_recv, me, *, experts, rows, fill_rows, zero_fill,
                             kernel=None):
    def counting_sort(key, num_keys):
        with reference_only():
            return rank_by_key(key, num_keys)
    return _expert_layout_xla(route, num_recv, me, experts=experts, rows=rows,
                              fill_rows=fill_rows, zero_fill=zero_fill, sort=counting_sort)


def _expert_layout_fast(route, num_recv, me, *, experts, rows, fill_rows, zero_fill,
                        kernel=None):
    return _expert_layout_xla(route, num_recv, me, experts=experts, rows=rows,
                              fill_rows=fill_rows, zero_fill=zero_fill, sort=sort_by_key)


def sort_by_key(key, num_keys: int):
    """:func:`rank_by_key`'s ``(rank, order, counts)`` from one stable sort of ``(key, index)``
    pairs (what XLA does well on TPUs and CPUs), the inverse permutation by a second sort (TPUs)
    or a scatter of scalars (elsewhere) and the counts by a binary search of the sorted keys:
    equal to the counting sort's."""
    M = key.shape[0]
    i32 = jnp.int32
    k = jnp.where((key >= 0) & (key < num_keys), key, num_keys - 1).astype(i32)
    i = jnp.arange(M, dtype=i32)
    sorted_key, order = jax.lax.sort((k, i), num_keys=1, is_stable=True)
    # the inverse permutation: on TPUs a second sort (a scatter there costs several sorts), else
    # a scatter of scalars (cheaper than a sort on CPUs)
    rank = jax.lax.platform_dependent(
        order, tpu=lambda o: jax.lax.sort((o, i), num_keys=1)[1],
        default=lambda o: jnp.zeros((M,), i32).at[o].set(i, unique_indices=True))
    bounds = jnp.searchsorted(sorted_key, jnp.arange(num_keys + 1, dtype=i32),
                              side="left").astype(i32)
    return rank, order, bounds[1:] - bounds[:-1]


def _expert_layout_xla(route, num_recv, me, *, experts, rows, fill_rows, zero_fill, sort):
    """:func:`expert_layout` in XLA, with ``sort(key, num_keys) -> (rank, order, counts)`` the
    stable sort by key (the reference: the counting sort; fast: :func:`sort_by_key`)."""
    L, C, i32 = experts, rows, jnp.int32
    R, K = route.shape[0], route.shape[1] // 2
    gid, here = _layout_here(route, num_recv, me, L)
    recv_w = jnp.where(here, route[:, :K], 0.0)
    ids = jnp.where(here, gid % L, -1)
    # first slot of each slot's expert in its row; a slot that is not its own first repeats it
    first_slot = jnp.argmax(ids[:, :, None] == ids[:, None, :], axis=2)  # (R, K)
    has = ids >= 0
    key = jnp.where(has & (first_slot == jnp.arange(K)[None, :]), ids, L).reshape(-1)
    rank, order, per_key = sort(key, L + 1)
    per_expert = per_key[:L]
    num_pairs = jnp.sum(per_expert, dtype=i32)
    group_sizes = jnp.clip(C - (jnp.cumsum(per_expert) - per_expert), 0, per_expert)
    targets = jnp.where((key < L) & (rank < C), rank, C).reshape(R, K)
    # each slot's first slot's target: a select over the K slots (no gather of scalars, which
    # TPUs run one element at a time)
    of_first = first_slot[:, :, None] == jnp.arange(K)[None, None, :]
    recv_pos = jnp.where(has, jnp.sum(jnp.where(of_first, targets[:, None, :], 0), axis=2,
                                      dtype=i32), C)
    q = jnp.arange(C, dtype=i32)
    filled = jnp.minimum(num_pairs, C)
    # order[q] for the filled rows q < min(C, R * K): a slice, not a gather
    head = (order[:C] if C <= R * K
            else jnp.concatenate([order, jnp.zeros((C - R * K,), order.dtype)]))
    expert_token = jnp.where(q < filled, head // K, R)
    fill = (jnp.where(q >= filled, q, -1) if zero_fill
            else filled + jnp.arange(fill_rows, dtype=i32))
    scratch = jnp.zeros((_layout_scratch(R * K, L),), i32)
    return [recv_pos.astype(i32), targets.astype(i32), recv_w, expert_token.astype(i32),
            group_sizes.astype(i32), num_pairs[None], fill.astype(i32), scratch]


LAYOUT_CHUNK = 1024  # pairs per chunk of the layout kernels (their kLayoutChunk)


def _layout_scratch(m: int, experts: int) -> int:
    """int32 entries of the kernels' scratch: keys, ranks in chunk and first slots, then the
    counts per key and chunk."""
    return 3 * m + (experts + 1) * -(-m // LAYOUT_CHUNK)


def _expert_layout_abstract(route, num_recv, me, *, experts, rows, fill_rows, zero_fill, kernel):
    R, K = route.shape[0], route.shape[1] // 2
    i32 = lambda *shape: route.update(shape=shape, dtype=jnp.int32, weak_type=False)  # noqa: E731
    return [i32(R, K), i32(R, K), route.update(shape=(R, K), weak_type=False), i32(rows),
            i32(experts), i32(1), i32(fill_rows), i32(_layout_scratch(R * K, experts))]


expert_layout_p = _primitive(
    "ep_comm_rows_expert_layout", _expert_layout_reference, _expert_layout_abstract,
    ("experts", "rows", "fill_rows", "zero_fill", "kernel"),
    ffi_attrs=lambda *, zero_fill, **_: dict(zero_fill=np.int64(zero_fill)),
    fast=_expert_layout_fast,
    kernel_fits=lambda ctx, *, experts, rows, **_: (
        experts + ctx.avals_in[0].shape[1] // 2 + LAYOUT_CHUNK <= MAX_RANK_KEYS
        and rows < 2 ** 31 and ctx.avals_in[0].shape[0] * ctx.avals_in[0].shape[1] // 2 < 2 ** 31),
    multiple_results=True)


def _layout_here(route, num_recv, me, experts):
    """``(gid, here)`` ``(R, K)``: each slot's global expert id (-1 on rows not received) and
    whether it is one of this rank's experts."""
    R, K = route.shape[0], route.shape[1] // 2
    gid = jnp.where((jnp.arange(R) < num_recv[0])[:, None], route[:, K:], -1.0).astype(jnp.int32)
    return gid, (gid >= 0) & (gid // experts == me[0])


def _expert_layout_jvp(primals, tangents, **params):
    """Only the weights are differentiable (in ``route``'s weight columns): a masked copy."""
    out = expert_layout_p.bind(*primals, **params)
    tangent_out = [_zero_tangent(o) for o in out]
    t = tangents[0]
    if type(t) is not ad.Zero:
        route, num_recv, me = primals
        K = route.shape[1] // 2
        tangent_out[2] = jnp.where(_layout_here(route, num_recv, me, params["experts"])[1],
                                   t[:, :K], 0.0)
    return out, tangent_out


ad.primitive_jvps[expert_layout_p] = _expert_layout_jvp


# --- local_layout (one rank: token routes and expert layout in one launch) ------------------------

def local_layout_fits(tokens: int, topk: int, num_experts: int) -> bool:
    """Whether :func:`local_layout`'s one launch applies: one block of pairs and of experts."""
    return 1 <= topk and tokens * topk <= LAYOUT_CHUNK and num_experts < LAYOUT_CHUNK


def local_layout(topk_ids, topk_weights, *, num_experts: int, rows: int, fill_rows: int = 0,
                 zero_fill: bool = False) -> tuple[TokenRoutes, ExpertLayout]:
    """One rank's :func:`token_routes` and the :func:`expert_layout` of their ``route`` (every
    token row received, rank 0) in one launch on GPUs: dispatch at one rank and decode sizes
    (:func:`local_layout_fits`), where each launch is a good part of the time. Elsewhere, and as
    the reference, the two ops' XLA references. Returns ``(TokenRoutes, ExpertLayout)``, equal to
    the two ops'."""
    ids, w = _routing("local_layout", topk_ids, topk_weights)
    T, K = ids.shape
    if not local_layout_fits(T, K, int(num_experts)) or rows < 0 or fill_rows < 0:
        raise ValueError(f"row_kernels.local_layout: needs T * K <= {LAYOUT_CHUNK}, num_experts < "
                         f"{LAYOUT_CHUNK} and rows, fill_rows >= 0, got T={T}, K={K}, "
                         f"num_experts={num_experts}, rows={rows}, fill_rows={fill_rows}")
    out = local_layout_p.bind(ids, w, num_experts=int(num_experts), rows=int(rows),
                              fill_rows=int(rows if zero_fill else min(fill_rows, rows)),
                              zero_fill=bool(zero_fill), kernel=_lowering())
    route, dest, in_rank, first, counts, invalid = out[:6]
    recv_pos, targets, recv_w, expert_token, sizes, num_pairs, fill = out[6:]
    return (TokenRoutes(route, dest, in_rank, first, counts[:1], counts[1:], invalid[0]),
            ExpertLayout(recv_pos, targets, recv_w, expert_token, sizes, num_pairs[0], fill))


def _local_layout_reference(ids, w, *, num_experts, rows, fill_rows, zero_fill, kernel=None):
    return _local_layout_xla(ids, w, _expert_layout_reference, num_experts=num_experts,
                             rows=rows, fill_rows=fill_rows, zero_fill=zero_fill)


def _local_layout_fast(ids, w, *, num_experts, rows, fill_rows, zero_fill, kernel=None):
    return _local_layout_xla(ids, w, _expert_layout_fast, num_experts=num_experts, rows=rows,
                             fill_rows=fill_rows, zero_fill=zero_fill)


def _local_layout_xla(ids, w, layout, *, num_experts, rows, fill_rows, zero_fill):
    routes = _token_routes_reference(ids, w, num_experts=num_experts, num_ranks=1)
    i32 = jnp.int32
    lay = layout(routes[0], jnp.full((1,), ids.shape[0], i32), jnp.zeros((1,), i32),
                 experts=num_experts, rows=rows, fill_rows=fill_rows, zero_fill=zero_fill)
    return routes + lay[:7]  # (not the layout kernels' scratch)


def _local_layout_abstract(ids, w, *, num_experts, rows, fill_rows, zero_fill, kernel):
    T, K = ids.shape
    routes = _token_routes_abstract(ids, w, num_experts=num_experts, num_ranks=1, kernel=kernel)
    lay = _expert_layout_abstract(routes[0], ids.update(shape=(1,), weak_type=False),
                                  ids.update(shape=(1,), weak_type=False), experts=num_experts,
                                  rows=rows, fill_rows=fill_rows, zero_fill=zero_fill,
                                  kernel=kernel)
    return routes + lay[:7]


def _local_layout_jvp(primals, tangents, **params):
    """Only the weights are differentiable: ``route``'s weight columns and ``recv_weights``,
    each a masked copy (the two ops' rules)."""
    out = local_layout_p.bind(*primals, **params)
    tangent_out = [_zero_tangent(o) for o in out]
    t = tangents[1]
    if type(t) is not ad.Zero:  # (one rank: every valid slot is here)
        tangent_out[0], tangent_out[8] = _route_tangent(primals[0], t, params["num_experts"])
    return out, tangent_out


local_layout_p = _primitive(
    "ep_comm_rows_local_layout", _local_layout_reference, _local_layout_abstract,
    ("num_experts", "rows", "fill_rows", "zero_fill", "kernel"),
    ffi_attrs=lambda *, zero_fill, **_: dict(zero_fill=np.int64(zero_fill)),
    fast=_local_layout_fast,
    kernel_fits=lambda ctx, *, num_experts, **_: local_layout_fits(
        *ctx.avals_in[0].shape, num_experts),
    multiple_results=True)
ad.primitive_jvps[local_layout_p] = _local_layout_jvp


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
    table, idx, weights = _same_vma(table, idx, weights)
    return gather_sum_p.bind(table, idx, weights, out_dtype=out_dtype, kernel=_lowering())


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
        return out, _zero_tangent(out)
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


gather_sum_p = _primitive(
    "ep_comm_rows_gather_sum", _gather_sum_reference, _gather_sum_abstract,
    ("out_dtype", "kernel"), fast=functools.partial(_gather_sum_reference, mode="clip"),
    kernel_fits=lambda ctx, *, out_dtype, kernel: all(
        d in _KERNEL_DTYPES for d in (ctx.avals_in[0].dtype, out_dtype)))
ad.primitive_jvps[gather_sum_p] = _gather_sum_jvp
ad.primitive_transposes[gather_sum_p] = _gather_sum_transpose


# --- scatter_dequant (the FP8 wire's receive side) ------------------------------------------------

def e8m0_scales(exponents):
    """Float32 ``2 ** (e - 127)`` of E8M0 biased exponents (uint8), NaN for 255 (E8M0's NaN)."""
    e = exponents.astype(jnp.int32) - 127
    return jnp.where(exponents == 255, jnp.nan, jnp.ldexp(jnp.float32(1.0), e))


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
_E4M3_EMAX = 8  # 448 = 1.75 * 2**8
_E8M0_BIAS = 127
_E8M0_NAN = 255
_F32_TINY = np.float32(2.0 ** -126)  # float32's smallest normal


def quantize_blocks(x, block: int, mx: bool):
    """``(values, scales)`` of ``(T, H)`` floating ``x`` per block of ``block`` elements along the
    last axis (``ep_comm.wire``'s formats: its docstring has the rounding, saturation and
    non-finite policy): ``values`` ``(T, H)`` float8_e4m3fn, ``scales`` ``(T, ceil(H / block))``
    float32 (``amax / 448``) or, with ``mx``, uint8 E8M0 exponents."""
    T, H = x.shape
    nb = -(-H // block)
    xb = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - H))).reshape(T, nb, block)
    # subnormal inputs count as (signed) zero and no scale is subnormal: no step depends on
    # whether a platform flushes subnormals (XLA's CPU backend does, IEEE GPU code does not)
    xb = jnp.where(jnp.abs(xb) < _F32_TINY, jnp.copysign(np.float32(0.0), xb), xb)
    finite = jnp.all(jnp.isfinite(xb), axis=2, keepdims=True)
    amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0), axis=2, keepdims=True)
    if not mx:
        # amax / 448 and x / scale written as the multiplications XLA's simplifier makes of them
        # anyway (float32, each rounded to nearest), so the math is explicit wherever it runs
        scale = jnp.where(amax > 0, jnp.maximum(amax * np.float32(1.0 / E4M3_MAX), _F32_TINY),
                          1.0)
        scale = jnp.where(finite, scale, jnp.nan)
        q = xb * (np.float32(1.0) / scale)
        stored = scale[..., 0]
    else:
        # power-of-two scale: 2**(floor(log2(amax)) - 8), exponent clamped to e8m0's range;
        # frexp and ldexp keep every step exact (amax = m * 2**k, m in [0.5, 1))
        # (at least 2**-126 but for an all-zero block: no scale is subnormal either)
        _, k = jnp.frexp(jnp.where(amax > 0, amax, 1.0))
        e = jnp.where(amax > 0, jnp.maximum(k - 1 - _E4M3_EMAX, 1 - _E8M0_BIAS), -_E8M0_BIAS)
        e = jnp.minimum(e, _E8M0_BIAS).astype(jnp.int32)
        q = jnp.ldexp(xb, -e)
        stored = jnp.where(finite, e + _E8M0_BIAS, _E8M0_NAN)[..., 0].astype(jnp.uint8)
        q = jnp.where(finite, q, jnp.nan)
    q = jnp.where(jnp.isnan(q), q, jnp.clip(q, -E4M3_MAX, E4M3_MAX))  # saturate, keep NaN
    values = q.reshape(T, -1)[:, :H].astype(jnp.float8_e4m3fn)
    return values, stored


def dequantize_blocks(values, scales, block: int, dtype):
    """``values * scale`` per block of ``block`` elements along the last axis, in float32 (NaN
    everywhere in a block whose scale is NaN; a product below ``2**-126`` in magnitude is signed
    zero, on every platform), rounded once to ``dtype``. ``values``: ``(T, H)`` FP8; ``scales``:
    ``(T, ceil(H / block))`` float32."""
    T, H = values.shape
    nb = -(-H // block)
    # (a barrier: in one program with the quantization, XLA's GPU simplifier, allowed excess
    # precision, folds float32 -> e4m3 -> float32 into nothing and skips the rounding)
    values = jax.lax.optimization_barrier(values)
    vb = jnp.pad(values.astype(jnp.float32), ((0, 0), (0, nb * block - H))).reshape(T, nb, block)
    s = scales.astype(jnp.float32)[..., None]
    r = vb * s
    r = jnp.where(jnp.abs(r) < _F32_TINY, jnp.copysign(np.float32(0.0), r), r)
    return jnp.where(jnp.isnan(s), jnp.nan, r).reshape(T, -1)[:, :H].astype(dtype)


def scale_bytes(hidden: int, block: int, mx: bool) -> int:
    """Bytes of an FP8 wire row's scales: one E8M0 byte (``mx``) or float32 per block."""
    return -(-hidden // block) * (1 if mx else 4)


def fp8_from_bytes(values, scales, mx: bool):
    """``(values, scales)`` typed (float8_e4m3fn; uint8 E8M0 with ``mx``, else float32) from
    their wire bytes ``(M, H)`` and ``(M, scale bytes)`` uint8 (bitcasts: no pass over rows)."""
    values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    if mx:
        return values, scales
    return values, jax.lax.bitcast_convert_type(scales.reshape(scales.shape[0], -1, 4),
                                                jnp.float32)


def split_fp8_rows(rows, hidden: int, block: int, mx: bool):
    """``(values, scales)`` of FP8 wire rows (``hidden`` e4m3 bytes, then the block scales:
    E8M0 bytes with ``mx``, else float32 as 4 bytes each); scales as stored (uint8 or float32)."""
    return fp8_from_bytes(rows[:, :hidden], rows[:, hidden:hidden + scale_bytes(hidden, block, mx)],
                          mx)


def fp8_rows(x, block: int, mx: bool):
    """``(T, H)`` rows as FP8 wire rows: the e4m3 values, then the row's block scales (float32 as
    4 bytes each, or E8M0 bytes), uint8 ``(T, H + scale bytes)`` (:func:`split_fp8_rows` is the
    inverse)."""
    values, scales = quantize_blocks(x, block, mx)
    tail = scales if mx else jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(
        values.shape[0], -1)
    return jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8), tail], axis=1)


def scatter_dequant(table, pos, fill, rows: int, *, hidden: int, block: int, mx: bool, dtype):
    """FP8 wire rows (uint8 ``(N, row bytes)``, see :func:`split_fp8_rows`) dequantized into
    ``(rows, hidden)`` ``dtype`` and placed as :func:`scatter` places rows (row ``pos[n, k]``:
    ``table[n]`` dequantized; ``fill``: zero; others unspecified), each FP8 row read and
    dequantized once. Not differentiable (bytes)."""
    table = jnp.asarray(table)
    pos = jnp.asarray(pos).astype(jnp.int32)
    fill = jnp.asarray(fill).astype(jnp.int32)
    need = hidden + scale_bytes(hidden, block, mx)
    if (table.dtype != jnp.uint8 or table.ndim != 2 or table.shape[1] < need or pos.ndim != 2
            or pos.shape[0] != table.shape[0] or fill.ndim != 1):
        raise ValueError(f"row_kernels.scatter_dequant: table must be uint8 (N, >= {need}), pos "
                         f"(N, K) and fill 1-D, got table {table.dtype} {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)} and fill {tuple(fill.shape)}")
    if int(rows) < 0:
        raise ValueError(f"row_kernels.scatter_dequant: rows must be >= 0, got {rows}")
    table, pos, fill = _same_vma(table, pos, fill)
    return scatter_dequant_p.bind(table, pos, fill, rows=int(rows), hidden=int(hidden),
                                  block=int(block), mx=bool(mx), dtype=np.dtype(dtype),
                                  kernel=_lowering())


def _scatter_dequant_reference(table, pos, fill, *, rows, hidden, block, mx, dtype, kernel=None,
                               place=_scatter_reference):
    # (place: how rows are placed; the fast lowering passes _scatter_fast)
    raw = place(table, pos, fill, rows=rows)
    values, scales = split_fp8_rows(raw, hidden, block, mx)
    return dequantize_blocks(values, e8m0_scales(scales) if mx else scales, block, dtype)


scatter_dequant_p = _primitive(
    "ep_comm_rows_scatter_dequant", _scatter_dequant_reference,
    lambda table, pos, fill, *, rows, hidden, block, mx, dtype, kernel: table.update(
        shape=(rows, hidden), dtype=dtype, weak_type=False),
    ("rows", "hidden", "block", "mx", "dtype", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    fast=functools.partial(_scatter_dequant_reference, place=_scatter_fast))
_constant_jvp(scatter_dequant_p)


def scatter_fake_quant(table, pos, fill, rows: int, *, block: int, mx: bool):
    """Rows of ``table`` ``(N, H)`` after the FP8 wire's round trip (:func:`quantize_blocks`, then
    :func:`dequantize_blocks` to the table's dtype), placed as :func:`scatter` places rows: the
    values dispatch delivers with a wire format when nothing crosses a wire (one rank), each row
    read once and quantized in registers (no FP8 buffer). The bytes never exist, so no gradient
    flows through them: the result is constant in ``table`` (dispatch attaches the
    straight-through gradient)."""
    table, pos, fill = _quantizing_scatter_args("scatter_fake_quant", table, pos, fill, rows,
                                                block)
    return scatter_fake_quant_p.bind(table, pos, fill, rows=int(rows), block=int(block),
                                     mx=bool(mx), kernel=_lowering())


def _quantizing_scatter_args(api, table, pos, fill, rows, block):
    """The checked operands of :func:`scatter_fake_quant` and :func:`scatter_quant` (the table
    behind a stop_gradient: bytes carry no gradient)."""
    table = jnp.asarray(table)
    pos = jnp.asarray(pos).astype(jnp.int32)
    fill = jnp.asarray(fill).astype(jnp.int32)
    if (table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating) or pos.ndim != 2
            or pos.shape[0] != table.shape[0] or fill.ndim != 1):
        raise ValueError(f"row_kernels.{api}: table must be floating (N, H), pos (N, K) and fill "
                         f"1-D, got table {table.dtype} {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)} and fill {tuple(fill.shape)}")
    if int(rows) < 0 or int(block) < 1:
        raise ValueError(f"row_kernels.{api}: rows must be >= 0 and block >= 1, got rows={rows} "
                         f"and block={block}")
    return _same_vma(jax.lax.stop_gradient(table), pos, fill)


def _scatter_fake_quant_reference(table, pos, fill, *, rows, block, mx, kernel=None,
                                  place=_scatter_reference):
    # the wire's path itself: the rows as wire rows, scattered, then dequantized
    return _scatter_dequant_reference(fp8_rows(table, block, mx), pos, fill, rows=rows,
                                      hidden=table.shape[1], block=block, mx=mx,
                                      dtype=table.dtype, place=place)


def _fake_quant_fits(ctx, *, block, **_):
    """The kernel's shapes: 16-bit or float32 rows of whole blocks of 1-32 16-byte pieces."""
    table = ctx.avals_in[0]
    v = 16 // table.dtype.itemsize
    g = block // v if block % v == 0 else 0
    return (table.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) and 1 <= g <= 32
            and g & (g - 1) == 0 and table.shape[1] % block == 0)


scatter_fake_quant_p = _primitive(
    "ep_comm_rows_scatter_fake_quant", _scatter_fake_quant_reference,
    lambda table, pos, fill, *, rows, block, mx, kernel: table.update(
        shape=(rows, table.shape[1]), weak_type=False),
    ("rows", "block", "mx", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    kernel_fits=_fake_quant_fits,
    fast=functools.partial(_scatter_fake_quant_reference, place=_scatter_fast))


_constant_jvp(scatter_fake_quant_p)


def scatter_quant(table, pos, fill, rows: int, *, block: int, mx: bool):
    """:func:`scatter_fake_quant`'s rows kept quantized: ``(values, scales)`` uint8 ``(rows, H)``
    and ``(rows, scale bytes)``, the two byte ranges of each FP8 wire row (:func:`fp8_rows`)
    placed as :func:`scatter` places rows (zero rows: both zero); each table row read once and
    quantized in registers. Not differentiable (bytes)."""
    table, pos, fill = _quantizing_scatter_args("scatter_quant", table, pos, fill, rows, block)
    values, scales = scatter_quant_p.bind(table, pos, fill, rows=int(rows), block=int(block),
                                          mx=bool(mx), kernel=_lowering())
    return values, scales


def _scatter_quant_reference(table, pos, fill, *, rows, block, mx, kernel=None,
                             place=_scatter_reference):
    H = table.shape[1]
    wire_rows = fp8_rows(table, block, mx)
    return [place(wire_rows, pos, fill, rows=rows, columns=c)
            for c in ((0, H), (H, H + scale_bytes(H, block, mx)))]


def _scatter_quant_abstract(table, pos, fill, *, rows, block, mx, kernel):
    u8 = lambda *shape: table.update(shape=shape, dtype=jnp.uint8, weak_type=False)  # noqa: E731
    H = table.shape[1]
    return [u8(rows, H), u8(rows, scale_bytes(H, block, mx))]


scatter_quant_p = _primitive(
    "ep_comm_rows_scatter_quant", _scatter_quant_reference, _scatter_quant_abstract,
    ("rows", "block", "mx", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    kernel_fits=_fake_quant_fits, multiple_results=True,
    fast=functools.partial(_scatter_quant_reference, place=_scatter_fast))
_constant_jvp(scatter_quant_p)


# --- empty ----------------------------------------------------------------------------------------

_empty_ids = itertools.count(1)


def empty(shape, dtype):
    """A ``shape`` buffer of ``dtype`` whose values are unspecified (GPU kernels: not written;
    XLA: NaN, or all bits set for integers). Each call is a distinct buffer."""
    shape = tuple(int(d) for d in shape)
    return empty_p.bind(shape=shape, dtype=np.dtype(dtype), uid=next(_empty_ids),
                        kernel=_lowering())


def _empty_reference(*, shape, dtype, uid=None, kernel=None):
    return jnp.full(shape, _poison(dtype))


empty_p = _primitive(
    "ep_comm_rows_empty", _empty_reference,
    lambda *, shape, dtype, uid, kernel: jax.core.ShapedArray(shape, dtype),
    ("shape", "dtype", "uid", "kernel"), ffi_attrs=lambda *, uid, **_: dict(id=np.int64(uid)))


def _registered() -> bool:
    """Register the kernels with XLA (once); False when they are not built here."""
    if available() is not None:
        return False
    bootstrap.register_targets("rows")
    return True
