"""dispatch / combine against the float64 numpy model and the dense MoE."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ep_comm
from ep_comm.collectives import row_kernels
from conftest import BACKENDS
from moe_reference import Reference, dense_moe, routing

T, K, H, F = 16, 4, 8, 6
ROUTINGS = ["random", "masked", "one_expert", "one_rank", "empty_ranks"]


def config(n, backend="portable", **kw):
    return ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=4 * n, topk=K,
                            tokens_per_rank=T, backend=backend, **kw)


BACKEND = pytest.mark.parametrize("backend", BACKENDS)


def inputs(rng, n, kind, dtype=np.float32):
    x = rng.standard_normal((n * T, H)).astype(dtype)
    ids = routing(rng, kind, n, T, K, 4 * n)
    w = rng.random((n * T, K)).astype(np.float32)
    return x, ids, w


@functools.lru_cache(maxsize=None)
def identity_program(sharded, cfg):
    """dispatch, then combine of the expert rows as they are; compiled once per config (tests that
    differ only in their data share it)."""
    def f(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ex, ep_comm.combine(ex, h), h

    return sharded.smap(f)


def run_identity(sharded, cfg, x, ids, w):
    return sharded.get(identity_program(sharded, cfg)(*sharded.put(x, ids, w)))


@pytest.mark.multiprocess
@BACKEND
@pytest.mark.parametrize("kind", ROUTINGS)
def test_dispatch_layout_and_identity_combine(sharded, n, rng, kind, backend):
    cfg = config(n, backend)
    x, ids, w = inputs(rng, n, kind)
    ex, y, h = run_identity(sharded, cfg, x, ids, w)
    ref = Reference(ids, n, cfg.num_experts, T, cfg.expert_rows, cfg.recv_token_rows)
    # expert_x: grouped per local expert, in (source rank, token, k) order, then the zero tail
    # and the unspecified rows (NaN on this path).
    np.testing.assert_array_equal(ex.reshape(n, cfg.expert_rows, H), ref.expert_x(x))
    np.testing.assert_array_equal(h.group_sizes.reshape(n, -1), ref.group_sizes)
    np.testing.assert_array_equal(h.num_dropped, 0)
    np.testing.assert_array_equal(h.num_invalid, 0)
    assert ref.kept[ids >= 0].all()
    np.testing.assert_allclose(y, ref.combine(x, ids, w), rtol=1e-6, atol=1e-6)
    ep_comm.check(h)


def test_dispatch_layout_function(rng, n):
    E = 4 * n
    ids = routing(rng, "masked", 1, T, K, E)
    ids[0, 0] = E + 3  # out of range: counted, not routed
    lay = ep_comm.dispatch_layout(ids, num_experts=E, num_ranks=n)
    valid = (ids >= 0) & (ids < E)
    rank = np.where(valid, ids // (E // n), n)
    in_rank = np.stack([(rank == r).any(1) for r in range(n)], 1)
    np.testing.assert_array_equal(lay.is_token_in_rank, in_rank)
    np.testing.assert_array_equal(lay.num_tokens_per_rank, in_rank.sum(0))
    np.testing.assert_array_equal(lay.num_tokens_per_expert,
                                  np.bincount(ids[valid], minlength=E))
    np.testing.assert_array_equal(lay.num_pairs_per_rank,
                                  [np.sum(rank == r) for r in range(n)])
    assert int(lay.num_invalid) == 1


@pytest.mark.multiprocess
def test_each_token_sent_once_per_rank(sharded, n, rng):
    cfg = config(n)
    x, ids, w = inputs(rng, n, "random")
    _, _, h = run_identity(sharded, cfg, x, ids, w)
    L = cfg.experts_per_rank
    sent = h.traffic.reshape(n, 2, n)[:, 0, :]  # tokens s -> d
    want = np.array([[np.sum((ids[s * T:(s + 1) * T] // L == d).any(1)) for d in range(n)]
                     for s in range(n)])
    np.testing.assert_array_equal(sent, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,backend", [("random", "portable"), ("masked", "portable")]
                         + [("random", b) for b in BACKENDS if b != "portable"])
def test_linear_experts_equal_dense_model_with_gradients(sharded, n, rng, kind, backend):
    cfg = config(n, backend)
    E = cfg.num_experts
    x, ids, w = inputs(rng, n, kind)
    W = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    cot = rng.standard_normal((n * T, F)).astype(np.float32)

    def moe(x, ids, w, W_local):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        ey = jax.lax.ragged_dot(ex, W_local, h.group_sizes)
        return ep_comm.combine(ey, h)

    def f(x, ids, w, W_local, cot):
        loss = lambda x, w, W_: jax.lax.psum(jnp.sum(moe(x, ids, w, W_) * cot), "ep")
        return (moe(x, ids, w, W_local),) + jax.grad(loss, argnums=(0, 1, 2))(x, w, W_local)

    y, gx, gw, gW = sharded.get(sharded.smap(f)(*sharded.put(x, ids, w, W, cot)))

    ref = Reference(ids, n, E, T, cfg.expert_rows, cfg.recv_token_rows)
    np.testing.assert_allclose(y, ref.combine(x, ids, w, W), rtol=1e-5, atol=1e-5)
    dense_loss = lambda x, w, W: jnp.sum(dense_moe(x, ids, w, W) * cot)
    rx, rw, rW = jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, W)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gW, rW, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["random", "masked", "one_expert"])
@pytest.mark.parametrize("capacity", [None, T - 3])
def test_one_rank_skips_the_exchange(rng, kind, capacity):
    """At one rank with room for every token, dispatch neither packs nor exchanges: one scatter of
    x into expert_x (and combine one weighted gather); the results, gradients included, equal the
    numpy model and the dense MoE as on any mesh. A capacity below the tokens takes the general
    path (pack, self-exchange) and drops what does not fit, counted."""
    from conftest import Sharded

    one = Sharded(jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,),
                                devices=jax.devices()[:1]))
    cfg = config(1, recv_capacity=capacity)
    from ep_comm.routes import is_local
    assert is_local(cfg, "flat") == (capacity is None)
    E = cfg.num_experts
    x, ids, w = inputs(rng, 1, kind)
    W = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    cot = rng.standard_normal((T, F)).astype(np.float32)

    def moe(x, ids, w, W_):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ex, h, ep_comm.combine(jax.lax.ragged_dot(ex, W_, h.group_sizes), h)

    def f(x, ids, w, W_, cot):
        loss = lambda x, w, W_: jnp.sum(moe(x, ids, w, W_)[2] * cot)
        return moe(x, ids, w, W_) + jax.grad(loss, argnums=(0, 1, 2))(x, w, W_)

    program = one.smap(f)
    text = str(jax.make_jaxpr(program)(*one.put(x, ids, w, W, cot)))
    # an exchange receives into a fresh row_kernels.empty buffer
    assert ("ep_comm_rows_empty" in text) == (capacity is not None), "exchange present or not"
    # (decode sizes: the token routes and the expert layout in one op)
    one_op = capacity is None and row_kernels.local_layout_fits(T, cfg.topk, E)
    assert ("ep_comm_rows_local_layout" in text) == one_op, "one-op layout or not"
    ex, h, y, gx, gw, gW = one.get(program(*one.put(x, ids, w, W, cot)))
    ref = Reference(ids, 1, E, T, cfg.expert_rows, cfg.recv_token_rows)
    np.testing.assert_array_equal(ex.reshape(1, cfg.expert_rows, H), ref.expert_x(x))
    np.testing.assert_array_equal(h.group_sizes.reshape(1, -1), ref.group_sizes)
    np.testing.assert_array_equal(h.num_dropped, int((~ref.kept & (ids >= 0)).sum()))
    assert int(h.num_recv_tokens[0]) == min(int((ids >= 0).any(1).sum()), cfg.recv_token_rows)
    np.testing.assert_allclose(y, ref.combine(x, ids, w, W), rtol=1e-5, atol=1e-5)
    if capacity is None:
        dense_loss = lambda x, w, W: jnp.sum(dense_moe(x, ids, w, W) * cot)
        for got, want in zip((gx, gw, gW), jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, W)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combine_dtype", [None, "float32"])
def test_bfloat16_tokens(sharded, n, rng, combine_dtype):
    cfg = config(n, combine_dtype=combine_dtype)
    x, ids, w = inputs(rng, n, "random", dtype=jnp.bfloat16)
    ex, y, h = run_identity(sharded, cfg, x, ids, w)
    ref = Reference(ids, n, cfg.num_experts, T, cfg.expert_rows, cfg.recv_token_rows)
    assert ex.dtype == jnp.bfloat16 and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(ex.reshape(n, cfg.expert_rows, H).astype(np.float64),
                                  ref.expert_x(x.astype(np.float64)))
    want = ref.combine(x.astype(np.float64), ids, w)
    # bf16 has 8 significant bits: one rounding of the result (float32 wire), or of each of the at
    # most min(K, n) partial sums plus the result (bf16 wire).
    tol = 2 ** -8 * (1 if combine_dtype else 1 + min(K, n))
    err = np.abs(y.astype(np.float64) - want)
    assert np.all(err <= tol * (np.abs(want) + np.abs(x.astype(np.float64)).max(1, keepdims=True)
                                * w.sum(1, keepdims=True)))


@pytest.mark.multiprocess
def test_backends_agree_bit_for_bit(sharded, n, rng):
    backends = BACKENDS
    if len(backends) < 2:
        pytest.skip(f"only {backends} available here")
    x, ids, w = inputs(rng, n, "masked")
    outs = [run_identity(sharded, config(n, b), x, ids, w) for b in backends]
    for other in outs[1:]:
        for u, v in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(u, v)


def test_deterministic(sharded, n, rng):
    cfg = config(n)
    x, ids, w = inputs(rng, n, "random")
    a = run_identity(sharded, cfg, x, ids, w)
    b = run_identity(sharded, cfg, x, ids, w)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


# ---- capacity overflow: counted and reported, never silent -----------------------------------------

@pytest.mark.multiprocess
@BACKEND
def test_small_capacity_overflow_is_counted_and_reported(sharded, n, rng, backend):
    cfg = config(n, backend, recv_capacity=T)  # far below the worst case
    assert not cfg.is_dropless
    x, ids, w = inputs(rng, n, "one_rank")
    ex, y, h = run_identity(sharded, cfg, x, ids, w)
    ref = Reference(ids, n, cfg.num_experts, T, cfg.expert_rows, cfg.recv_token_rows)
    assert ref.dropped.sum() > 0
    np.testing.assert_array_equal(h.num_dropped, ref.dropped)
    np.testing.assert_array_equal(h.group_sizes.reshape(n, -1), ref.group_sizes)
    np.testing.assert_array_equal(ex.reshape(n, cfg.expert_rows, H), ref.expert_x(x))
    np.testing.assert_allclose(y, ref.combine(x, ids, w), rtol=1e-6, atol=1e-6)
    ranks = ", ".join(f"rank {r}: {v}" for r, v in enumerate(ref.dropped) if v)
    msg = (f"ep_comm dispatch: dropped {ref.dropped.sum()} (token, expert) pairs ({ranks}): the "
           f"expert buffer holds recv_capacity={T} rows per rank; the dropless worst case is "
           f"{cfg.worst_case_rows} (EPConfig(recv_capacity=None))")
    with pytest.raises(ep_comm.EPOverflowError, match=re.escape(msg)):
        ep_comm.check(h)


@pytest.mark.multiprocess
def test_overflow_raise_mode_raises_at_run_time(sharded, n, rng):
    cfg = config(n, recv_capacity=T, overflow="raise")
    x, ids, w = inputs(rng, n, "one_rank")
    with pytest.raises(Exception, match=re.escape("ep_comm dispatch: dropped")):
        run_identity(sharded, cfg, x, ids, w)
    cfg_ok = config(n, overflow="raise")
    run_identity(sharded, cfg_ok, x, ids, w)  # dropless: nothing to raise


@pytest.mark.multiprocess
def test_check_inside_shard_map(sharded, n, rng):
    cfg = config(n, recv_capacity=T)
    x, ids, w = inputs(rng, n, "one_rank")

    def f(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        h = ep_comm.check(h)
        return ep_comm.combine(ex, h)

    with pytest.raises(Exception, match=re.escape("ep_comm dispatch: dropped")):
        sharded.get(sharded.smap(f)(*sharded.put(x, ids, w)))
    # The same program with a dropless config runs through (and leaves no failed effect behind).
    cfg = config(n)
    sharded.get(sharded.smap(f)(*sharded.put(x, ids, w)))


def test_out_of_range_ids_are_counted_and_reported(sharded, n, rng):
    cfg = config(n)
    x, ids, w = inputs(rng, n, "random")
    ids[3, 1] = cfg.num_experts
    ids[5, 0] = -7
    E = cfg.num_experts
    # both in rank 0's block (T = 16 rows); the first (row-major): row 3, k = 1
    msg = (f"ep_comm dispatch: topk_ids holds 2 expert ids outside [-1, {E}) (rank 0: 2 of mesh "
           f"axis 'ep'), which were not routed; the first: topk_ids[3, 1] = {E} on rank 0")
    # by default the run says so (once per program), and still runs
    with pytest.warns(ep_comm.EPInvalidIdsWarning, match=re.escape(msg)):
        ex, y, h = run_identity(sharded, cfg, x, ids, w)
    assert h.num_invalid.sum() == 2
    ref = Reference(ids, n, cfg.num_experts, T, cfg.expert_rows, cfg.recv_token_rows)
    np.testing.assert_allclose(y, ref.combine(x, ids, w), rtol=1e-6, atol=1e-6)
    with pytest.raises(ep_comm.EPOverflowError, match=re.escape(msg)):
        ep_comm.check(h)


# ---- configuration and argument errors --------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    (dict(num_ranks=0), "EPConfig: num_ranks must be a positive int, got 0"),
    (dict(num_experts=7), "EPConfig: num_experts=7 must be divisible by num_ranks=2"),
    (dict(topk=9), "EPConfig: topk=9 must be at most num_experts=8"),
    (dict(tokens_per_rank=2.5), "EPConfig: tokens_per_rank must be a positive int, got 2.5"),
    (dict(recv_capacity=0), "EPConfig: recv_capacity must be a positive int, got 0"),
    (dict(backend="nccl2"), "EPConfig: backend must be one of ('auto', 'portable', 'xla', 'mpi', 'nccl'), "
                            "got 'nccl2'"),
    (dict(overflow="drop"), "EPConfig: overflow must be one of ('count', 'raise'), got 'drop'"),
    (dict(combine_dtype="int8"), "EPConfig: combine_dtype must be None or a floating dtype name, "
                                 "got 'int8'"),
    (dict(axis_name=None), "EPConfig: axis_name must name a mesh axis, got None"),
])
def test_config_errors(kw, msg):
    args = dict(axis_name="ep", num_ranks=2, num_experts=8, topk=2, tokens_per_rank=4)
    args.update(kw)
    with pytest.raises(ValueError, match=re.escape(msg)):
        ep_comm.EPConfig(**args)


def test_config_is_frozen_and_sizes():
    cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=8, num_experts=256, topk=8,
                           tokens_per_rank=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.topk = 2
    assert cfg.worst_case_rows == 8 * 4096 * 8 and cfg.is_dropless
    assert cfg.send_rows == 4096 * 8 and cfg.recv_token_rows == 8 * 4096
    b = cfg.buffer_bytes(7168, "bfloat16")
    assert b["expert_x"] == 8 * 4096 * 8 * 7168 * 2
    row = 7168 * 2 + 8 * 8  # token + routing (weights and ids, float32)
    assert b["send"] == 4096 * 8 * row and b["recv_tokens"] == 8 * 4096 * row
    assert b["total"] == b["send"] + b["recv_tokens"] + b["expert_x"]
    h = cfg.buffer_bytes(7168, "bfloat16", plan="hierarchical", num_nodes=2)
    assert h["send"] == 4096 * 2 * row and h["forward"] == 2 * 4096 * row
    assert h["forward_send"] == 2 * 4096 * 4 * row
    assert h["total"] == b["recv_tokens"] + b["expert_x"] + h["send"] + h["forward"] + \
        h["forward_send"]


def _dispatch_args(rng, n):
    x, ids, w = inputs(rng, n, "random")
    return dict(x=x, ids=ids, w=w)


@pytest.mark.parametrize("which,bad,msg", [
    ("x", lambda a: a[:, :, None], "dispatch: x must be a floating array of shape "
                                  "(tokens_per_rank, hidden) = (16, hidden), got float32 (16, 8, 1)"),
    ("x", lambda a: a.astype(np.int32), "dispatch: x must be a floating array of shape "
                                        "(tokens_per_rank, hidden) = (16, hidden), got int32 (16, 8)"),
    ("ids", lambda a: a.astype(np.float32), "dispatch: topk_ids must be an integer array of shape "
                                            "(tokens, topk), got float32 (16, 4)"),
    ("ids", lambda a: a[:, :2], "dispatch: topk_ids must have shape (tokens, topk) = (16, 4), "
                                "got (16, 2)"),
    ("w", lambda a: a[:, :3], "dispatch: topk_weights must be a floating array of shape (16, 4), "
                              "got float32 (16, 3)"),
])
def test_dispatch_argument_errors(sharded, n, rng, which, bad, msg):
    cfg = config(n)
    a = _dispatch_args(rng, n)
    a[which] = bad(a[which])
    with pytest.raises(ValueError, match=re.escape(msg)):
        sharded.smap(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg)[0])(
            *sharded.put(a["x"], a["ids"], a["w"]))


def test_dispatch_rank_count_mismatch(sharded, n, rng):
    cfg = ep_comm.EPConfig("ep", num_ranks=n + 1, num_experts=4 * (n + 1), topk=K,
                           tokens_per_rank=T)
    a = _dispatch_args(rng, n)
    with pytest.raises(ValueError, match=re.escape(
            f"dispatch: config.num_ranks={n + 1} but mesh axis 'ep' has size {n}")):
        sharded.smap(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg)[0])(
            *sharded.put(a["x"], a["ids"], a["w"]))


def test_dispatch_outside_shard_map(n):
    cfg = config(n)
    with pytest.raises(NameError, match=re.escape(
            "dispatch: axis_name 'ep' is not bound here (unbound axis name: ep). Call dispatch "
            "inside jax.shard_map(..., mesh=mesh) over a mesh that has this axis.")):
        ep_comm.dispatch(jnp.zeros((T, H)), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K)), cfg)


def test_dispatch_config_type_error(n):
    with pytest.raises(TypeError, match=re.escape(
            "dispatch: config must be an ep_comm.EPConfig, got dict")):
        ep_comm.dispatch(jnp.zeros((T, H)), jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K)), {})


def test_combine_argument_errors(sharded, n, rng):
    cfg = config(n)
    a = _dispatch_args(rng, n)

    def f(x, i, w):
        ex, h = ep_comm.dispatch(x, i, w, cfg)
        return ep_comm.combine(ex[:-1], h)

    with pytest.raises(ValueError, match=re.escape(
            f"combine: expert_y must be a floating array of shape (expert_rows, hidden) = "
            f"({cfg.expert_rows}, hidden), got float32 ({cfg.expert_rows - 1}, {H})")):
        sharded.smap(f)(*sharded.put(a["x"], a["ids"], a["w"]))
    with pytest.raises(TypeError, match=re.escape(
            "combine: handle must be the EPHandle returned by dispatch, got tuple")):
        ep_comm.combine(jnp.zeros((4, 4)), ())
    with pytest.raises(TypeError, match=re.escape("check: expected an ep_comm.EPHandle, got int")):
        ep_comm.check(3)


def test_placement_and_buffer_errors():
    from ep_comm.placement import ExpertPlacement

    with pytest.raises(ValueError, match=re.escape(
            "ExpertPlacement: num_experts=10 must be divisible by the number of expert-parallel "
            "ranks 4")):
        ExpertPlacement(10, 4)
    with pytest.raises(ValueError, match=re.escape(
            "ExpertPlacement: num_ranks must be a positive int, got 0")):
        ExpertPlacement(8, 0)
    p = ExpertPlacement(8, 4)
    assert list(p.rank_of(jnp.arange(8))) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(p.local_index(jnp.arange(8))) == [0, 1] * 4
    cfg = ep_comm.EPConfig("ep", num_ranks=2, num_experts=8, topk=2, tokens_per_rank=4)
    with pytest.raises(ValueError, match=re.escape(
            "EPConfig.buffer_bytes: hidden must be a positive int, got -1")):
        cfg.buffer_bytes(-1, "float32")
