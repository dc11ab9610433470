"""ep_comm.rows: the row gathers of dispatch/combine and their gather-only transposes, against
autodiff of the plain gathers (whose transposes are scatter-adds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ep_comm.rows import gather_rows, masked_gather_sum


def _plain_take(table, idx):
    ok = (idx >= 0) & (idx < table.shape[0])
    rows = jnp.take(table, jnp.clip(idx, 0, table.shape[0] - 1), axis=0)
    return jnp.where(ok[:, None], rows, 0.0)


def _plain_gather_sum(table, idx, ok, w):
    return sum(jnp.where(ok[:, k, None], w[:, k, None] * _plain_take(table, idx[:, k])
                         .astype(jnp.float32), 0.0) for k in range(idx.shape[1]))


@pytest.mark.parametrize("seed", range(4))
def test_gather_rows_transpose_is_the_scatter_add(seed):
    rng = np.random.default_rng(seed)
    N, M, H, J = 7, 20, 5, 4
    # each out row reads one table row or none (-1 / N: out of range), a row at most J times
    idx = rng.integers(-1, N + 1, M).astype(np.int32)
    inv = np.full((N, J), -1, np.int32)
    fill = np.zeros(N, int)
    for i, r in enumerate(idx):
        if 0 <= r < N:
            if fill[r] == J:
                idx[i] = -1
                continue
            inv[r, fill[r]] = i
            fill[r] += 1
    empty = inv < 0  # empty entries: any out-of-range value, in any order
    inv[empty] = rng.choice([-1, M, M + 5], int(empty.sum()))
    inv = rng.permuted(inv, axis=1)
    table = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((M, H)), jnp.float32)
    got, vjp = jax.vjp(lambda t: gather_rows(t, idx, inv), table)
    want, vjp_ref = jax.vjp(lambda t: _plain_take(t, idx), table)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(vjp(cot)[0], vjp_ref(cot)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_transpose_and_weight_gradient(weighted):
    rng = np.random.default_rng(7)
    N, K, Nt, H = 9, 3, 30, 4
    # table rows each read by at most one output row; one row reads one table row twice
    perm = rng.permutation(Nt)[: N * K].reshape(N, K).astype(np.int32)
    perm[2, 2] = perm[2, 0]
    ok = rng.random((N, K)) < 0.8
    table = np.asarray(rng.standard_normal((Nt, H)), np.float32)
    table[perm[~ok][0]] = np.nan  # masked reads of NaN rows contribute exactly zero
    table = jnp.asarray(table)
    w = jnp.asarray(rng.random((N, K)), jnp.float32) if weighted else jnp.ones((N, K))
    cot = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)

    def ours(t, w):
        return masked_gather_sum(t, perm, ok, w if weighted else None)
    got, vjp = jax.vjp(ours, table, w)
    safe = jnp.where(jnp.isnan(table), 0.0, table)
    want, vjp_ref = jax.vjp(lambda t, w: _plain_gather_sum(t, perm, ok, w), safe, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    (dt, dw), (dt_ref, dw_ref) = vjp(cot), vjp_ref(cot)
    np.testing.assert_allclose(dt, dt_ref, rtol=1e-6, atol=1e-6)
    if weighted:
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    assert not np.any(np.isnan(np.asarray(dt)))


def test_transposes_are_gathers_not_scatters():
    """The point of the module: no scatter of (N, H) rows in the backward, where autodiff of the
    plain gathers has one (only scatters of scalars remain)."""
    N, M, H, K = 64, 256, 128, 4
    idx = jnp.arange(M, dtype=jnp.int32) % N
    inv = (jnp.arange(N)[:, None] + N * jnp.arange(K)[None, :]).astype(jnp.int32)
    pos = jnp.arange(M, dtype=jnp.int32)[:, None] + M * jnp.arange(K, dtype=jnp.int32)[None, :]
    ok = jnp.ones((M, K), bool)

    def row_scatters(take, gsum):
        def f(t):
            y = gsum(jnp.tile(take(t), (K, 1)), pos, ok)  # (M, H)
            return jnp.sum(y ** 2)
        # the program as JAX emits it (XLA:CPU may later expand a scatter into a loop)
        hlo = jax.jit(jax.grad(f)).lower(jnp.ones((N, H))).as_text(dialect="hlo")
        return [l for l in hlo.splitlines() if " scatter(" in l and f",{H}]" in l]

    plain = row_scatters(lambda t: _plain_take(t, idx),
                         lambda t, p, o: _plain_gather_sum(t, p, o, jnp.ones(p.shape)))
    assert plain, "the plain gathers' transposes should scatter rows (the check can fail)"
    assert row_scatters(lambda t: gather_rows(t, idx, inv), masked_gather_sum) == []


def test_invariant_table_gets_the_summed_cotangent_inside_shard_map():
    """A table every rank holds alike (not varying over the mesh axis) read by varying work: its
    cotangent is the sum over ranks, as JAX's own gather transposes give."""
    n = min(2, jax.device_count())  # two ranks show it (more only compile longer)
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])
    P = jax.sharding.PartitionSpec
    N, H = 6, 3
    idx = np.array([0, 2, 2, 5], np.int32)
    inv = np.full((N, 2), -1, np.int32)
    inv[0, 0], inv[2, 0], inv[2, 1], inv[5, 0] = 0, 1, 2, 3
    pos = np.array([[0, 1], [2, 3]], np.int32)  # gather_sum over the gathered rows
    table = jnp.asarray(np.random.default_rng(3).standard_normal((N, H)), jnp.float32)
    scale = jnp.arange(1, n + 1, dtype=jnp.float32)  # one per rank: varying work

    # the indices arrive per rank (alike here): the gathers' outputs vary over the axis
    idx_r, pos_r = np.tile(idx, (n, 1)), np.tile(pos, (n, 1))

    def loss(take, gsum):
        def per_rank(t, s, i, p):
            y = gsum(take(t, i[0]) * s[0], p, np.ones((2, 2), bool))
            return jnp.sum(y ** 2, keepdims=True)
        f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("ep"), P("ep"), P("ep")),
                          out_specs=P("ep"))
        return jax.jit(lambda t: jnp.sum(f(t, scale, idx_r, pos_r)))

    got = jax.grad(loss(lambda t, i: gather_rows(t, i, inv), masked_gather_sum))(table)
    want = jax.grad(loss(_plain_take,
                         lambda t, p, o: _plain_gather_sum(t, p, o, jnp.ones(p.shape))))(table)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
