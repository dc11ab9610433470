"""Hierarchical (two-stage, per-node dedup) dispatch/combine on simulated topologies.

Every test runs at any device count: the simulated shapes ``NxG`` that match the number of
devices run (8 devices: 2x4, 4x2 and the degenerate 1x8, 8x1; 4: 2x2, 4x1; 2: 2x1, 1x2; 1: 1x1),
over one flattened axis with a topology attached and over a mesh with separate node and local
axes. The fast command runs a covering set of shape x layout (x routing x transport): every
shape, layout, routing and transport at least once (``conftest.matrix``); test-full all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from math import comb
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm import topology
from conftest import BACKENDS, N_DEVICES, matrix
from moe_reference import Reference, dense_moe, hits_mean_sd, routing

T, K, H, F = 16, 4, 8, 6
SHAPES = ["2x4", "4x2", "1x8", "8x1", "2x2", "2x1", "1x2", "4x1", "1x1"]
LAYOUTS = ["groups", "axes"]


def shape_of(spec):
    """``"NxG"`` -> ``(N, G)``: N simulated nodes of G devices."""
    N, G = map(int, spec.split("x"))
    return N, G


# the shapes of this run's device count, two-level ones (N, G > 1) first
HERE = sorted((s for s in SHAPES if math.prod(shape_of(s)) == N_DEVICES),
              key=lambda s: 1 in shape_of(s))
TWO_LEVEL = [s for s in HERE if 1 not in shape_of(s)] or HERE
# routing patterns run single-process (portable); across processes, random routing
KINDS = ["random", "masked", "empty_ranks"] if jax.process_count() == 1 else ["random"]


class Layout:
    """A mesh for one layout: ``groups`` (one 'ep' axis, topology attached) or ``axes``
    (('node', 'local') axes). :func:`mesh_for` makes one per (layout, N, G) so that compiled programs
    are shared between tests."""

    def __init__(self, layout, N, G):
        auto = jax.sharding.AxisType.Explicit
        if layout == "groups":
            self.mesh = jax.make_mesh((N * G,), ("ep",), axis_types=(auto,))
            self.axis = "ep"
        else:
            self.mesh = jax.make_mesh((N, G), ("node", "local"), axis_types=(auto, auto))
            self.axis = ("node", "local")
        self.rows = NamedSharding(self.mesh, P(self.axis))
        self.topology = topology.simulated(N, G) if layout == "groups" else None

    def put(self, *arrays):
        return tuple(ep_comm.distributed.global_array(a, self.rows) for a in arrays)

    def get(self, tree):
        return jax.tree.map(ep_comm.distributed.to_host, tree)

    def smap(self, f):
        return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=P(self.axis),
                                     out_specs=P(self.axis)))

    def config(self, n, plan, backend="portable", E=None, topk=K, tokens=T, **kw):
        return ep_comm.EPConfig(axis_name=self.axis, num_ranks=n,
                                num_experts=E or 4 * n, topk=topk, tokens_per_rank=tokens,
                                backend=backend, plan=plan, topology=self.topology, **kw)

    @functools.lru_cache(maxsize=None)
    def program(self, cfg):
        """dispatch, combine of ``2 * expert_x + 1``, and the handle's counts; once per config."""
        def f(x, ids, w):
            ex, h = ep_comm.dispatch(x, ids, w, cfg)
            y = ep_comm.combine(ex * 2 + 1, h)
            return Result(ex, y, h.group_sizes, h.num_dropped, h.link_rows, h.recv_pos)
        return self.smap(f)


mesh_for = functools.lru_cache(maxsize=None)(Layout)


class Result(NamedTuple):
    expert_x: jax.Array
    y: jax.Array  # combine(2 * expert_x + 1)
    group_sizes: jax.Array
    num_dropped: jax.Array
    link_rows: jax.Array
    recv_pos: jax.Array


def run(m, cfg, x, ids, w) -> Result:
    return m.get(m.program(cfg)(*m.put(x, ids, w)))


def inputs(rng, n, kind, E=None, topk=K, tokens=T):
    x = rng.standard_normal((n * tokens, H)).astype(np.float32)
    ids = routing(rng, kind, n, tokens, topk, E or 4 * n)
    w = rng.random((n * tokens, topk)).astype(np.float32)
    return x, ids, w


@pytest.mark.multiprocess
@matrix("shape,layout,kind,backend", HERE, LAYOUTS, KINDS, BACKENDS,
        strength=2 if "mpi" in BACKENDS else 1)  # (every layout and shape with the MPI engine)
def test_hierarchical_equals_flat(n, rng, shape, layout, kind, backend):
    N, G = shape_of(shape)
    m = mesh_for(layout, N, G)
    x, ids, w = inputs(rng, n, kind)
    flat = run(m, m.config(n, "flat", backend), x, ids, w)
    hier = run(m, m.config(n, "hierarchical", backend), x, ids, w)
    # dispatch: the same expert rows, bit for bit, in the same order, with the same groups
    np.testing.assert_array_equal(hier.expert_x, flat.expert_x)
    np.testing.assert_array_equal(hier.group_sizes, flat.group_sizes)
    np.testing.assert_array_equal(hier.num_dropped, flat.num_dropped)
    # combine: within float32 reassociation of the per-rank vs per-node partial sums
    np.testing.assert_allclose(hier.y, flat.y, rtol=1e-5, atol=1e-5)
    cfg = m.config(n, "flat")
    ref = Reference(ids, n, cfg.num_experts, T, cfg.expert_rows, cfg.recv_token_rows)
    np.testing.assert_array_equal(hier.expert_x.reshape(n, cfg.expert_rows, H), ref.expert_x(x))
    np.testing.assert_allclose(hier.y, ref.combine(2 * x + 1, ids, w), rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@matrix("shape", [s for s in HERE if s in ("2x4", "4x2", "2x2", "2x1", "1x2")], strength=0)
def test_hierarchical_capacity_drops_like_flat(n, rng, shape):
    N, G = shape_of(shape)
    m = mesh_for("groups", N, G)
    x, ids, w = inputs(rng, n, "one_rank")
    cap = max(1, T // 2)
    flat = run(m, m.config(n, "flat", recv_capacity=cap), x, ids, w)
    hier = run(m, m.config(n, "hierarchical", recv_capacity=cap), x, ids, w)
    assert flat.num_dropped.sum() > 0
    for field in ("y", "group_sizes", "num_dropped"):
        np.testing.assert_allclose(getattr(hier, field), getattr(flat, field), rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_array_equal(hier.expert_x, flat.expert_x)


@pytest.mark.multiprocess
@matrix("shape,layout", [s for s in HERE if s in ("2x4", "4x2", "2x2", "2x1")], LAYOUTS,
        strength=1 if jax.process_count() == 1 else 0)
def test_hierarchical_gradients_equal_flat(n, rng, shape, layout):
    N, G = shape_of(shape)
    m = mesh_for(layout, N, G)
    x, ids, w = inputs(rng, n, "masked")
    E = 4 * n
    W = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    cot = rng.standard_normal((n * T, F)).astype(np.float32)

    def grads(cfg):
        def moe(x, ids, w, W_local):
            ex, h = ep_comm.dispatch(x, ids, w, cfg)
            return ep_comm.combine(jax.lax.ragged_dot(ex, W_local, h.group_sizes), h)

        def f(x, ids, w, W_local, cot):
            loss = lambda x, w, W_: jax.lax.psum(jnp.sum(moe(x, ids, w, W_) * cot), m.axis)
            return (moe(x, ids, w, W_local),) + jax.grad(loss, argnums=(0, 1, 2))(x, w, W_local)
        return m.get(m.smap(f)(*m.put(x, ids, w, W, cot)))

    flat = grads(m.config(n, "flat"))
    hier = grads(m.config(n, "hierarchical"))
    for a, b in zip(hier, flat):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # and against the dense model
    rx, rw, rW = jax.grad(lambda x, w, W: jnp.sum(dense_moe(x, ids, w, W) * cot),
                          argnums=(0, 1, 2))(x, w, W)
    _, gx, gw, gW = hier
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gW, rW, rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@matrix("shape", [s for s in TWO_LEVEL if s in ("2x4", "4x2", "2x2", "2x1", "1x2")],
        strength=0)
def test_link_rows_match_numpy_count_and_network_shrinks(n, rng, shape):
    N, G = shape_of(shape)
    m = mesh_for("groups", N, G)
    E, topk, tokens = 32 * n, min(8, 32 * n), 64
    x, ids, w = inputs(rng, n, "random", E=E, topk=topk, tokens=tokens)
    got = {}
    for plan in ("flat", "hierarchical"):
        cfg = m.config(n, plan, E=E, topk=topk, tokens=tokens)
        out = run(m, cfg, x, ids, w)
        rows = out.link_rows.reshape(n, 2, -1)
        want = topology.count_traffic(ids.reshape(n, tokens, topk), num_experts=E,
                                      topology=m.topology, hidden=H, dtype=np.float32,
                                      plan=plan)
        np.testing.assert_array_equal(rows[:, 0], want.rows_by_link("dispatch"))
        np.testing.assert_array_equal(rows[:, 1], want.rows_by_link("combine"))
        got[plan] = want
    net = topology.LINK_CLASSES.index("network")
    flat_net = got["flat"].rows_by_link("dispatch")[:, net].sum()
    hier_net = got["hierarchical"].rows_by_link("dispatch")[:, net].sum()
    if N == 1:
        assert flat_net == hier_net == 0
        return
    exp = {p: topology.expected_traffic(num_experts=E, topk=topk, tokens_per_rank=tokens,
                                        topology=m.topology, hidden=H, dtype=np.float32, plan=p)
           for p in topology.PLANS}
    want_ratio = (exp["flat"].rows_by_link("dispatch")[:, net].sum()
                  / exp["hierarchical"].rows_by_link("dispatch")[:, net].sum())
    assert hier_net <= flat_net
    # random top-k: the saving matches the expectation for uniform routing. Per token, flat sends
    # one network row per remote rank hit, hierarchical one per remote node hit (hits_mean_sd);
    # with both totals over the n * tokens tokens within 5 sd of their means (chance of a miss
    # about 1e-6), the ratio lies in the interval below.
    L = E // n
    (mf, sf), (mh, sh) = (hits_mean_sd(E, topk, s) for s in ([L] * (n - G), [G * L] * (N - 1)))
    nt = n * tokens
    lo = (nt * mf - 5 * np.sqrt(nt) * sf) / (nt * mh + 5 * np.sqrt(nt) * sh)
    hi = (nt * mf + 5 * np.sqrt(nt) * sf) / (nt * mh - 5 * np.sqrt(nt) * sh)
    np.testing.assert_allclose(want_ratio, mf / mh, rtol=1e-9)
    assert lo <= flat_net / hier_net <= hi, (flat_net, hier_net, lo, want_ratio, hi)
    # closed form: a remote rank gets a token with p_rank, a remote node with p_node
    p_rank = 1 - comb(E - E // n, topk) / comb(E, topk)
    p_node = 1 - comb(E - G * E // n, topk) / comb(E, topk)
    np.testing.assert_allclose(want_ratio, (n - G) * p_rank / ((N - 1) * p_node), rtol=1e-12)
    if G > 1:
        assert want_ratio > 1.2


@pytest.mark.multiprocess
def test_auto_plan(n, rng, monkeypatch):
    monkeypatch.delenv(topology.ENV, raising=False)
    x, ids, w = inputs(rng, n, "random")
    m = mesh_for("groups", 1, n)
    cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=4 * n, topk=K,
                           tokens_per_rank=T)
    plans = {}  # the plan is chosen when dispatch is traced: no program needs compiling

    def f(x, ids, w, cfg=cfg):
        _, h = ep_comm.dispatch(x, ids, w, cfg)
        plans[cfg] = h.plan
        return h.group_sizes

    m.smap(f).trace(*m.put(x, ids, w))
    assert plans[cfg] == "flat"  # one node (all devices of this test run are on one host)
    if n % 2 or n < 4:
        return
    topo = topology.simulated(2, n // 2)
    slow_net = topology.CostModel(network=topology.Link(0.0, 1e6))
    # tiny messages: latency decides, and flat has half the legs
    tiny = dataclasses.replace(cfg, topology=topo)
    m.smap(lambda *a: f(*a, cfg=tiny)).trace(*m.put(x, ids, w))
    assert plans[tiny] == ep_comm.plan.choose(tiny, topo, H, np.dtype("float32")) == "flat"
    slow = dataclasses.replace(tiny, cost_model=slow_net)
    m.smap(lambda *a: f(*a, cfg=slow)).trace(*m.put(x, ids, w))
    assert plans[slow] == "hierarchical"
    # DeepSeek-V3 sizes on H200-class defaults: hierarchical, unless the network were as fast as
    # NVLink
    big = dataclasses.replace(tiny, num_experts=256, topk=8, tokens_per_rank=4096)
    assert ep_comm.plan.choose(big, topo, 7168, np.dtype("bfloat16")) == "hierarchical"
    fast = topology.CostModel(network=topology.CostModel().nvlink)
    assert ep_comm.plan.choose(dataclasses.replace(big, cost_model=fast), topo, 7168,
                               np.dtype("bfloat16")) == "flat"
    # the machine from EP_COMM_TOPOLOGY
    monkeypatch.setenv(topology.ENV, f"2x{n // 2}")
    env = dataclasses.replace(cfg, cost_model=slow_net)
    m.smap(lambda *a: f(*a, cfg=env)).trace(*m.put(x, ids, w))
    assert plans[env] == "hierarchical"


def test_config_errors(n):
    kw = dict(axis_name="ep", num_ranks=8, num_experts=32, topk=2, tokens_per_rank=4)
    with pytest.raises(ValueError, match=re.escape(
            "EPConfig: plan must be one of ('auto', 'flat', 'hierarchical'), got 'tree'")):
        ep_comm.EPConfig(**kw, plan="tree")
    with pytest.raises(ValueError, match=re.escape(
            "EPConfig: the topology has 3 nodes x 2 devices = 6 ranks but the expert-parallel "
            "axis has 8")):
        ep_comm.EPConfig(**kw, topology=topology.simulated(3, 2))
    with pytest.raises(TypeError, match=re.escape(
            "EPConfig: topology must be a topology.Topology or None, got str")):
        ep_comm.EPConfig(**kw, topology="2x4")
    with pytest.raises(TypeError, match=re.escape(
            "EPConfig: cost_model must be a topology.CostModel or None, got dict")):
        ep_comm.EPConfig(**kw, cost_model={})


def test_axes_and_topology_must_agree(n, rng):
    if n < 4 or n % 2:
        pytest.skip("needs an even device count >= 4")
    m = mesh_for("axes", 2, n // 2)
    cfg = ep_comm.EPConfig(axis_name=m.axis, num_ranks=n, num_experts=4 * n, topk=K,
                           tokens_per_rank=T, plan="hierarchical",
                           topology=topology.simulated(n, 1))
    x, ids, w = inputs(rng, n, "random")
    with pytest.raises(ValueError, match=re.escape(
            f"dispatch: axis_name=('node', 'local') has shape (2, {n // 2}) (nodes, devices per "
            f"node) but config.topology is {n}x1")):
        m.smap(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg)[0])(*m.put(x, ids, w))
