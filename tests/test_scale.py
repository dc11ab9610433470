"""topology.scale and scale_study: the scale model's properties, its agreement with CostModel and
with the one-GPU layer measured on the H200, and its errors."""

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest

from ep_comm.topology import CostModel, Link, count_traffic, simulated
from ep_comm.topology.scale import (H200, H800, LayerSpec, Schedule, counts_from_ids, draw_routing,
                                    layer_time, traffic, wire_row_bytes)
from ep_comm.topology.scale_study import main, one_gpu, validate
from ep_comm.topology.traffic import link_matrix

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = LayerSpec(experts=64, topk=4, hidden=512, intermediate=256, tokens_per_gpu=256)


def _with_links(hw, **links):
    return dataclasses.replace(hw, links=dataclasses.replace(hw.links, **links))


def test_link_matrix_vectorised_equals_pairwise():
    topo = simulated(3, 4)
    want = np.array([[["self", "nvlink", "pcie", "network"].index(topo.link(s, d))
                      for d in range(12)] for s in range(12)])
    np.testing.assert_array_equal(link_matrix(topo), want)


@pytest.mark.parametrize("plan", ["flat", "hierarchical"])
def test_counts_and_exchange_equal_count_traffic_and_cost_model(plan):
    """On explicit ids the model's legs are topology.count_traffic's, and its exchange time is
    CostModel.predict's, leg for leg."""
    rng = np.random.default_rng(0)
    n, T, K, E, G = 8, 64, 4, 32, 4
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(n)])
    ids[0, :5, 1] = -1
    counts = counts_from_ids(ids, E, G)
    spec = LayerSpec(experts=E, topk=K, hidden=128, intermediate=64, tokens_per_gpu=T)
    ours = traffic(counts, n, G, spec, Schedule(plan, "bf16"))
    ref = count_traffic(ids, num_experts=E, topology=simulated(n // G, G), hidden=128,
                        dtype=np.float16, plan=plan)
    assert [ex.name for ex in ours.exchanges] == [ex.name for ex in ref.exchanges]
    for a, b in zip(ours.exchanges, ref.exchanges):
        np.testing.assert_array_equal(a.rows, b.rows)
        assert a.row_bytes == b.row_bytes
    assert CostModel().predict(ours) == CostModel().predict(ref)


def test_one_node_forward_exchange_time_is_the_cost_model():
    """Forward only, serial, one node: the simulated exchange time (comm stream busy time of the
    slowest rank) equals CostModel.predict of the same routing."""
    spec = SMALL
    r = layer_time(H200, spec, Schedule("flat"), 8, backward=False, sample_tokens=256)
    counts = draw_routing("uniform", 8, spec, 8, sample_tokens=256)
    want = H200.links.predict(traffic(counts, 8, 8, spec, Schedule("flat")))["total"]
    assert r["exchange"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("gpus", [8, 32])
def test_monotonic_in_bytes_and_in_link_speed(gpus):
    sched = Schedule("hierarchical", "bf16", 2)
    t = lambda hw, spec: layer_time(hw, spec, sched, gpus, routing="uniform")["time"]  # noqa
    base = t(H200, SMALL)
    assert t(H200, dataclasses.replace(SMALL, hidden=1024)) > base  # more bytes (and FLOPs)
    assert t(H200, dataclasses.replace(SMALL, tokens_per_gpu=512)) > base
    fast = _with_links(H200, network=Link(8e-6, 90e9), nvlink=Link(3e-6, 300e9))
    slow = _with_links(H200, network=Link(8e-6, 20e9), nvlink=Link(3e-6, 80e9))
    assert t(fast, SMALL) <= base <= t(slow, SMALL)
    # strictly, where the links carry the time (this small layer's exchange is bound by the self
    # copy's latency): the DeepSeek layer
    assert t(slow, LayerSpec()) > t(H200, LayerSpec()) > t(fast, LayerSpec())
    # FP8 on the wire moves fewer bytes: never slower
    assert layer_time(H200, SMALL, dataclasses.replace(sched, wire="e4m3"), gpus,
                      routing="uniform")["time"] <= base


@pytest.mark.parametrize("gpus,routing", [(8, "uniform"), (16, "zipf"), (64, "node_limited")])
def test_overlap_is_never_slower_than_serial(gpus, routing):
    """Without per-call latency and weight re-reads, chunking only adds overlap: never slower
    than serial. With the real latencies and re-reads it is not slower at the DeepSeek shape
    either."""
    no_alpha = dataclasses.replace(_with_links(H200, **{
        c: Link(0.0, getattr(H200.links, c).beta) for c in ("self", "nvlink", "pcie", "network")}),
        weight_bw=1e30)
    no_rereads = dataclasses.replace(H200, weight_bw=1e30)
    for hw, spec in ((no_alpha, SMALL), (no_rereads, LayerSpec())):
        serial = layer_time(hw, spec, Schedule("hierarchical", "bf16", 1), gpus,
                            routing=routing, sample_tokens=128)
        for C in (2, 4, 8):
            chunked = layer_time(hw, spec, Schedule("hierarchical", "bf16", C), gpus,
                                 routing=routing, sample_tokens=128)
            assert chunked["time"] <= serial["time"] * (1 + 1e-12), (hw.name, C)
            assert chunked["exposed"] <= serial["exposed"] * (1 + 1e-12)


def test_chunks_read_the_weights_again():
    """Every chunk past the first reads the rank's expert weights again: in the forward once, in
    the backward twice (read, and the gradient written), at Hardware.weight_bw (fitted to the
    H200's GEMM kernel time at 1, 4 and 8 chunks)."""
    spec, gpus, C = LayerSpec(), 8, 4
    weights = spec.experts // gpus * 3 * spec.hidden * spec.intermediate * 2  # bf16, per rank
    free = dataclasses.replace(H200, weight_bw=1e30)
    for backward, reads in ((False, 1), (True, 3)):
        got = [layer_time(hw, spec, Schedule("hierarchical", "bf16", C), gpus, routing="uniform",
                          sample_tokens=128, backward=backward)["compute"] for hw in (H200, free)]
        assert got[0] - got[1] == pytest.approx(reads * (C - 1) * weights / H200.weight_bw,
                                                rel=1e-6)
    assert weights / H200.weight_bw == pytest.approx(0.51e-3, rel=0.05)  # per read, measured
    # with them, 8 chunks on one node are slower than the serial layer (as measured on one GPU)
    serial, eight = (layer_time(H200, spec, Schedule("hierarchical", "bf16", c), gpus,
                                routing="uniform", sample_tokens=128)["time"] for c in (1, 8))
    assert eight > serial


def test_rounds_follow_the_capacity():
    sched = Schedule("flat", "bf16", 1, capacity_factor=0.5)
    r = layer_time(H200, SMALL, sched, 8, routing="uniform")
    assert r["rounds"] >= 2
    one = layer_time(H200, SMALL, Schedule("flat"), 8, routing="uniform")
    assert one["rounds"] == 1 and r["time"] > one["time"]


def test_one_gpu_reproduces_the_measured_h200_layer():
    """The model's calibration uses the GEMM sweep and dispatch/combine alone, not the layer: its
    one-GPU layer is checked against the layer measured on the same H200."""
    measured = json.loads((ROOT / "docs/bench/h200x1_layer/layer.json").read_text())
    res = {(r["impl"], r["pass_"]): r["time_us"] for r in measured[0]["results"]
           if "time_us" in r}
    layer = {p: v for (impl, p), v in res.items()
             if impl.startswith("moe_layer") and "tokamax" in impl}
    model = one_gpu()
    assert model["forward"] * 1e6 == pytest.approx(layer["forward"], rel=0.25)
    assert model["fwd_bwd"] * 1e6 == pytest.approx(layer["fwd+bwd"], rel=0.25)


def test_validation_anchors_within_25_percent_or_explained():
    rows = validate(H800)
    assert len(rows) == 10
    ok = [r for r in rows if r["within_25pct"]]
    assert len(ok) >= 8, rows
    assert all(r["note"] for r in rows if not r["within_25pct"])  # the rest are explained
    # NVLink anchors: the model's bandwidth is within the link's figure
    assert all(r["model"] < 200 for r in rows if "EP8 (NVLink)" in r["anchor"])


def test_wire_bytes():
    assert wire_row_bytes(7168, "bf16", 8) == 14336 + 64
    assert wire_row_bytes(7168, "e4m3", 8) == 7168 + 224 + 64  # 0.52x of bf16's token bytes
    assert wire_row_bytes(7168, "mxfp8", 8) == 7168 + 224 + 64
    with pytest.raises(ValueError, match=re.escape(
            "wire must be one of ('bf16', 'e4m3', 'mxfp8'), got 'fp4'")):
        wire_row_bytes(7168, "fp4", 8)


def test_impossible_configurations_raise():
    with pytest.raises(ValueError, match=re.escape(
            "gpus=12 must be a multiple of gpus_per_node=8 (whole nodes)")):
        layer_time(H200, SMALL, Schedule(), 12)
    with pytest.raises(ValueError, match=re.escape(
            "experts=64 must be divisible by ep=48 (expert-parallel ranks)")):
        layer_time(H200, SMALL, Schedule(), 96, ep=48)
    with pytest.raises(ValueError, match=re.escape("ep=5 must be a positive int dividing "
                                                   "gpus=16")):
        layer_time(H200, SMALL, Schedule(), 16, ep=5)
    with pytest.raises(ValueError, match=re.escape(
            "Schedule: plan must be one of ('flat', 'hierarchical'), got 'ring'")):
        Schedule("ring")
    with pytest.raises(ValueError, match=re.escape(
            "Schedule: num_chunks must be a positive int, got 0")):
        Schedule(num_chunks=0)
    with pytest.raises(ValueError, match=re.escape(
            "Hardware: weight_bw must be positive finite numbers, got (0.0,)")):
        dataclasses.replace(H200, weight_bw=0.0)
    with pytest.raises(ValueError, match=re.escape(
            "LayerSpec: topk=9 must be <= experts=8")):
        LayerSpec(experts=8, topk=9)
    with pytest.raises(ValueError, match=re.escape(
            "routing must be one of ('uniform', 'zipf', 'node_limited'), got 'hot'")):
        draw_routing("hot", 8, SMALL, 8)


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "scale.json", tmp_path / "scale.png"
    out = main(["--gpus", "8,16", "--sample-tokens", "64", "--json", str(js), "--png", str(png)])
    text = capsys.readouterr().out
    assert "eff %" in text and "DeepEP V1 anchor" in text
    data = json.loads(js.read_text())
    assert {r["gpus"] for r in data["scaling"]} == {8, 16}
    # against one baseline, the fastest schedule on 8 GPUs
    at8 = [r["efficiency"] for r in out["scaling"] if r["gpus"] == 8]
    assert max(at8) == 1.0 and all(e <= 1.0 for e in at8), at8
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (ep_comm[plot])")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ep_vs_dp_prices_memory_exchange_and_the_gradient_sum():
    from ep_comm.topology import parallelism

    spec = LayerSpec(tokens_per_gpu=512)
    rows = parallelism.ep_vs_dp(32, (8, 32), spec=spec, sample_tokens=64)
    params = [spec.experts // ep * 3 * spec.hidden * spec.intermediate for ep in (8, 32)]
    for r, p, ep in zip(rows, params, (8, 32)):
        assert (r["ep"], r["dp"], r["experts_per_gpu"]) == (ep, 32 // ep, spec.experts // ep)
        assert r["expert_bytes"] == 2 * p and r["adam_bytes"] == 12 * p
        assert r["fsdp_bytes"] == pytest.approx(14 * p / r["dp"])
        assert r["grad_allreduce_bytes"] == pytest.approx(2 * (r["dp"] - 1) / r["dp"] * 2 * p)
    # EP inside one node sends nothing between nodes; over 4 nodes it does, and needs no sum
    assert rows[0]["network_bytes"] == 0 and rows[1]["network_bytes"] > 0
    assert rows[1]["grad_allreduce"] == 0 and rows[0]["grad_allreduce"] > 0
    assert rows[1]["exchange"] > rows[0]["exchange"]
    assert "grad AR ms" in parallelism.table(rows)
    with pytest.raises(ValueError, match=re.escape(
            "ep_vs_dp: ep=12 must divide gpus=32 and experts=256")):
        parallelism.ep_vs_dp(32, (12,))
