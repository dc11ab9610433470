"""topology: the Topology value, discovery, traffic counting, cost model, node-limited routing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ep_comm import topology
from moe_reference import hits_mean_sd
from ep_comm.topology import CostModel, Link


def test_simulated_shape_links_and_roundtrip(tmp_path):
    t = topology.simulated(2, 4)
    assert t.shape == (2, 4) and t.num_ranks == 8 and t.node_of(5) == 1
    assert [t.link(0, d) for d in (0, 3, 4, 7)] == ["self", "nvlink", "network", "network"]
    path = tmp_path / "t.json"
    t.save(path)
    back = topology.Topology.load(path)
    assert back.nodes == t.nodes and back.source == f"file:{path}"
    assert topology.parse(str(path)).nodes == t.nodes
    assert topology.parse(" 4X2 ").shape == (4, 2)
    text = str(t)
    assert text.startswith("Topology (simulated): 2 nodes x 4 devices, intra-node link nvlink")
    assert len(text.splitlines()) == 2 + 8


def test_topology_errors(tmp_path):
    with pytest.raises(ValueError, match=re.escape(
            "topology spec must be 'NxG' (e.g. '2x4') or a JSON file path, got 'two' (no such "
            "file)")):
        topology.parse("two")
    with pytest.raises(ValueError, match=re.escape(
            "topology spec '0x4': nodes and devices per node must be >= 1")):
        topology.parse("0x4")
    with pytest.raises(ValueError, match=re.escape(
            "simulated: gpus_per_node must be a positive int, got 0")):
        topology.simulated(2, 0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [{"devices": []}]}')
    with pytest.raises(ValueError, match=re.escape(
            "Topology.from_json: not a saved topology (KeyError: 'host')")):
        topology.Topology.load(bad)
    uneven = topology.Topology((topology.Node("a", (topology.Device(0),)),
                                topology.Node("b", (topology.Device(0), topology.Device(1)))))
    with pytest.raises(ValueError, match=re.escape(
            "Topology: nodes have different device counts [1, 2]; the hierarchical plan needs "
            "the same number of devices on every node")):
        uneven.gpus_per_node
    with pytest.raises(ValueError, match=re.escape(
            "Topology: node 0 ('a') must list local indices 0..1 in order, got [1, 0]")):
        topology.Topology((topology.Node("a", (topology.Device(1), topology.Device(0))),))


@pytest.mark.multiprocess
@pytest.mark.processes
def test_discover_this_machine(monkeypatch):
    monkeypatch.delenv(topology.ENV, raising=False)
    t = topology.discover()
    assert t.num_ranks == jax.device_count()
    ids = [d.device_id for node in t.nodes for d in node.devices]
    assert sorted(ids) == sorted(d.id for d in jax.devices())
    assert t.source.startswith("discovered")
    assert topology.current() == topology.current()  # cached
    monkeypatch.setenv(topology.ENV, "2x3")
    assert topology.current().shape == (2, 3) and topology.known().shape == (2, 3)


def test_cli_prints_topology_and_predictions():
    if jax.process_count() > 1:
        pytest.skip("the CLI is run in a fresh single process")
    env = dict(os.environ, EP_COMM_TOPOLOGY="2x4", XLA_FLAGS="")
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-m", "ep_comm.topology", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got["topology"]["nodes"]) == 2
    flat, hier = got["plans"]["flat"], got["plans"]["hierarchical"]
    assert hier["network_bytes_per_rank"] < flat["network_bytes_per_rank"]
    assert hier["predicted_s"]["total"] < flat["predicted_s"]["total"]


def test_count_traffic_by_hand():
    # 2 nodes x 2 ranks, 8 experts (2 per rank), 1 token per rank, top-3
    t = topology.simulated(2, 2)
    ids = np.array([[[0, 4, 6]], [[1, 2, -1]], [[-1, -1, -1]], [[7, 3, 2]]])
    flat = topology.count_traffic(ids, num_experts=8, topology=t, hidden=4, dtype=np.float32,
                                  plan="flat")
    hier = topology.count_traffic(ids, num_experts=8, topology=t, hidden=4, dtype=np.float32,
                                  plan="hierarchical")
    # classes: self, nvlink, pcie, network
    np.testing.assert_array_equal(flat.rows_by_link("dispatch"),
                                  [[1, 0, 0, 2], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    # hierarchical: rank 0's token goes once to node 1 (rank 2), which keeps it and forwards
    # it to rank 3; stage 1 to one's own node and stage 2 to oneself are copies ("self")
    np.testing.assert_array_equal(hier.rows_by_link("dispatch"),
                                  [[2, 0, 0, 1], [3, 1, 0, 0], [1, 1, 0, 0], [2, 0, 0, 1]])
    # combine sends back what each rank received
    np.testing.assert_array_equal(hier.rows_by_link("combine"),
                                  [[2, 1, 0, 0], [3, 0, 0, 1], [1, 0, 0, 1], [2, 1, 0, 0]])
    row = 4 * 4 + 2 * 3 * 4
    np.testing.assert_array_equal(hier.network_bytes("dispatch"), [row, 0, 0, row])
    with pytest.raises(ValueError, match=re.escape(
            "count_traffic: topk_ids must be an integer array of shape (ranks, tokens, topk), "
            "got float64 (4, 3)")):
        topology.count_traffic(np.zeros((4, 3)), num_experts=8, topology=t, hidden=4,
                               dtype=np.float32, plan="flat")
    with pytest.raises(ValueError, match=re.escape(
            "count_traffic: plan must be one of ('flat', 'hierarchical'), got 'ring'")):
        topology.count_traffic(ids, num_experts=8, topology=t, hidden=4, dtype=np.float32,
                               plan="ring")
    with pytest.raises(ValueError, match=re.escape(
            "count_traffic: the topology has 2 nodes x 2 devices = 4 ranks but the "
            "expert-parallel axis has 3")):
        topology.count_traffic(ids[:3], num_experts=6, topology=t, hidden=4, dtype=np.float32,
                               plan="flat")


def test_expected_traffic_matches_random_routing(rng):
    N, G = 4, 8
    t = topology.simulated(N, G)
    n = N * G
    E, K, T = 256, 8, 512
    L = E // n
    ids = np.argsort(rng.random((n, T, E)), axis=2)[:, :, :K]
    # Per token, each link class carries a count of expert sets hit (hits_mean_sd: exact mean and
    # sd); a class made of two counts has sd <= the sum of theirs. Totals over the n*T independent
    # tokens are within 5 sd of the mean but for a chance of about 6e-7 per class.
    sets = {"flat": {"self": [[L]], "nvlink": [[L] * (G - 1)], "pcie": [],
                     "network": [[L] * (n - G)]},
            # stage 1 once per node (own node: a copy), stage 2 from the same-index rank there
            "hierarchical": {"self": [[G * L], [L] * N], "nvlink": [[L] * (n - N)], "pcie": [],
                             "network": [[G * L] * (N - 1)]}}
    for plan in topology.PLANS:
        got = topology.count_traffic(ids, num_experts=E, topology=t, hidden=16,
                                     dtype=np.float32, plan=plan).rows_by_link("dispatch")
        exp = topology.expected_traffic(num_experts=E, topk=K, tokens_per_rank=T, topology=t,
                                        hidden=16, dtype=np.float32,
                                        plan=plan).rows_by_link("dispatch")
        stats = [[hits_mean_sd(E, K, s) for s in sets[plan][c]] for c in topology.LINK_CLASSES]
        mean = np.array([sum(m for m, _ in st) for st in stats]) * n * T
        tol = 5 * np.sqrt(n * T) * np.array([sum(sd for _, sd in st) for st in stats])
        np.testing.assert_allclose(exp.sum(0), mean, rtol=1e-9)  # the closed form, another way
        assert np.all(np.abs(got.sum(0) - mean) <= tol), (plan, got.sum(0), mean, tol)
    p_rank = 1 - comb(E - 8, K) / comb(E, K)
    p_node = 1 - comb(E - 64, K) / comb(E, K)
    net = topology.LINK_CLASSES.index("network")
    flat = topology.expected_traffic(num_experts=E, topk=K, tokens_per_rank=T, topology=t,
                                     hidden=16, dtype=np.float32, plan="flat")
    hier = topology.expected_traffic(num_experts=E, topk=K, tokens_per_rank=T, topology=t,
                                     hidden=16, dtype=np.float32, plan="hierarchical")
    np.testing.assert_allclose(flat.rows_by_link("dispatch")[0, net], 24 * p_rank * T)
    np.testing.assert_allclose(hier.rows_by_link("dispatch")[0, net], 3 * p_node * T)


def test_cost_model_predict_and_calibrate():
    t = topology.simulated(2, 2)
    ids = np.array([[[0, 4]], [[1, 2]], [[5, 6]], [[7, 3]]])
    model = CostModel(self=Link(0, 1e12), nvlink=Link(1e-6, 1e9), pcie=Link(1e-6, 1e9),
                      network=Link(1e-5, 1e8))
    traffic = topology.count_traffic(ids, num_experts=8, topology=t, hidden=1000,
                                     dtype=np.float32, plan="flat")
    p = model.predict(traffic)
    # flat dispatch: rank 0 sends one row to rank 2 (network), receives from 2 and 3
    row = 1000 * 4 + 2 * 2 * 4
    net_in = traffic.exchanges[0].rows[:, 0]
    assert p["legs"]["dispatch exchange"] >= 2 * 1e-5 + row / 1e8
    assert p["total"] == pytest.approx(p["dispatch"] + p["combine"])
    assert net_in.sum() >= 1
    # calibration recovers a line
    samples = [("network", b, 7e-6 + b / 4e10) for b in (1e5, 1e6, 1e7)]
    fitted = CostModel.calibrate(samples)
    assert fitted.network.alpha == pytest.approx(7e-6)
    assert fitted.network.beta == pytest.approx(4e10)
    assert fitted.nvlink == CostModel().nvlink
    with pytest.raises(ValueError, match=re.escape(
            "CostModel.calibrate: link class 'network' needs samples at two or more sizes, got "
            "sizes [1000.0]")):
        CostModel.calibrate([("network", 1e3, 1e-5), ("network", 1e3, 2e-5)])
    with pytest.raises(ValueError, match=re.escape(
            "CostModel.calibrate: sample 0 names link class 'ib'; expected one of ('self', "
            "'nvlink', 'pcie', 'network')")):
        CostModel.calibrate([("ib", 1e3, 1e-5)])
    with pytest.raises(ValueError, match=re.escape(
            "Link: beta must be a finite number > 0, got 0")):
        Link(1e-6, 0)


def _reference_group_topk(scores, k, groups, topk_groups, per_score):
    T, E = scores.shape
    g = scores.reshape(T, groups, E // groups)
    gscore = np.sort(g, axis=2)[:, :, ::-1][:, :, :per_score].sum(2)
    out = np.zeros((T, k), np.int64)
    for t in range(T):
        best = np.argsort(-gscore[t], kind="stable")[:topk_groups]
        masked = np.full(E, -np.inf)
        for b in best:
            sl = slice(b * E // groups, (b + 1) * E // groups)
            masked[sl] = scores[t, sl]
        out[t] = np.argsort(-masked, kind="stable")[:k]
    return out


def test_group_limited_topk(rng):
    T, E, groups = 64, 64, 8
    scores = rng.random((T, E)).astype(np.float32)
    r = topology.group_limited_topk(scores, 8, num_groups=groups, topk_groups=3)
    ids = np.asarray(r.topk_ids)
    np.testing.assert_array_equal(np.sort(ids, 1),
                                  np.sort(_reference_group_topk(scores, 8, groups, 3, 2), 1))
    assert max(len(set(row // (E // groups))) for row in ids) <= 3
    np.testing.assert_allclose(r.topk_weights, np.take_along_axis(scores, ids, 1))
    # all groups allowed: plain top-k
    full = topology.node_limited_topk(scores, 8, num_nodes=groups, max_nodes=groups)
    np.testing.assert_array_equal(np.sort(np.asarray(full.topk_ids), 1),
                                  np.sort(np.argsort(-scores, 1)[:, :8], 1))
    # bias steers the choice, weights stay the raw scores; normalised weights sum to one
    bias = np.zeros(E, np.float32)
    bias[:8] = 10.0
    b = topology.group_limited_topk(scores, 8, num_groups=groups, topk_groups=1, bias=bias,
                                    normalize=True)
    np.testing.assert_array_equal(np.sort(np.asarray(b.topk_ids), 1),
                                  np.tile(np.arange(8), (T, 1)))
    np.testing.assert_allclose(np.asarray(b.topk_weights).sum(1), 1.0, rtol=1e-6)
    g = jax.grad(lambda s: jnp.sum(topology.group_limited_topk(
        s, 2, num_groups=groups, topk_groups=2).topk_weights))(jnp.asarray(scores))
    assert float(jnp.sum(g)) == pytest.approx(2 * T)
    with pytest.raises(ValueError, match=re.escape(
            "group_limited_topk: topk_groups must be an int in [1, 8], got 9")):
        topology.group_limited_topk(scores, 8, num_groups=groups, topk_groups=9)
    with pytest.raises(ValueError, match=re.escape(
            "group_limited_topk: the 64 experts must split evenly into num_groups=5 groups")):
        topology.group_limited_topk(scores, 8, num_groups=5, topk_groups=2)
    with pytest.raises(ValueError, match=re.escape(
            "group_limited_topk: topk must be an int in [1, 16], got 17")):
        topology.group_limited_topk(scores, 17, num_groups=groups, topk_groups=2)
