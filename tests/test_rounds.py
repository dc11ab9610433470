"""moe_layer in dropless rounds (recv_capacity below the worst case): every pair served exactly
once, the same results and gradients as the single worst-case round, rounds = ceil(max load / C)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

import ep_comm
from ep_comm import pipeline
from conftest import BASE_SEED, FULL, full
from moe_reference import routing

pytestmark = pytest.mark.layer  # under mpirun: the 2 x 2 phase only (pyproject.toml)

T, K, H, I = 8, 3, 4, 5
# fewer under mpirun (every process draws the same examples; each costs a cross-process run) and
# in the fast command (each example compiles a program for its capacity)
SETTINGS = settings(max_examples=(10 if FULL else 4) if jax.process_count() == 1 else
                    (2 if FULL else 1),
                    deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def config(n, capacity, **kw):
    """``capacity=None``: the worst case (``capacity_factor=None``)."""
    return ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=K, tokens_per_rank=T,
                            recv_capacity=capacity, **{"capacity_factor": None} | kw)


def max_load(ids, n, E):
    """Most distinct (token, expert) pairs any rank must serve."""
    L = E // n
    load = np.zeros(n, np.int64)
    for row in ids:
        for e in {int(e) for e in row if 0 <= e < E}:
            load[e // L] += 1
    return int(load.max())


@functools.lru_cache(maxsize=None)
def identity_layer(sharded, cfg):
    """Identity experts: y[t] = sum of the weights of t's served pairs times x[t]."""
    def f(x, ids, w):
        out = ep_comm.moe_layer(x, ids, w, cfg, experts=lambda ex, gs: ex, return_handle=True)
        return out.y, out.rounds
    return sharded.smap(f)


def routings(n, L=4):
    """Skewed, hot-expert, empty-rank and masked routings over ``L`` experts per rank, as
    hypothesis draws them."""
    E = L * n

    def make(args):
        kind, hot, mask_p, bits = args
        rng = np.random.default_rng(bits)
        if kind == "skewed":
            p = 1.0 / (np.arange(E) + 1.0) ** 1.5
            ids = rng.choice(E, (n * T, K), p=p / p.sum())
        elif kind == "hot":  # every token to expert `hot` (and repeats of it)
            ids = np.full((n * T, K), hot % E)
        elif kind == "empty_ranks":  # only the first rank's experts
            ids = rng.integers(0, L, (n * T, K))
        else:
            ids = rng.integers(0, E, (n * T, K))
        ids[rng.random(ids.shape) < mask_p] = -1
        return ids.astype(np.int32)

    return st.tuples(st.sampled_from(["uniform", "skewed", "hot", "empty_ranks"]),
                     st.integers(0, 10**6), st.sampled_from([0.0, 0.3]),
                     st.integers(0, 2**31)).map(make)


def served_once(sharded, cfg, ids, data):
    """Run the identity-expert layer on ``ids`` (random ``x`` and weights drawn from ``data``),
    check every pair was served exactly once and return the rounds it reported."""
    n = cfg.num_ranks
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    w = rng.uniform(0.1, 1.0, (n * T, K)).astype(np.float32)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    y, rounds = sharded.get(identity_layer(sharded, cfg)(*sharded.put(x, ids, w)))
    # a pair served twice or never would change y by w * x: weights are at least 0.1
    want = np.sum(np.where(ids >= 0, w, 0.0), axis=1, keepdims=True) * x.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    return rounds


@pytest.mark.multiprocess
@seed(BASE_SEED)
@SETTINGS
@given(data=st.data())
def test_every_pair_served_once_in_at_most_ceil_load_over_capacity_rounds(sharded, n, data):
    ids = data.draw(routings(n))
    # capacity 1 means a round per pair of the busiest rank: single-process only
    capacity = data.draw(st.sampled_from([1, 3, T * K, 2 * T * K] if jax.process_count() == 1
                                         else [3, T * K]))
    cfg = config(n, capacity)
    rounds = served_once(sharded, cfg, ids, data)
    load = max_load(ids, n, 4 * n)
    assert np.all(rounds == max(1, math.ceil(load / capacity))) if not cfg.is_dropless \
        else np.all(rounds == 1)


@functools.lru_cache(maxsize=None)
def swiglu_layer_and_grads(sharded, cfg):
    def f(x, ids, w, w_in, w_out, cot):
        def loss(x, w, w_in, w_out):
            y = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out)
            return jax.lax.psum(jnp.sum(y * cot), "ep")
        out = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out, return_handle=True)
        return (out.y, out.rounds) + jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, w_in, w_out)
    return sharded.smap(f)


@pytest.mark.parametrize("kind,capacity", [
    # under mpirun (scripts/run.sh test) one of them (and the hypothesis test above)
    ("random", 1), pytest.param("skewed", T * K, marks=pytest.mark.multiprocess),
    ("one_expert", 1), pytest.param("one_rank", 3, marks=full),
    pytest.param("empty_ranks", 2 * T * K, marks=full)])
def test_rounds_equal_the_worst_case_round_with_gradients(sharded, n, rng, kind, capacity):
    E = 4 * n
    ids = routing(rng, kind, n, T, K, E)
    ids[0, 1] = ids[0, 0]  # a repeated expert: merged into one pair
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    w = rng.random((n * T, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    cot = rng.standard_normal((n * T, H)).astype(np.float32)
    args = sharded.put(x, ids, w, w_in, w_out, cot)
    worst = sharded.get(swiglu_layer_and_grads(sharded, config(n, None))(*args))
    got = sharded.get(swiglu_layer_and_grads(sharded, config(n, capacity))(*args))
    assert np.all(worst[1] == 1)
    bounded = config(n, capacity)
    want_rounds = 1 if bounded.is_dropless else max(1, math.ceil(max_load(ids, n, E) / capacity))
    assert np.all(got[1] == want_rounds), (got[1], want_rounds)
    for name, g, r in zip(("y", "d x", "d topk_weights", "d w_in", "d w_out"),
                          got[:1] + got[2:], worst[:1] + worst[2:]):
        # the rounds add a token's experts in another order: float32 reassociation
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)


def _most_rows(closed_jaxpr, hidden):
    """The most rows of any ``(rows, hidden)`` array the program (its calls, loops and custom
    VJPs included) holds."""
    most = 0

    def walk(jaxpr):
        nonlocal most
        for e in jaxpr.eqns:
            for v in e.outvars:
                shape = getattr(v.aval, "shape", ())
                if len(shape) == 2 and shape[1] == hidden:
                    most = max(most, shape[0])
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return most


def test_default_capacity_is_twice_a_balanced_step():
    """``capacity_factor`` (default 2): the layer's buffer per chunk is ``ceil(2 T topk / C)``
    pairs per rank, for token and expert chunks, unless that reaches the chunk's worst case."""
    ds = ep_comm.EPConfig("ep", num_ranks=8, num_experts=256, topk=8, tokens_per_rank=4096)
    assert ds.capacity_factor == 2.0 and ds.expert_rows == ds.worst_case_rows == 262144
    assert pipeline.chunk_config(ds, 1).expert_rows == 65536  # a quarter of the worst case
    for by in ("tokens", "experts"):
        four = dataclasses.replace(ds, num_chunks=4, chunk_by=by)
        assert pipeline.chunk_config(four, 4).expert_rows == 16384
    assert pipeline.chunk_config(dataclasses.replace(ds, capacity_factor=1.3), 1).expert_rows \
        == math.ceil(1.3 * 4096 * 8)
    assert pipeline.chunk_config(dataclasses.replace(ds, capacity_factor=None), 1).is_dropless
    assert pipeline.chunk_config(dataclasses.replace(ds, recv_capacity=999), 1).expert_rows == 999
    # one rank: twice balanced is past the worst case (every pair is local): one round
    one_rank = dataclasses.replace(ds, num_ranks=1, num_experts=32)
    assert pipeline.chunk_config(one_rank, 1).is_dropless
    # ... but a chunk of experts, which holds a quarter of a token's pairs, can need rounds
    assert pipeline.chunk_config(dataclasses.replace(one_rank, num_chunks=4, chunk_by="experts"),
                                 4).expert_rows == 16384


@pytest.mark.parametrize("kind", ["random", pytest.param("one_rank",
                                                         marks=pytest.mark.multiprocess)])
def test_the_default_layer_holds_twice_a_balanced_step_and_drops_nothing(sharded, n, rng, kind):
    """The default layer on several ranks: no array of its program holds more rows than twice a
    balanced step's pairs (the worst case does: the check can fail), a routing that sends a rank
    more runs in rounds, and the results are the worst-case layer's."""
    default = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=K, tokens_per_rank=T)
    worst = config(n, None)
    ids = routing(rng, kind, n, T, K, 4 * n)
    w = rng.uniform(0.1, 1.0, (n * T, K)).astype(np.float32)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    args = sharded.put(x, ids, w)
    rows = {}
    for name, cfg in (("default", default), ("worst", worst)):
        rows[name] = _most_rows(jax.make_jaxpr(identity_layer(sharded, cfg))(*args), H)
    bound = min(2 * T * K, worst.worst_case_rows)
    # (n * T rows: the global x outside the shard_map, and the portable transport's all-to-all,
    # which gives each peer a slot of T tokens)
    assert rows["default"] <= max(bound, n * T), rows
    if worst.worst_case_rows > max(bound, n * T):
        assert rows["worst"] == worst.worst_case_rows, rows
    y, rounds = sharded.get(identity_layer(sharded, default)(*args))
    y_worst, _ = sharded.get(identity_layer(sharded, worst)(*args))
    np.testing.assert_allclose(y, y_worst, rtol=1e-5, atol=1e-5)
    assert np.all(rounds == max(1, math.ceil(max_load(ids, n, 4 * n) / bound))), rounds


def test_rounds_bad_input(sharded, n):
    cfg = config(n, 3)
    with pytest.raises(ValueError, match="moe_layer: topk_weights must be a floating array of "
                                         r"shape \(8, 3\), got int32 \(8, 3\)"):
        sharded.smap(lambda x, ids, w: ep_comm.moe_layer(
            x, ids, w.astype(jnp.int32), cfg, experts=lambda ex, gs: ex))(
                *sharded.put(np.zeros((n * T, H), np.float32), np.zeros((n * T, K), np.int32),
                             np.zeros((n * T, K), np.float32)))
    with pytest.raises(ValueError, match="EPConfig: recv_capacity must be a positive int, "
                                         "got 0"):
        config(n, 0)
    for bad in (0.5, float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"EPConfig: capacity_factor must be None or a number "
                                             r">= 1 \(the layer's expert buffer per round as a "
                                             r"multiple of the balanced load\), got "
                                             + re.escape(repr(bad))):
            config(n, None, capacity_factor=bad)


@pytest.mark.parametrize("capacity,chunks", [(5, 1), (None, 4)])
def test_rounds_and_chunks_differentiate_arrays_the_user_experts_close_over(sharded, n, rng,
                                                                            capacity, chunks):
    """Rounds (a capacity below the worst case) and the chunked pipeline (``num_chunks``) both
    run user experts through a custom VJP: their closed-over arrays get gradients."""
    E = 4 * n
    ids = routing(rng, "random", n, T, K, E)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    w = rng.random((n * T, K)).astype(np.float32)
    W = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)

    def grads(cfg):
        def f(x, ids, w, W_local):
            def loss(x, w, W_local):
                y = ep_comm.moe_layer(x, ids, w, cfg, experts=lambda ex, gs: jnp.tanh(
                    ep_comm.grouped_matmul(ex, W_local, gs)))
                return jax.lax.psum(jnp.sum(y ** 2), "ep")
            return jax.grad(loss, argnums=(0, 1, 2))(x, w, W_local)
        return sharded.get(sharded.smap(f)(*sharded.put(x, ids, w, W)))

    bounded = dataclasses.replace(config(n, capacity), num_chunks=chunks)
    for name, g, r in zip(("d x", "d w", "d W"), grads(bounded), grads(config(n, None))):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)
