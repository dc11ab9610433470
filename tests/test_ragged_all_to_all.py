"""ep_comm.ragged_all_to_all against a numpy model of jax.lax.ragged_all_to_all's semantics."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (bfloat16 for numpy, shipped with jax)
import numpy as np
import pytest

from ep_comm import collectives
import ep_comm
from conftest import BACKENDS

N_ROWS, M_ROWS, D = 24, 32, 3


def make_case(rng, n, groups=None, m=1, skew=False, empty_ranks=()):
    """Random well-formed call: per-rank (operand, output, io, ss, oo, rs) as full numpy arrays.

    ``groups``: list of member lists (default one group of all ranks); ``m`` segments per peer.
    Segments are laid out in random order with random gaps on both sides.
    """
    groups = groups or [list(range(n))]
    g = len(groups[0])
    K = g * m
    sizes = np.zeros((n, K), np.int64)  # sizes[s, d_pos*m + j]
    for grp in groups:
        each = min(N_ROWS, M_ROWS) // K
        for s in grp:
            sizes[s] = rng.integers(0, each + 1, K)
            if rng.random() < 0.3:
                sizes[s, rng.integers(K)] = 0
        if skew:  # the first member sends everything it can to the first member, others nothing
            s0 = grp[0]
            sizes[grp] = 0
            sizes[s0, 0] = min(N_ROWS, M_ROWS)
    for r in empty_ranks:
        sizes[r] = 0
    pos = {r: (gi, grp.index(r)) for gi, grp in enumerate(groups) for r in grp}

    def layout(seg_sizes, total):
        order = rng.permutation(len(seg_sizes))
        slack = total - seg_sizes.sum()
        assert slack >= 0
        gaps = rng.multinomial(slack, np.ones(len(seg_sizes) + 1) / (len(seg_sizes) + 1))
        offs = np.zeros(len(seg_sizes), np.int64)
        cur = gaps[0]
        for idx, seg in enumerate(order):
            offs[seg] = cur
            cur += seg_sizes[seg] + gaps[idx + 1]
        return offs

    io = np.stack([layout(sizes[s], N_ROWS) for s in range(n)])
    rs = np.zeros((n, K), np.int64)
    oo = np.zeros((n, K), np.int64)
    for d in range(n):
        gi, dpos = pos[d]
        grp = groups[gi]
        incoming = np.array([sizes[s, dpos * m + j] for s in grp for j in range(m)])
        rs[d] = incoming
        offs = layout(incoming, M_ROWS)
        for spos, s in enumerate(grp):
            for j in range(m):
                oo[s, dpos * m + j] = offs[spos * m + j]
    return sizes, io, oo, rs, groups, m


def reference(operand, output, io, ss, oo, rs, groups, m):
    """Per the docstring of jax.lax.ragged_all_to_all; operand/output are (n, rows, ...)."""
    out = output.copy()
    for grp in groups:
        for spos, s in enumerate(grp):
            for dpos, d in enumerate(grp):
                for j in range(m):
                    i = dpos * m + j
                    size = ss[s, i]
                    assert size == rs[d, spos * m + j]
                    out[d, oo[s, i]:oo[s, i] + size] = operand[s, io[s, i]:io[s, i] + size]
    return out


@functools.lru_cache(maxsize=None)
def program(sharded, groups, backend):
    """The exchange, jitted once per (groups, backend); shapes and dtypes retrace as usual."""
    def f(a, b, c, d, e, f_):
        return ep_comm.ragged_all_to_all(a, b, c, d, e, f_, axis_name="ep",
                                         axis_index_groups=groups and [list(g) for g in groups],
                                         backend=backend)

    return sharded.smap(f)


def run(sharded, n, operand, output, io, ss, oo, rs, groups=None, backend="portable"):
    groups = groups and tuple(tuple(g) for g in groups)
    args = [operand.reshape(n * operand.shape[1], *operand.shape[2:]),
            output.reshape(n * output.shape[1], *output.shape[2:])]
    args += [a.astype(np.int32).reshape(-1) for a in (io, ss, oo, rs)]
    res = sharded.get(program(sharded, groups, backend)(*sharded.put(*args)))
    return res.reshape(output.shape)


def data(rng, n, dtype):
    if np.dtype(dtype).kind == "i":
        return (rng.integers(-1000, 1000, (n, N_ROWS, D)).astype(dtype),
                rng.integers(-1000, 1000, (n, M_ROWS, D)).astype(dtype))
    return (rng.standard_normal((n, N_ROWS, D)).astype(dtype),
            np.full((n, M_ROWS, D), np.nan).astype(dtype))  # poison: unwritten rows stay NaN


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("kind", ["random", "skew", "empty", "two_per_peer"])
def test_matches_reference(sharded, n, rng, dtype, kind, backend):
    case = make_case(rng, n, skew=kind == "skew", m=2 if kind == "two_per_peer" else 1,
                     empty_ranks=range(0, n, 2) if kind == "empty" else ())
    sizes, io, oo, rs, groups, m = case
    operand, output = data(rng, n, dtype)
    got = run(sharded, n, operand, output, io, sizes, oo, rs, backend=backend)
    want = reference(operand, output, io, sizes, oo, rs, groups, m)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),  # bit for bit
                                  np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_axis_index_groups(sharded, n, rng, backend):
    if n % 2:
        pytest.skip("needs an even number of devices")
    half = n // 2
    for groups in ([list(range(half)), list(range(half, n))],
                   [list(range(0, n, 2)), list(range(1, n, 2))]):
        sizes, io, oo, rs, groups, m = make_case(rng, n, groups=groups)
        operand, output = data(rng, n, "float32")
        got = run(sharded, n, operand, output, io, sizes, oo, rs, groups=groups, backend=backend)
        want = reference(operand, output, io, sizes, oo, rs, groups, m)
        np.testing.assert_array_equal(got, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_operand_and_output(sharded, n, rng, backend):
    sizes, io, oo, rs, groups, m = make_case(rng, n)
    operand = rng.standard_normal((n, N_ROWS, D)).astype(np.float32)
    output = rng.standard_normal((n, M_ROWS, D)).astype(np.float32)
    cot = rng.standard_normal((n, M_ROWS, D)).astype(np.float32)

    def loss(a, b, c, io_, ss_, oo_, rs_):
        y = ep_comm.ragged_all_to_all(a, b, io_, ss_, oo_, rs_, axis_name="ep",
                                      backend=backend)
        return jax.lax.psum(jnp.sum(y * c), "ep")

    def f(*args):
        ga, gb = jax.grad(loss, argnums=(0, 1))(*args)
        return ga, gb

    args = [operand.reshape(-1, D), output.reshape(-1, D), cot.reshape(-1, D)]
    args += [a.astype(np.int32).reshape(-1) for a in (io, sizes, oo, rs)]
    ga, gb = sharded.get(sharded.smap(f)(*sharded.put(*args)))
    # The exchange is linear data movement: d/d operand routes the cotangent back to the sent
    # rows, d/d output keeps the cotangent only where nothing was written.
    want_a = np.zeros_like(operand)
    want_b = cot.copy()
    for s in range(n):
        for d in range(n):
            size, src, dst = sizes[s, d], io[s, d], oo[s, d]
            want_a[s, src:src + size] += cot[d, dst:dst + size]
            want_b[d, dst:dst + size] = 0
    np.testing.assert_allclose(ga.reshape(want_a.shape), want_a, rtol=0, atol=0)
    np.testing.assert_allclose(gb.reshape(want_b.shape), want_b, rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_is_exchange_of_tangents(sharded, n, rng, backend):
    sizes, io, oo, rs, groups, m = make_case(rng, n)
    a, b, ta, tb = (rng.standard_normal((n * r, D)).astype(np.float32)
                    for r in (N_ROWS, M_ROWS, N_ROWS, M_ROWS))
    ints = [x.astype(np.int32).reshape(-1) for x in (io, sizes, oo, rs)]

    def f(a, b, ta, tb, *ints):
        g = lambda a, b: ep_comm.ragged_all_to_all(a, b, *ints, axis_name="ep",
                                                   backend=backend)
        _, t_out = jax.jvp(g, (a, b), (ta, tb))
        return t_out, g(ta, tb)

    t_out, direct = sharded.get(sharded.smap(f)(*sharded.put(a, b, ta, tb, *ints)))
    np.testing.assert_array_equal(t_out, direct)


def rank_major(per_batch):
    """[(n, ...)] * batch -> global rows ordered (rank, batch, ...), as shard_map splits them."""
    x = np.swapaxes(np.stack(per_batch), 0, 1)
    return x.reshape(-1, *x.shape[3:]) if x.ndim > 3 else x.reshape(-1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_a_batch(sharded, n, rng, backend):
    batch = 3
    cases = [make_case(rng, n) for _ in range(batch)]
    datas = [data(rng, n, "float32") for _ in range(batch)]

    def f(a, b, *ints):
        a, b = a.reshape(batch, N_ROWS, D), b.reshape(batch, M_ROWS, D)
        ints = [x.reshape(batch, -1) for x in ints]
        g = lambda *z: ep_comm.ragged_all_to_all(*z, axis_name="ep", backend=backend)
        return jax.vmap(g)(a, b, *ints).reshape(-1, D)

    args = [rank_major([d[0] for d in datas]), rank_major([d[1] for d in datas])]
    for field in (1, 0, 2, 3):  # input_offsets, send_sizes, output_offsets, recv_sizes
        args.append(rank_major([c[field].astype(np.int32) for c in cases]))
    got = sharded.get(sharded.smap(f)(*sharded.put(*args)))
    got = np.swapaxes(got.reshape(n, batch, M_ROWS, D), 0, 1)
    for bi, (sizes, io, oo, rs, groups, m) in enumerate(cases):
        want = reference(datas[bi][0], datas[bi][1], io, sizes, oo, rs, groups, m)
        np.testing.assert_array_equal(got[bi], want)


def test_wire_rows_reports_padding():
    assert collectives.portable.wire_rows(24, 32, 8) == 8 * 24
    assert collectives.portable.slot_rows(40, 32) == 32


# ---- errors ---------------------------------------------------------------------------------------

def _call(sharded, n, **over):
    args = dict(operand=np.zeros((n * 4, 2), np.float32), output=np.zeros((n * 4, 2), np.float32),
                input_offsets=np.zeros(n * n, np.int32), send_sizes=np.zeros(n * n, np.int32),
                output_offsets=np.zeros(n * n, np.int32), recv_sizes=np.zeros(n * n, np.int32))
    kw = dict(axis_name="ep", backend="portable")
    kw.update(over.pop("kw", {}))
    args.update(over)
    names = list(args)

    def f(*a):
        return ep_comm.ragged_all_to_all(*a, **kw)

    vals = [args[k] for k in names]
    return sharded.smap(f)(*sharded.put(*vals))


@pytest.mark.parametrize("name", ["input_offsets", "send_sizes", "output_offsets", "recv_sizes"])
def test_error_offsets_must_be_integer(sharded, n, name):
    with pytest.raises(ValueError, match=re.escape(f"ragged_all_to_all {name} must be integer type.")):
        _call(sharded, n, **{name: np.zeros(n * n, np.float32)})


@pytest.mark.parametrize("name", ["input_offsets", "send_sizes", "output_offsets", "recv_sizes"])
def test_error_offsets_must_be_rank_1(sharded, n, name):
    msg = (f"ragged_all_to_all {name} must be rank 1 with positive dimension size, but got shape "
           f"(1, {n})")
    with pytest.raises(ValueError, match=re.escape(msg)):
        _call(sharded, n, **{name: np.zeros((n, n), np.int32)})


def test_error_dtype_mismatch(sharded, n):
    with pytest.raises(ValueError, match=re.escape(
            "ragged_all_to_all: operand and output must have the same dtype, got float32 and int32")):
        _call(sharded, n, output=np.zeros((n * 4, 2), np.int32))


def test_error_trailing_shape_mismatch(sharded, n):
    with pytest.raises(ValueError, match=re.escape(
            "ragged_all_to_all: operand and output must agree on every dimension but the first, "
            "got shapes (4, 2) and (4, 3)")):
        _call(sharded, n, output=np.zeros((n * 4, 3), np.float32))


def test_error_length_mismatch(sharded, n):
    with pytest.raises(ValueError, match=re.escape(
            f"ragged_all_to_all: input_offsets, send_sizes, output_offsets and recv_sizes must have "
            f"the same length, got ({n},), ({n},), ({n},), ({n + 1},)")):
        _call(sharded, n, recv_sizes=np.zeros((n + 1) * n, np.int32))


def test_error_length_not_multiple_of_group(sharded, n):
    if n == 1:
        pytest.skip("every length is a multiple of 1")
    k = n + 1
    with pytest.raises(ValueError, match=re.escape(
            f"ragged_all_to_all: the offsets and sizes have length {k}, which is not a multiple of "
            f"the number of participants {n} (axis 'ep')")):
        _call(sharded, n, **{a: np.zeros(n * k, np.int32) for a in
                             ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")})


def test_error_bad_groups(sharded, n):
    with pytest.raises(ValueError, match=re.escape(
            f"ragged_all_to_all: axis_index_groups must cover every axis index 0..{n - 1} exactly "
            f"once, got [[0], [0]]")):
        _call(sharded, n, kw=dict(axis_index_groups=[[0], [0]]))
    with pytest.raises(ValueError, match=re.escape(
            "ragged_all_to_all: axis_index_groups must be non-empty groups of equal size, got sizes "
            "[1, 2]")):
        _call(sharded, n, kw=dict(axis_index_groups=[[0], [1, 2]]))


def test_error_unknown_backend(sharded, n):
    with pytest.raises(ValueError, match=re.escape(
            "ragged_all_to_all: backend must be one of ('auto', 'portable', 'xla', 'mpi', 'nccl'), "
            "got 'nccl2'")):
        _call(sharded, n, kw=dict(backend="nccl2"))


def test_error_xla_backend_on_cpu(sharded, n):
    if collectives.available()["xla"] is None:
        pytest.skip("this platform has a native ragged all-to-all")
    with pytest.raises(ValueError, match=re.escape(
            "ragged_all_to_all: backend='xla' is not available here: XLA:CPU does not implement the "
            "ragged-all-to-all HLO; use backend='portable' or 'auto'")):
        _call(sharded, n, kw=dict(backend="xla"))


def test_error_outside_shard_map():
    z = jnp.zeros(4, jnp.int32)
    with pytest.raises(NameError, match=re.escape(
            "ragged_all_to_all: axis_name 'ep' is not bound here (unbound axis name: ep). Call "
            "ragged_all_to_all inside jax.shard_map(..., mesh=mesh) over a mesh that has this axis.")):
        ep_comm.ragged_all_to_all(jnp.zeros((4, 2)), jnp.zeros((4, 2)), z, z, z, z, axis_name="ep")


def test_auto_picks_nccl_on_gpus_where_built():
    assert collectives.resolve_transport("auto", "cpu")[0] == "portable"
    nccl_reason = collectives.available("cuda")["nccl"]
    assert collectives.resolve_transport("auto", "cuda")[0] == ("nccl" if nccl_reason is None else "portable")
    assert collectives.resolve_transport("xla", "cuda")[0] == "xla"


# ---- the async pair ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_start_done_equals_the_fused_exchange(sharded, n, rng, backend):
    sizes, io, oo, rs, groups, m = make_case(rng, n)
    operand, output = data(rng, n, "float32")
    b = rng.standard_normal((D, D)).astype(np.float32)

    def f(a, out, *ints):
        pending = ep_comm.ragged_all_to_all_start(a, out, *ints, axis_name="ep", backend=backend)
        a, pending = jax.lax.optimization_barrier((a, pending))
        y = a @ b  # work between start and done
        y, pending = jax.lax.optimization_barrier((y, pending))
        return ep_comm.ragged_all_to_all_done(pending), y

    args = [operand.reshape(-1, D), output.reshape(-1, D)]
    args += [x.astype(np.int32).reshape(-1) for x in (io, sizes, oo, rs)]
    got, y = sharded.get(sharded.smap(f)(*sharded.put(*args)))
    want = reference(operand, output, io, sizes, oo, rs, groups, m)
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    np.testing.assert_allclose(y, operand.reshape(-1, D) @ b, rtol=1e-5, atol=1e-5)


def test_done_needs_a_pending_exchange():
    with pytest.raises(TypeError, match=re.escape(
            "ragged_all_to_all_done: expected the PendingExchange returned by "
            "ragged_all_to_all_start, got ndarray")):
        ep_comm.ragged_all_to_all_done(np.zeros(3))


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", [b for b in ("mpi", "nccl") if b in BACKENDS])
def test_start_done_say_how_to_differentiate(sharded, n, rng, backend):
    sizes, io, oo, rs, groups, m = make_case(rng, n)
    operand, output = data(rng, n, "float32")
    ints = [x.astype(np.int32).reshape(-1) for x in (io, sizes, oo, rs)]

    def f(a, out, *ints):
        def loss(a):
            p = ep_comm.ragged_all_to_all_start(a, out, *ints, axis_name="ep", backend=backend)
            return jnp.sum(ep_comm.ragged_all_to_all_done(p))
        return jax.grad(loss)(a)

    with pytest.raises(NotImplementedError, match=re.escape(
            "ragged_all_to_all_start/done do not support differentiation; use "
            "ep_comm.ragged_all_to_all (the same engine, start and done fused) inside grad/jvp/vmap")):
        sharded.smap(f)(*sharded.put(operand.reshape(-1, D), np.zeros_like(output).reshape(-1, D),
                                      *ints))
