"""The example model trains through ep_comm and the benchmark's numbers are self-consistent."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

from ep_comm import topology
from ep_comm.benchmarks import dispatch as dispatch_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import moe_transformer  # noqa: E402


def _trainer(n, mesh=None):
    cfg = moe_transformer.ModelConfig(layers=1, num_experts=2 * n, dim=32, ffn=64, seq=8)
    trainer = moe_transformer.Trainer(cfg, batch=2 * n, seed=1, mesh=mesh)
    err, scale = trainer.check_against_dense(trainer.sample())
    assert err <= 1e-5 * max(1.0, scale), (err, scale)
    return trainer


def test_example_matches_dense_at_step_0_and_learns(n):
    # (fixed seed: the loss halves by about step 10 and is below a fifth of step 0's by step 20)
    losses = _trainer(n).train(25, log=None)
    assert losses[-1] < 0.5 * losses[0], losses[::5]


def test_example_trains_data_x_expert_parallel(n):
    """``--mesh data=2,ep=n/2``: the batch over both axes, each expert on 2 devices; the model
    equals the dense one at step 0 and learns."""
    if n < 4 or n % 2:
        pytest.skip(f"a data x expert mesh needs an even device count of at least 4, got {n}")
    trainer = _trainer(n, mesh=f"data=2,ep={n // 2}")
    assert dict(trainer.mesh.shape) == {"data": 2, "ep": n // 2}
    assert trainer.ep.num_ranks == n // 2 and trainer.ep.tokens_per_rank == 2 * 8
    losses = trainer.train(15, log=None)
    assert losses[-1] < 0.8 * losses[0], losses[::5]


def test_example_rejects_a_bad_mesh(n):
    with pytest.raises(ValueError, match="--mesh must be data=D,ep=E \\(positive sizes\\), "
                                         "got 'data=2,tp=4'"):
        moe_transformer.parse_mesh("data=2,tp=4", n)
    with pytest.raises(ValueError, match=f"--mesh 'data={n + 1}': data x ep = 0 must equal the "
                                         f"{n} devices"):
        moe_transformer.parse_mesh(f"data={n + 1}", n)


@pytest.mark.multiprocess
@pytest.mark.layer
@pytest.mark.full  # the fast command: the layer across processes in test_pipeline/rounds/layer
def test_example_trains_across_processes(n):
    """Under mpirun: the expert-parallel model equals the dense one at step 0 and its loss falls
    (fixed seed; learning to convergence is the single-process test's, above)."""
    if jax.process_count() == 1:
        pytest.skip("single process: test_example_matches_dense_at_step_0_and_learns trains it")
    losses = _trainer(n).train(10, log=None)
    assert losses[-1] < 0.8 * losses[0], losses


def test_example_rejects_indivisible_batch(n):
    if n == 1:
        pytest.skip("every batch divides one device")
    with pytest.raises(ValueError, match=f"batch={n + 1} must be divisible by the {n} devices"):
        moe_transformer.Trainer(moe_transformer.ModelConfig(num_experts=2 * n), batch=n + 1)


@pytest.mark.multiprocess
def test_bench_reports_zero_drops_for_ep_comm_and_drops_for_capacity(n):
    bc = dispatch_bench.BenchConfig(tokens_per_rank=16, hidden=32, topk=4, num_experts=8 * n,
                           dtype="float32", routing="skewed")
    report = dispatch_bench.run(bc, warmup=1, iters=2)
    rows = {(r["impl"], r["phase"]): r for r in report["results"]}
    for phase in ("dispatch", "combine"):
        r = rows[("ep_comm/portable", phase)]
        assert r["wrong"] == 0 and r["dropped"] == 0
        assert r["time_us"] > 0 and r["pad"] >= 1.0
    if n > 1:  # the same exchange in plain JAX: ep_comm's rows, group by group, and its sums
        for phase in ("dispatch", "combine"):
            assert rows[("plain JAX EP", phase)]["wrong"] == 0
        assert "x plain JAX EP's dispatch (the same exchange in plain JAX)" in dispatch_bench.table(report)
        for phase in ("dispatch", "combine"):  # also timed in turn with plain JAX EP's
            assert rows[("ep_comm/portable", phase)]["vs_plain_ep_interleaved"] > 0
        assert "x timed in turn)" in dispatch_bench.table(report)
    cap = rows[("capacity cf=1.0", "round trip")]
    assert cap["dropped"] > 0 and cap["wrong"] > 0  # skewed routing overflows a fixed capacity
    ceiling = rows[("lax.all_to_all", "T rows")]
    assert ceiling["payload"] == 16 * 32 * 4 and ceiling["time_us"] > 0
    text = dispatch_bench.table(report)
    assert "ep_comm/portable" in text and "capacity cf=1.25" in text
    assert report["hardware"].startswith(f"{jax.device_count()} x ")


def test_bench_compares_flat_and_hierarchical(n):
    if n < 2 or n % 2:
        pytest.skip("needs an even device count")
    bc = dispatch_bench.BenchConfig(tokens_per_rank=16, hidden=32, topk=4, num_experts=8 * n,
                           dtype="float32", routing="uniform")
    report = dispatch_bench.run(bc, warmup=1, iters=2, capacity_factors=(), backends=["portable"],
                       topo=topology.simulated(2, n // 2), plans=("flat", "hierarchical"))
    rows = {(r["plan"], r["phase"]): r for r in report["results"] if r["impl"] != "lax.all_to_all"}
    for phase in ("dispatch", "combine"):
        flat, hier = rows[("flat", phase)], rows[("hierarchical", phase)]
        assert flat["wrong"] == hier["wrong"] == 0
        assert 0 < hier["network_bytes_total"] <= flat["network_bytes_total"]
        assert hier["predicted_us"] > 0 and flat["predicted_us"] > 0
    assert report["topology"] == f"2x{n // 2} (simulated)"
    assert "portable dispatch: hierarchical/flat time" in dispatch_bench.table(report)


def test_example_deepseek_preset_runs_shrunk(n, capsys):
    """The GPU preset's code path (bf16 experts, step timing), at toy sizes."""
    losses = moe_transformer.main(["--preset", "deepseek", "--dim", "32", "--heads", "2",
                                   "--ffn", "16", "--seq", "8", "--num-experts", str(2 * n),
                                   "--batch", str(n), "--steps", "3"])
    assert len(losses) == 3 and all(abs(v) < float("inf") for v in losses)
    out = capsys.readouterr().out
    assert "experts in bfloat16" in out and "step time: median" in out


def test_layer_bench_reports_every_pass_and_the_layer(n, tmp_path, capsys):
    from ep_comm.benchmarks import layer as layer_bench

    with pytest.raises(SystemExit):
        layer_bench.main(["--parts", "layer,gemms"])
    assert "--parts: each must be one of ['gemm', 'layer', 'overlap', 'rounds'], got ['gemms']" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layer_bench.main(["--cutlass-configs", "forward=0,drhs=7"])
    assert "--cutlass-configs: each item must be pass=config with pass one of ('forward', " \
        "'dlhs', 'drhs') and config one of (0, 1, 2, 3, 4), got 'drhs=7'" \
        in capsys.readouterr().err
    path = tmp_path / "layer.json"  # the parts run in the order named, the JSON kept as they end
    # the GEMM rows on the layer's routing: ragged groups, each pass against its reference
    reports = layer_bench.main(["--tokens", "16", "--hidden", "16", "--intermediate", "8",
                                "--topk", "2", "--iters", "1", "--warmup", "1", "--groups",
                                "routed", "--parts", "layer,gemm", "--json", str(path)])
    layer, gemm = reports
    assert [r["kind"] for r in json.loads(path.read_text())] == ["layer", "gemm"]
    sizes = gemm["config"]["sizes"]
    assert sum(sizes) == gemm["config"]["rows"] and len(set(sizes)) > 1
    assert sizes == layer_bench.routed_sizes(n, 16, 4 * n, 2).tolist()
    passes = {(r["gemm"], r["pass_"], r["impl"]) for r in gemm["results"]}
    for g in ("up", "down"):
        for p in ("forward", "dlhs", "drhs"):
            assert (g, p, "dense einsum") in passes and (g, p, "lax.ragged_dot") in passes
    assert all(r["wrong"] == 0 for r in gemm["results"] if "wrong" in r)
    rows = {(r["impl"].split(" (")[0], r["pass_"]): r for r in layer["results"]}
    fwd = rows[("moe_layer grouped_matmul=auto", "forward")]
    assert fwd["wrong"] == 0 and fwd["time_us"] > 0 and fwd["x_dense"] > 0
    assert rows[("moe_layer grouped_matmul=auto", "fwd+bwd")]["time_us"] > 0
    if n == 1:  # the plain JAX layer on the same GEMM (one rank holds every expert)
        for p in ("forward", "fwd+bwd"):
            plain, mine = rows[("plain JAX layer", p)], rows[("moe_layer grouped_matmul=auto", p)]
            assert mine["x_plain"] == mine["time_us"] / plain["time_us"]
            assert f"{mine['x_plain']:.2f}x the plain JAX layer" in layer_bench.table(layer)
    assert "moe_layer" in layer_bench.table(layer) and "x dense" in layer_bench.table(gemm)
    assert layer["config"]["invalid_ids"] == "ignore"  # (the drawn ids are in range)


def test_torch_peer_draws_the_layer_bench_inputs_and_reads_its_report(capsys):
    """The PyTorch layer's inputs are the layer bench's (same seed and order: same routing), and
    its ratios read the layer bench's dense and moe_layer rows; with torch installed (the GPU
    image), its layer on the CPU path equals the float64 reference."""
    from ep_comm.benchmarks import layer as layer_bench, torch_layer

    T, H, I, E, K = 32, 16, 8, 8, 2
    ids, w, x, w_in, w_out = torch_layer.inputs(T, H, I, E, K)
    assert ids.shape == (T, K) and x.shape == (T, H) and w_in.shape == (E, H, 2 * I)
    assert np.bincount(ids.reshape(-1), minlength=E).tolist() == \
        layer_bench.routed_sizes(1, T, E, K).tolist()
    rep = {"kind": "layer", "results": [
        dict(impl="dense einsum (ceiling)", pass_="forward", time_us=10.0),
        dict(impl="dispatch alone", pass_="forward", time_us=1.0),
        dict(impl="moe_layer grouped_matmul=cutlass", pass_="forward", time_us=12.0),
        dict(impl="moe_layer grouped_matmul=tokamax", pass_="forward", time_us=15.0),
        dict(impl="moe_layer grouped_matmul=xla", pass_="fwd+bwd", skipped="too large")]}
    assert torch_layer._jax_times(rep) == (
        {"forward": 10.0}, {"forward": ("moe_layer grouped_matmul=cutlass", 12.0)})
    with pytest.raises(SystemExit):
        torch_layer.main(["--tokens", "10", "--topk", "3", "--experts", "4"])
    assert ("--tokens x --topk (30) must be divisible by --experts (4): the dense ceiling's "
            "equal groups") in capsys.readouterr().err
    pytest.importorskip("torch", reason="the PyTorch peer's layer needs torch (the GPU image)")
    out = torch_layer.report(T, H, I, E, K, dtype="float32", device="cpu", warmup=0, iters=1,
                             jax_report=rep)
    rows = {(r["impl"].split(" (")[0], r["pass_"]): r for r in out["results"]}
    assert rows[("torch layer", "forward")]["wrong"] == 0
    assert rows[("torch layer", "forward")]["x_dense"] > 0
    assert rows[("torch layer", "fwd+bwd")]["time_us"] > 0
    assert "torch layer" in torch_layer.table(out)


def test_emit_saves_a_report_in_progress_and_replaces_it_when_done(tmp_path, capsys):
    from ep_comm.benchmarks.timing import emit

    path = tmp_path / "r.json"
    first, so_far, whole = dict(kind="a"), dict(kind="b", rows=[1], partial=True), \
        dict(kind="b", rows=[1, 2])

    def reports():  # a second report measured row by row, then a time limit cuts the run
        yield first
        yield so_far
        assert json.loads(path.read_text()) == [first, so_far]  # kept, not printed
        yield whole
        raise TimeoutError("cut")

    with pytest.raises(TimeoutError, match="cut"):
        emit(reports(), lambda r: f"table {r['kind']}", str(path))
    assert json.loads(path.read_text()) == [first, whole]
    assert capsys.readouterr().out.split() == ["table", "a", "table", "b"]


def test_layer_bench_rounds_bound_the_buffer_and_drop_nothing(n):
    from ep_comm.benchmarks import layer as layer_bench

    (rep,) = layer_bench.main(["--parts", "rounds", "--tokens", "8", "--hidden", "8",
                               "--intermediate", "4", "--topk", "2", "--experts", str(4 * n),
                               "--iters", "1", "--warmup", "0", "--rounds-factor", "1"])
    by = {}
    for r in rep["results"]:
        by.setdefault(r["routing"], []).append(r)
    for routing, (one, bounded) in by.items():
        assert one["rounds"] == 1 and bounded["dropped"] == 0, routing
        assert bounded["capacity"] == 8 * 2 and bounded["wrong_vs_one_round"] == 0, routing
        assert bounded["rounds"] == max(1, -(-bounded["max_load"] // bounded["capacity"]))
    hot = by["one hot expert"][1]  # every token of every rank needs expert 0
    assert hot["max_load"] >= 8 * n and hot["rounds"] >= -(-8 * n // hot["capacity"])
    assert "rounds" in layer_bench.table(rep)
