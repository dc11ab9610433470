"""ep_comm in a real model: parameters sharded from the first byte, data x expert parallel meshes
(with FSDP), and run-time errors a caller can catch (docs/parallelism.md, docs/concepts.md)."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from moe_reference import Reference, check_nnx_against_dense, dense_swiglu_moe
from test_dispatch_combine import config as dispatch_config, inputs as dispatch_inputs, T as DT

T, H, I, K = 8, 16, 8, 2  # tokens per device, hidden, expert width, top-k


def data_ep_mesh(axis_type="Explicit"):
    """``("data", "ep")`` over every device: 2 x n/2."""
    n = jax.device_count()
    if n < 4 or n % 2:
        pytest.skip(f"a data x expert mesh needs an even device count of at least 4, got {n}")
    t = getattr(jax.sharding.AxisType, axis_type)
    return jax.make_mesh((2, n // 2), ("data", "ep"), axis_types=(t, t))


def on(mesh, spec, a):
    return ep_comm.distributed.global_array(a, NamedSharding(mesh, spec))


# ---- parameters sharded from the first byte ------------------------------------------------------

@pytest.mark.parametrize("fsdp", [False, True])
def test_nnx_parameters_are_made_sharded(fsdp):
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE, param_initializer

    mesh = data_ep_mesh()
    d, e = mesh.shape["data"], mesh.shape["ep"]
    E = 2 * e
    m = MoE(H, I, E, K, mesh=mesh, fsdp=fsdp, shared_intermediate=I, rngs=nnx.Rngs(0))
    split_h = d if fsdp else 1
    for name, shape in (("w_in", (E, H, 2 * I)), ("w_out", (E, I, H))):
        a = getattr(m, name)[...]
        want = (E // e, shape[1] // split_h, shape[2])
        assert a.shape == shape
        # every device holds its experts' block (of H / data with FSDP), nothing more
        assert {s.data.shape for s in a.addressable_shards} == {want}, name
        assert a.sharding.spec == P("ep", "data" if fsdp else None, None)
    assert m.router[...].sharding.spec == P("data" if fsdp else None, None)
    assert nnx.get_partition_spec(nnx.state(m)).w_in.get_value() == P("ep", "data" if fsdp
                                                                       else None, None)
    # the values do not depend on the layout: the same seed without FSDP draws the same experts
    # (up to float32 rounding: XLA may fuse the normal's arithmetic differently per layout)
    if fsdp:
        m0 = MoE(H, I, E, K, mesh=mesh, shared_intermediate=I, rngs=nnx.Rngs(0))
        np.testing.assert_allclose(np.asarray(m.w_in[...]), np.asarray(m0.w_in[...]),
                                   rtol=1e-6, atol=1e-7)

    # the compiled init of an expert stack: its output is the device's share, and its
    # temporaries a few of one expert's matrices (drawn one at a time), never the whole stack
    E_big = 8 * e
    shape = (E_big, 64, 256)
    sharding = NamedSharding(mesh, P("ep", "data" if fsdp else None, None))
    stats = param_initializer(shape, 64, jnp.float32, sharding).lower(
        jax.random.key(0)).compile().memory_analysis()
    share = 4 * E_big * 64 * 256 // (e * split_h)
    matrix = 4 * 64 * 256
    assert stats.output_size_in_bytes == share
    assert stats.temp_size_in_bytes <= 8 * matrix, (stats.temp_size_in_bytes, matrix)
    assert stats.temp_size_in_bytes + stats.output_size_in_bytes < 4 * E_big * 64 * 256 / 2


# ---- data x expert parallel ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def dp_ep_program(mesh, cfg):
    """moe_layer over ("data", "ep"): tokens over both axes, experts over "ep" (replicated over
    "data"), the shared expert replicated; the output and the gradient of every input."""
    rows, experts = P(("data", "ep")), P("ep")

    def f(x, ids, w, w_in, w_out, s_in, s_out, cot):
        def loss(x, w, w_in, w_out, s_in, s_out):
            y = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out, shared_w_in=s_in,
                                  shared_w_out=s_out)
            return jax.lax.psum(jnp.sum(y * cot), ("data", "ep")), y
        # JAX sums the gradients of what is replicated over an axis over that axis (w_in over
        # "data", the shared expert over both): their out_specs say so
        grads, y = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
            x, w, w_in, w_out, s_in, s_out)
        return (y, *grads)

    specs = (rows, rows, rows, experts, experts, P(), P(), rows)
    out = (rows, rows, rows, experts, experts, P(), P())
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out))


@pytest.mark.multiprocess
def test_data_x_expert_parallel_layer_equals_dense_with_gradients(rng):
    mesh = data_ep_mesh()
    d, e = mesh.shape["data"], mesh.shape["ep"]
    E, N = 2 * e, d * e * T  # experts, tokens in all
    cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=e, num_experts=E, topk=K, tokens_per_rank=T)
    x = rng.standard_normal((N, H)).astype(np.float32)
    ids = np.argsort(rng.random((N, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((N, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    s_in = (rng.standard_normal((H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    s_out = (rng.standard_normal((I, H)) / np.sqrt(I)).astype(np.float32)
    cot = rng.standard_normal((N, H)).astype(np.float32)
    rows = lambda a: on(mesh, P(("data", "ep")), a)  # noqa: E731
    got = dp_ep_program(mesh, cfg)(
        rows(x), rows(ids), rows(w), on(mesh, P("ep"), w_in), on(mesh, P("ep"), w_out),
        on(mesh, P(), s_in), on(mesh, P(), s_out), rows(cot))
    got = [ep_comm.distributed.to_host(a) for a in got]
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731

        def loss(x, w, w_in, w_out, s_in, s_out):
            y = dense_swiglu_moe(x, jnp.asarray(ids), w, w_in, w_out, s_in, s_out)
            return jnp.sum(y * f64(cot)), y
        grads, y = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
            *map(f64, (x, w, w_in, w_out, s_in, s_out)))
    names = ("y", "d x", "d topk_weights", "d w_in", "d w_out", "d shared_w_in", "d shared_w_out")
    for name, g, r in zip(names, got, (y, *grads)):
        r = np.asarray(r)
        assert g.shape == r.shape, name
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)


@pytest.mark.parametrize("axis_type,fsdp", [("Explicit", True), ("Auto", False)])
def test_nnx_data_x_expert_parallel_equals_dense_with_gradients(rng, axis_type, fsdp):
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE

    if jax.process_count() > 1:
        pytest.skip("the dense reference reads every parameter on this process")
    mesh = data_ep_mesh(axis_type)
    d, e = mesh.shape["data"], mesh.shape["ep"]
    m = MoE(H, I, 2 * e, K, mesh=mesh, fsdp=fsdp, shared_intermediate=I,
            rngs=nnx.Rngs(int(rng.integers(2**31))))
    assert m.token_axes == ("data", "ep")
    x = rng.standard_normal((d * e, T // 2, H)).astype(np.float32)  # (batch, seq, hidden)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    xs = on(mesh, P(("data", "ep")), x)

    @nnx.jit
    def value_and_grads(m, x):
        return m(x), nnx.grad(lambda m: jnp.sum(m(x) * cot))(m)

    y, g = value_and_grads(m, xs)
    check_nnx_against_dense(m, x, cot, y, g, K)


def test_nnx_rejects_bad_data_axes():
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE

    mesh = data_ep_mesh()
    e = mesh.shape["ep"]
    with pytest.raises(ValueError, match=re.escape(
            "ep_comm.nnx.MoE: data_axes must be None, a name or a tuple of distinct names of mesh "
            "axes other than axis_name='ep' (the mesh has ('data', 'ep')), got ('ep',)")):
        MoE(H, I, 2 * e, K, mesh=mesh, data_axes=("ep",), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(
            "ep_comm.nnx.MoE: with fsdp=True, hidden=15 must be divisible by the 2 devices of "
            "data_axes ('data',)")):
        MoE(15, I, 2 * e, K, mesh=mesh, fsdp=True, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=re.escape("ep_comm.nnx.MoE: fsdp must be a bool, got str")):
        MoE(H, I, 2 * e, K, mesh=mesh, fsdp="yes", rngs=nnx.Rngs(0))
    m = MoE(H, I, 2 * e, K, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(
            f"ep_comm.nnx.MoE: the {2 * e + 1} tokens of x must be divisible by the {2 * e} "
            f"devices of mesh axes ('data', 'ep')")):
        m(jnp.zeros((2 * e + 1, H)))


def test_nnx_routes_its_own_top_k_ids_without_the_run_time_check():
    """The module's router picks ids with ``lax.top_k`` (never out of range), so its step holds
    no host callback (which costs a TPU call ~2 ms: docs/parallelism.md) unless the caller asks
    for the check."""
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jnp.zeros((n * T, H))
    for kw, want in (({}, "ignore"), ({"invalid_ids": "warn"}, "warn")):
        m = MoE(H, I, 2 * n, K, mesh=mesh, rngs=nnx.Rngs(0), **kw)
        assert m.ep_config(n * T).ids_check == want
        with jax.set_mesh(mesh):
            text = jax.jit(lambda x: m(x)).lower(x).as_text()
        assert ("callback" in text) == (want == "warn"), want


# ---- errors a caller can catch -----------------------------------------------------------------

def dispatch_program(sharded, cfg):
    """dispatch -> identity experts -> combine, per rank."""
    def f(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ep_comm.combine(ex, h)
    return sharded.smap(f)


def test_checked_raises_the_overflow_error_itself(sharded, n, rng):
    x, ids, w = dispatch_inputs(rng, n, "one_rank")
    args = sharded.put(x, ids, w)
    cfg = dispatch_config(n, recv_capacity=DT, overflow="raise")
    step = ep_comm.checked(dispatch_program(sharded, cfg))
    ref = Reference(ids, n, cfg.num_experts, DT, cfg.expert_rows, cfg.recv_token_rows)
    ranks = ", ".join(f"rank {r}: {v}" for r, v in enumerate(ref.dropped) if v)
    with pytest.raises(ep_comm.EPOverflowError, match=re.escape(
            f"ep_comm dispatch: dropped {ref.dropped.sum()} (token, expert) pairs ({ranks}): the "
            f"expert buffer holds recv_capacity={DT} rows per rank; the dropless worst case is "
            f"{cfg.worst_case_rows} (EPConfig(recv_capacity=None))")) as e:
        step(*args)
    assert e.value.__cause__ is None  # raised by checked, not wrapped in JAX's error
    # the next step with room for everything runs through
    ok = ep_comm.checked(dispatch_program(sharded, dispatch_config(n, overflow="raise")))
    assert ok(*args).shape == (n * DT, x.shape[1])


def bad_ids_case(rng, n):
    """Three ids out of range on n >= 2 ranks: two in rank 1's block (the first at its row 2,
    k = 1), one in the last rank's; the layer's inputs and the message they make."""
    E = 2 * n
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    ids = np.argsort(rng.random((n * T, E)), axis=1)[:, :K].astype(np.int32)
    ids[T + 2, 1], ids[T + 5, 0], ids[-1, 1] = E, 999, -5
    w = rng.random((n * T, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    per_rank = {}
    for row in (T + 2, T + 5, n * T - 1):
        per_rank[row // T] = per_rank.get(row // T, 0) + 1
    ranks = ", ".join(f"rank {r}: {c}" for r, c in sorted(per_rank.items()))
    msg = (f"ep_comm dispatch: topk_ids holds 3 expert ids outside [-1, {E}) ({ranks} of mesh "
           f"axis 'ep'), which were not routed; the first: topk_ids[2, 1] = {E} on rank 1")
    return (x, ids, w, w_in, w_out), msg


def test_out_of_range_ids_in_the_layer_warn_by_default_raise_or_stay_silent(sharded, n, rng):
    if n < 2:
        pytest.skip("needs two ranks (bad ids in rank 1's block)")
    (x, ids, w, w_in, w_out), msg = bad_ids_case(rng, n)
    args = sharded.put(x, ids, w, w_in, w_out)
    cfg = lambda **kw: ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=2 * n,  # noqa
                                        topk=K, tokens_per_rank=T, **kw)
    smap = lambda c: sharded.smap(lambda x, i, w, a, b: ep_comm.moe_layer(  # noqa: E731
        x, i, w, c, w_in=a, w_out=b))
    with pytest.warns(ep_comm.EPInvalidIdsWarning, match=re.escape(msg)):
        y = sharded.get(smap(cfg())(*args))
    assert np.isfinite(y).all()  # (the bad slots are not routed: the layer still runs)
    with pytest.raises(ep_comm.EPOverflowError, match=re.escape(msg)):
        ep_comm.checked(smap(cfg(invalid_ids="raise")))(*args)
    with pytest.raises(ep_comm.EPOverflowError, match=re.escape(msg)):  # overflow="raise" too
        ep_comm.checked(smap(cfg(overflow="raise")))(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(sharded.get(smap(cfg(invalid_ids="ignore"))(*args)), y)


def test_error_arguments_are_checked():
    with pytest.raises(ValueError, match=re.escape(
            "EPConfig: invalid_ids must be None or one of ('warn', 'raise', 'ignore'), "
            "got 'loud'")):
        ep_comm.EPConfig(axis_name="ep", num_ranks=1, num_experts=2, topk=1, tokens_per_rank=1,
                         invalid_ids="loud")
    with pytest.raises(TypeError, match=re.escape("checked: fn must be a function, got int")):
        ep_comm.checked(3)
    cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=1, num_experts=2, topk=1, tokens_per_rank=1)
    assert cfg.ids_check == "warn"
    assert ep_comm.EPConfig(axis_name="ep", num_ranks=1, num_experts=2, topk=1,
                            tokens_per_rank=1, overflow="raise").ids_check == "raise"
