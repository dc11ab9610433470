"""Fuzzing the public API (hypothesis): random shapes, dtypes, out-of-range and negative ids and
sizes, NaN/Inf, T = 1, H = 1, topk = num_experts. Every case either matches the reference or raises
a ``ValueError``/``TypeError`` that names the function; never another exception, a hang or a
silently wrong result. Cases per run: ``EXAMPLES`` (the search starts from ``EP_COMM_TEST_SEED``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

import ep_comm
import topology
from conftest import BASE_SEED
from moe_reference import Reference

EXAMPLES = {"EPConfig": 300, "dispatch_layout": 100, "dispatch/combine": 10}


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
