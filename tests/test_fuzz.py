"""Fuzzing the public API (hypothesis): random shapes, dtypes, out-of-range and negative ids and
sizes, NaN/Inf, T = 1, H = 1, topk = num_experts. Every case either matches the reference or raises
a ``ValueError``/``TypeError`` that names the function; never another exception, a hang or a
silently wrong result. Cases per run: ``EXAMPLES`` (the search starts from ``EP_COMM_TEST_SEED``;
the fast command runs fewer of the cases that compile a program each, test-full all)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, seed, settings, strategies as st

import ep_comm
from ep_comm import topology
from conftest import BASE_SEED, FULL
from moe_reference import Reference

EXAMPLES = {"EPConfig": 300, "dispatch_layout": 100, "dispatch/combine": 10,
            "ragged_all_to_all": 12, "ragged_all_to_all errors": 60, "topology": 300, "moe_layer": 8}
if not FULL:  # the fast command: fewer of the cases that each compile a program (new shapes)
    EXAMPLES.update({"dispatch/combine": 4 if jax.process_count() == 1 else 2,
                     "ragged_all_to_all": 6, "moe_layer": 3})


def _settings(n):
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


ints = st.one_of(st.integers(-3, 20), st.sampled_from([0, 1, 2 ** 24 + 1, 10 ** 9]),
                 st.just(2.5), st.just("4"), st.none())


@seed(BASE_SEED)
@_settings(EXAMPLES["EPConfig"])
@given(num_ranks=ints, num_experts=ints, topk=ints, tokens=ints,
       capacity=st.one_of(st.none(), st.integers(-2, 50)),
       backend=st.sampled_from(["auto", "portable", "nccl", "gpu", "", None]),
       plan=st.sampled_from(["auto", "flat", "hierarchical", "ring", None]),
       wire=st.sampled_from([None, "e4m3", "mxfp8", "fp4", 3]),
       combine=st.sampled_from([None, "float32", "bfloat16", "int8", "nonsense"]),
       zero_fill=st.sampled_from([False, True, 0, "yes"]))
def test_epconfig_validates_or_builds(num_ranks, num_experts, topk, tokens, capacity, backend,
                                      plan, wire, combine, zero_fill):
    try:
        cfg = ep_comm.EPConfig("ep", num_ranks=num_ranks, num_experts=num_experts, topk=topk,
                               tokens_per_rank=tokens, recv_capacity=capacity, backend=backend,
                               plan=plan, wire_format=wire, combine_dtype=combine,
                               zero_fill=zero_fill)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("EPConfig: "), e
        return
    # built: everything the constructor promises holds
    for v in (num_ranks, num_experts, topk, tokens):
        assert isinstance(v, int) and v >= 1
    assert num_experts % num_ranks == 0 and topk <= num_experts <= 2 ** 24
    assert capacity is None or capacity >= 1
    assert isinstance(zero_fill, bool) and wire in topology.WIRE_FORMATS
    assert cfg.expert_rows >= 1 and cfg.recv_token_rows >= 1


@seed(BASE_SEED)
@_settings(EXAMPLES["dispatch_layout"])
@given(shape=st.sampled_from([(1, 1), (5, 3), (4,), (2, 2, 2), (0, 2), (3, 8)]),
       dtype=st.sampled_from([np.int32, np.int64, np.int8, np.float32, np.bool_]),
       lo=st.integers(-5, 0), hi=st.integers(1, 20), n=st.sampled_from([1, 2, 4]),
       data=st.data())
def test_dispatch_layout_counts_or_raises(shape, dtype, lo, hi, n, data):
    E = 2 * n
    ids = np.asarray(data.draw(st.lists(st.integers(lo, hi), min_size=int(np.prod(shape)),
                                        max_size=int(np.prod(shape)))), np.int64)
    ids = ids.reshape(shape).astype(dtype)
    try:
        lay = ep_comm.dispatch_layout(ids, num_experts=E, num_ranks=n)
    except ValueError as e:
        assert str(e).startswith("dispatch_layout: topk_ids must be an integer array"), e
        assert not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 2
        return
    assert np.issubdtype(ids.dtype, np.integer) and ids.ndim == 2
    v = ids.astype(np.int64)
    valid = (v >= 0) & (v < E)
    L = E // n
    in_rank = np.array([[np.any(valid[t] & (v[t] // L == r)) for r in range(n)]
                        for t in range(v.shape[0])]).reshape(v.shape[0], n)
    np.testing.assert_array_equal(lay.num_tokens_per_rank, in_rank.sum(0))
    np.testing.assert_array_equal(lay.is_token_in_rank, in_rank)
    assert int(lay.num_invalid) == int(np.sum((v != -1) & ~valid))
    per_expert = [sum(e in set(v[t][valid[t]]) for t in range(v.shape[0])) for e in range(E)]
    np.testing.assert_array_equal(lay.num_tokens_per_expert, per_expert)


@functools.lru_cache(maxsize=None)
def _program(sharded, n, T, H, K):
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=2 * n, topk=K, tokens_per_rank=T,
                           backend="portable", zero_fill=True)

    def f(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ex, ep_comm.combine(ex, h), h

    return cfg, sharded.smap(f)


@pytest.mark.multiprocess
@seed(BASE_SEED)
@_settings(EXAMPLES["dispatch/combine"])
@given(T=st.sampled_from([1, 3]), H=st.sampled_from([1, 2]), full_topk=st.booleans(),
       data=st.data())
def test_dispatch_combine_match_the_reference(sharded, n, T, H, full_topk, data):
    """Out-of-range and negative ids (not routed, counted), NaN/Inf activations (they travel as
    they are), T = 1, H = 1 and topk = num_experts."""
    E = 2 * n
    K = E if full_topk else 1
    cfg, run = _program(sharded, n, T, H, K)
    ids = np.array(data.draw(st.lists(st.integers(-3, E + 2), min_size=n * T * K,
                                      max_size=n * T * K)), np.int32).reshape(n * T, K)
    x = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.5, -2.0, np.nan, np.inf, -np.inf,
                                                     3.25]), min_size=n * T * H,
                                    max_size=n * T * H)), np.float32).reshape(n * T, H)
    # no subnormal weights: XLA flushes them to zero (then 0 * inf = NaN where float64 says inf)
    w = np.array(data.draw(st.lists(st.floats(0, 1, width=32, allow_subnormal=False),
                                    min_size=n * T * K, max_size=n * T * K)),
                 np.float32).reshape(n * T, K)
    ex, y, h = sharded.get(run(*sharded.put(x, ids, w)))
    ref = Reference(ids, n, E, T, cfg.expert_rows, cfg.recv_token_rows)
    np.testing.assert_array_equal(ex.reshape(n, cfg.expert_rows, H),
                                  ref.expert_x(x.astype(np.float64), zero_fill=True))
    with np.errstate(invalid="ignore"):
        want = ref.combine(x, ids, w)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)  # NaN where the reference has NaN
    bad = (ids != -1) & ((ids < 0) | (ids >= E))
    assert int(np.sum(h.num_invalid)) == int(bad.sum())
    assert int(np.sum(h.num_dropped)) == 0


@pytest.mark.multiprocess
@seed(BASE_SEED)
@_settings(EXAMPLES["ragged_all_to_all"])
@given(m=st.integers(1, 3), dtype=st.sampled_from(["float32", "bfloat16", "float16", "int32"]),
       grouped=st.booleans(), skew=st.booleans(), data=st.data())
def test_ragged_all_to_all_matches_the_reference(sharded, n, m, dtype, grouped, skew, data):
    """Well-formed calls (random segment counts, sizes, gaps and order, groups, skew, empty
    segments, NaN and Inf rows) equal the numpy model of jax.lax.ragged_all_to_all bit for bit;
    rows nobody writes keep the output's values."""
    import test_ragged_all_to_all as r2a

    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    groups = [[i, i + 1] for i in range(0, n, 2)] if grouped and n % 2 == 0 else None
    sizes, io, oo, rs, groups, m = r2a.make_case(rng, n, groups, m, skew)
    operand, output = r2a.data(rng, n, dtype)
    if np.dtype(operand.dtype).kind == "f":
        operand[:, 0, 0], operand[:, 1, 1] = np.nan, -np.inf
    got = r2a.run(sharded, n, operand, output, io, sizes, oo, rs,
                  groups if grouped and n % 2 == 0 else None)
    want = r2a.reference(operand, output, io, sizes, oo, rs, groups, m)
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


_DEFECTS = ("dtype", "trailing shape", "no row axis", "float index", "2-D index", "index length",
            "segments not a multiple of the group", "groups", "backend")


@seed(BASE_SEED)
@_settings(EXAMPLES["ragged_all_to_all errors"])
@given(defects=st.sets(st.sampled_from(_DEFECTS), max_size=2), grouped=st.booleans(),
       m=st.integers(1, 2), rows=st.sampled_from([0, 5]))
def test_ragged_all_to_all_rejects_malformed_calls(sharded, n, defects, grouped, m, rows):
    """A call with any of ``_DEFECTS`` raises a ValueError or TypeError naming
    ragged_all_to_all when the program is traced; a call with none traces."""
    from jax.sharding import PartitionSpec as P

    K = n * m
    idx = [np.zeros((K,), np.int32) for _ in range(4)]
    if "float index" in defects:
        idx[1] = idx[1].astype(np.float32)
    if "2-D index" in defects:
        idx[2] = idx[2].reshape(1, K)
    if "index length" in defects:
        idx[3] = np.zeros((K + 1,), np.int32)
    if "segments not a multiple of the group" in defects:
        idx = [np.zeros((K + 1,), np.int32) for _ in range(4)] if n > 1 else idx
    operand = jax.ShapeDtypeStruct((6, 3), np.float32)
    output = jax.ShapeDtypeStruct(
        (rows,) if "no row axis" in defects else (rows, 4 if "trailing shape" in defects else 3),
        np.float16 if "dtype" in defects else np.float32)
    if "no row axis" in defects:
        output = jax.ShapeDtypeStruct((), np.float32)
    groups = ([[0, 0]] if "groups" in defects
              else [[i, i + 1] for i in range(0, n, 2)] if grouped and n % 2 == 0 else None)
    backend = "nonsense" if "backend" in defects else "portable"

    def f(a, b):
        return ep_comm.ragged_all_to_all(a, b, *idx, axis_name="ep", axis_index_groups=groups,
                                         backend=backend)

    prog = jax.jit(jax.shard_map(f, mesh=sharded.mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))
    if n == 1:  # a group of one takes any number of segments
        defects = defects - {"segments not a multiple of the group"}
    try:
        prog.trace(operand, output)
    except (ValueError, TypeError) as e:
        assert "ragged_all_to_all" in str(e), e
        assert defects, e
        return
    assert not defects, f"{sorted(defects)} traced without an error"


@seed(BASE_SEED)
@_settings(EXAMPLES["topology"])
@given(case=st.integers(0, 2 ** 32 - 1))
def test_topology_counts_or_raises(case):
    """``simulated``, ``token_bytes``, ``row_bytes`` and ``count_traffic`` on random arguments,
    each bad one time in twelve (non-positive or non-int sizes, unknown dtypes, formats and
    plans): each call raises a ValueError/TypeError naming itself, or counts what a numpy
    reference counts (dispatch rows per rank: a token once per rank holding one of its valid
    experts)."""
    from ep_comm import topology
    rng = np.random.default_rng(case)

    def pick(good, bad):  # a bad value one time in twelve
        values = bad if rng.random() < 1 / 12 else good
        return values[rng.integers(len(values))]

    nodes, gpus = pick([1, 2, 3], [0, -1, 2.0]), pick([1, 2, 4], [0, "2"])
    hidden = pick([1, 7, 128, 300], [0, -4, 2.5, None, "8"])
    dtype = pick(["bfloat16", "float32", "int8"], ["nonsense", None])
    combine = pick([None, "float32"], ["nonsense", 3])
    wire = pick([None, "e4m3", "mxfp8"], ["fp4", 1])
    plan = pick(["flat", "hierarchical"], ["ring", None])
    topk = pick([1, 2, 3], [0, -1])
    capacity = pick([None, None, 1, 5], [0, -1, 1.5])
    try:
        topo = topology.simulated(nodes, gpus)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("simulated: "), e
        return
    is_count = lambda v: type(v) is int and v >= 1  # noqa: E731
    row_ok = is_count(hidden) and dtype in ("bfloat16", "float32", "int8") and wire in (
        None, "e4m3", "mxfp8")
    both_ok = row_ok and is_count(topk) and combine in (None, "float32")
    for fn, args, ok in ((topology.token_bytes, (hidden, dtype, wire), row_ok),
                         (topology.row_bytes, (hidden, dtype, topk, combine, wire), both_ok)):
        try:
            got = fn(*args)
        except (ValueError, TypeError) as e:
            assert str(e).startswith(f"{fn.__name__}: ") and not ok, e
        else:
            assert ok and np.all(np.asarray(got) >= 1), (fn.__name__, args, got)
    n = topo.num_ranks
    experts = pick([n, 2 * n, 4 * n], [0, n + 1 if n > 1 else -1, 2.0 * n])
    traffic_ok = (both_ok and plan in ("flat", "hierarchical") and is_count(experts)
                  and experts % n == 0 and (capacity is None or is_count(capacity)))
    ids = rng.integers(-3, 4 * n + 3, (n, int(rng.integers(0, 4)), max(topk, 0)))
    try:
        traffic = topology.count_traffic(ids, num_experts=experts, topology=topo, hidden=hidden,
                                         dtype=dtype, plan=plan, combine_dtype=combine,
                                         recv_token_rows=capacity, wire_format=wire)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("count_traffic: ") and not traffic_ok, e
        event("count_traffic raised")
        return
    assert traffic_ok, (experts, capacity, plan)
    event("count_traffic counted")
    L, T = experts // n, ids.shape[1]
    if plan == "flat" and capacity is None:
        valid = (ids >= 0) & (ids < experts)
        want = [sum(len({int(i) // L for i in ids[s, t][valid[s, t]]}) for t in range(T))
                for s in range(n)]
        np.testing.assert_array_equal(traffic.rows_by_link("dispatch").sum(axis=1), want)
    assert traffic.bytes_by_link().min() >= 0


@seed(BASE_SEED)
@_settings(EXAMPLES["moe_layer"])
@given(kind=st.sampled_from(["random", "skewed", "masked", "one_expert"]), shared=st.booleans(),
       capacity=st.sampled_from([None, 2, 4]), case=st.integers(0, 2 ** 32 - 1))
def test_moe_layer_matches_the_dense_model(sharded, n, kind, shared, capacity, case):
    """``moe_layer`` (output and every gradient) on random routings, with and without a shared
    expert, dropless in one round or in rounds of a half or a quarter of a balanced step's pairs,
    against the dense float64 model."""
    import test_layer as tl

    rng = np.random.default_rng(case)
    x, ids, w, w_in, w_out, s_in, s_out, cot = tl.layer_inputs(rng, n, kind)
    cfg = tl.layer_config(n, recv_capacity=None if capacity is None
                          else tl.T * tl.K // capacity)
    got = sharded.get(tl.layer_program(sharded, cfg, shared)(
        *sharded.put(x, ids, w, w_in, w_out), sharded.put_replicated(s_in),
        sharded.put_replicated(s_out), sharded.put(cot)))
    want = tl.dense_reference(x, ids, w, w_in, w_out, s_in, s_out, cot, shared)
    for name, g, r in zip(("y", "d x", "d topk_weights", "d w_in", "d w_out", "d shared_w_in",
                           "d shared_w_out"), got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * (1 + np.abs(r).max()),
                                   err_msg=f"{name} ({kind}, capacity 1/{capacity})")
