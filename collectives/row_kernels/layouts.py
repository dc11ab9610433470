"""The layouts of dispatch: :func:`rank_by_key` (a stable counting sort), :func:`token_routes`
(the sender's side), :func:`expert_layout` (the receiver's side) and :func:`local_layout` (one
rank: both in one launch) (``collectives/csrc/row_kernels/layouts.cu``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from ep_comm.collectives.row_kernels.primitive import (lowering, poison, primitive, reference_only,
                                                       same_vma, zero_tangent)

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
    return key_count_p.bind(key, num_keys=int(num_keys), kernel=lowering())


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
    key, base = same_vma(key, base)
    out = key_rank_p.bind(key, base, kernel=lowering())
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
    inverse = jnp.full((M,), poison(jnp.int32)).at[jnp.where((rank >= 0) & (rank < M), rank, M)
                                                     ].set(i, mode="drop")
    return jnp.stack([rank, inverse])


key_count_p = primitive(
    "ep_comm_rows_key_count", _key_count_reference,
    lambda key, *, num_keys, kernel: key.update(
        shape=(_chunks(key.shape[0]), num_keys), dtype=jnp.int32, weak_type=False),
    ("num_keys", "kernel"), kernel_fits=lambda ctx, *, num_keys, kernel: num_keys <= MAX_RANK_KEYS)
key_rank_p = primitive(
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
    return same_vma(ids.astype(jnp.int32), w.astype(jnp.float32))


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
        ids, w, num_experts=E, num_ranks=n, kernel=lowering())
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
    tangent_out = [zero_tangent(o) for o in out]
    t = tangents[1]
    if type(t) is not ad.Zero:
        tangent_out[0] = _route_tangent(primals[0], t, params["num_experts"])[0]
    return out, tangent_out


def _route_tangent(ids, t, num_experts):
    """``route``'s tangent (the weights' where the slot is valid, zero ids) and the valid
    slots' weight tangent alone."""
    valid_t = jnp.where((ids >= 0) & (ids < num_experts), t, 0.0)
    return jnp.concatenate([valid_t, jnp.zeros_like(t)], axis=1), valid_t


token_routes_p = primitive(
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
    route, *scalars = same_vma(route, *scalars)
    out = expert_layout_p.bind(route, *scalars, experts=int(experts), rows=int(rows),
                               fill_rows=int(rows if zero_fill else min(fill_rows, rows)),
                               zero_fill=bool(zero_fill), kernel=lowering())
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


expert_layout_p = primitive(
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
    tangent_out = [zero_tangent(o) for o in out]
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
                              zero_fill=bool(zero_fill), kernel=lowering())
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
    tangent_out = [zero_tangent(o) for o in out]
    t = tangents[1]
    if type(t) is not ad.Zero:  # (one rank: every valid slot is here)
        tangent_out[0], tangent_out[8] = _route_tangent(primals[0], t, params["num_experts"])
    return out, tangent_out


local_layout_p = primitive(
    "ep_comm_rows_local_layout", _local_layout_reference, _local_layout_abstract,
    ("num_experts", "rows", "fill_rows", "zero_fill", "kernel"),
    ffi_attrs=lambda *, zero_fill, **_: dict(zero_fill=np.int64(zero_fill)),
    fast=_local_layout_fast,
    kernel_fits=lambda ctx, *, num_experts, **_: local_layout_fits(
        *ctx.avals_in[0].shape, num_experts),
    multiple_results=True)
ad.primitive_jvps[local_layout_p] = _local_layout_jvp


