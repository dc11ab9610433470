"""Conservation properties of dispatch/combine over arbitrary routings (hypothesis).

The search starts from the run's seed (``EP_COMM_TEST_SEED``): a failure replays with it, and under
mpirun every process draws the same examples.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import HealthCheck, given, seed, settings, strategies as st

import ep_comm
from conftest import BASE_SEED

T, K, H = 8, 3, 2
SETTINGS = settings(max_examples=15, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def program(sharded, n):
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=K, tokens_per_rank=T,
                           backend="portable")

    def f(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ex, ep_comm.combine(ex, h), h

    return cfg, sharded.smap(f)


def routings(n):
    E = 4 * n
    return st.lists(st.integers(-1, E - 1), min_size=n * T * K, max_size=n * T * K).map(
        lambda v: np.array(v, np.int32).reshape(n * T, K))


@seed(BASE_SEED)
@SETTINGS
@given(data=st.data())
def test_every_pair_arrives_exactly_once_and_combine_sums(sharded, n, data):
    cfg, run = program(sharded, n)
    ids = data.draw(routings(n))
    w = np.array(data.draw(st.lists(st.floats(0, 1, width=32), min_size=n * T * K,
                                    max_size=n * T * K)), np.float32).reshape(n * T, K)
    # Token t carries its own id in column 0 and a marker in column 1, so rows can be traced.
    x = np.stack([np.arange(n * T), np.full(n * T, 7.0)], 1).astype(np.float32)
    ex, y, h = sharded.get(run(*sharded.put(x, ids, w)))
    L = cfg.experts_per_rank
    ex = ex.reshape(n, cfg.expert_rows, H)
    gs = h.group_sizes.reshape(n, L)
    arrived = []
    for d in range(n):
        row = 0
        for l in range(L):
            for _ in range(gs[d, l]):
                arrived.append((int(ex[d, row, 0]), d * L + l))
                row += 1
        assert np.all(ex[d, row:] == 0)  # nothing past the groups
    want = sorted({(t, int(e)) for t in range(n * T) for e in ids[t] if e >= 0})
    assert sorted(arrived) == want  # each distinct (token, expert) pair exactly once
    assert h.num_dropped.sum() == 0
    ref = (np.where(ids >= 0, w, 0).astype(np.float64).sum(1, keepdims=True) * x)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
