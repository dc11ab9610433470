"""The performance page's plots, from the benchmark JSON committed under docs/bench/.

    python3 tools/docs_plots.py [OUT_DIR]      # default docs/plots (matplotlib needed)

- ``dispatch_combine.png``: dispatch and combine wall time per call at T=128 and T=4096 tokens
  per rank against a device copy of the same bytes timed in the same run (one H200,
  ``docs/bench/h200x1_fused/run8_bench_T128.json``, ``run9_bench_T4096.json``);
- ``layer_vs_dense.png``: ``moe_layer`` forward and forward+backward against dense einsums of
  the same FLOPs in the same run (``docs/bench/h200x1_layer/layer.json``);
- ``overlap_chunks.png``: the layer forward over the experts alone, by chunk count and kind,
  and the share of the exchange kernels' time that ran under an expert GEMM
  (``docs/bench/h200x1_overlap/fourth_26d2ccf_overlap_shared2048_blocks4.json``);
- ``tpu_layer.png``: on one TPU v5e chip, ``moe_layer`` and the plain JAX layer (argsort + gather,
  the same ``lax.ragged_dot``) against dense einsums, forward and forward+backward, at H=2048 and
  at a DeepSeek-V3-like H=7168 (``docs/bench/tpu_v5e/layer_ragged_dot.json``,
  ``layer_H7168_ragged_dot.json``).

- ``tpu_megablox.png``: on one TPU v5e chip, the layers on megablox against MaxText's (the plain
  layer at MaxText's default tiling), forward and forward+backward, at both shapes
  (``docs/bench/tpu_v5e/megablox/layer_H2048.json``, ``layer_H7168.json``).
- ``cutlass_passes.png``: each pass of the experts' grouped GEMMs, ep_comm's CUTLASS kernel with
  its default tile config and tokamax, against the dense einsum of the same FLOPs in the same run
  (``docs/bench/h200x1_cutlass/run3_layer_cutlass_deepseek.json``).

The scale model's curve is ``docs/bench/scale_model/efficiency.png`` (``python -m ep_comm.topology.scale
--png``).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BENCH = os.path.join(ROOT, "docs", "bench")


def _report(*path):
    with open(os.path.join(BENCH, *path)) as f:
        d = json.load(f)
    return d[0] if isinstance(d, list) else d


def _bars(ax, groups, series, note):
    """Bars of each series (label -> values, one per group) side by side per group; ``note(label,
    j, value)`` is the text over bar ``j`` of a series."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, values, width, label=label)
        for j, (x, v) in enumerate(zip(xs, values)):
            ax.annotate(note(label, j, v), (x, v), ha="center", va="bottom", fontsize=7)


def dispatch_combine(ax):
    sizes = [("T=128", "run8_bench_T128.json"), ("T=4096", "run9_bench_T4096.json")]
    bars = {"dispatch": [], "combine": [], "copy of the bytes": []}
    for _, name in sizes:
        rows = {r["phase"]: r for r in _report("h200x1_fused", name)["results"]
                if r.get("impl") == "ep_comm/nccl"}
        bars["dispatch"].append(rows["dispatch"]["time_us"])
        bars["combine"].append(rows["combine"]["time_us"])
        bars["copy of the bytes"].append(rows["dispatch"]["copy_us"])
    _bars(ax, sizes, bars, lambda label, j, v: f"{v:.0f}")
    ax.set_xticks(range(len(sizes)), [s for s, _ in sizes])
    ax.set_ylabel("wall time per call (us)")
    ax.set_title("dispatch / combine, one H200 (H=7168, top-8 of 256, bf16)", fontsize=9)
    ax.legend(fontsize=8)


def layer_vs_dense(ax):
    rows = _report("h200x1_layer", "layer.json")["results"]
    by = {(r["impl"], r["pass_"]): r["time_us"] / 1e3 for r in rows}
    passes = ["forward", "fwd+bwd"]
    dense = [by[("dense einsum (ceiling)", p)] for p in passes]
    layer = [by[("moe_layer grouped_matmul=auto (tokamax)", p)] for p in passes]
    _bars(ax, passes, {"dense einsums, same FLOPs": dense, "moe_layer (tokamax GEMMs)": layer},
          lambda label, j, v: f"{v:.1f} ms ({v / dense[j]:.2f}x)")
    ax.set_xticks(range(len(passes)), passes)
    ax.set_ylabel("time (ms)")
    ax.set_title("MoE layer vs dense, one H200 (DeepSeek-V3 EP8 rank)", fontsize=9)
    ax.legend(fontsize=8)


def overlap_chunks(ax):
    rows = [r for r in _report("h200x1_overlap", "fourth_26d2ccf_overlap_shared2048_blocks4.json")[
        "results"] if "num_chunks" in r]
    labels = [r["chunks"] for r in rows]
    ax.bar(range(len(rows)), [r["x_experts"] for r in rows], 0.6,
           label="layer forward / experts alone")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("x the experts alone")
    ax.set_xlabel("chunks (of tokens unless named)")
    twin = ax.twinx()
    twin.plot(range(len(rows)), [100 * r["overlapped_fraction"] for r in rows], "o-",
              color="tab:red", label="exchange under a GEMM (%)")
    twin.set_ylim(0, 100)
    twin.set_ylabel("exchange kernels under a GEMM (%)")
    ax.set_title("overlap by chunk count, one H200 (4-block self copy for a link)", fontsize=9)
    lines = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8, loc="upper left")


def tpu_layer(ax):
    shapes = [("H=2048, I=1024", "layer_ragged_dot.json"),
              ("H=7168, I=2048", "layer_H7168_ragged_dot.json")]
    kinds = [("plain JAX layer (xla)", "plain JAX layer"),
             ("moe_layer grouped_matmul=xla", "moe_layer")]
    labels, series = [], {label: [] for _, label in kinds}
    for shape, name in shapes:
        by = {(r["impl"], r["pass_"]): r["time_us"] for r in _report("tpu_v5e", name)["results"]
              if "time_us" in r}
        for p in ("forward", "fwd+bwd"):
            labels.append(f"{shape}\n{p}")
            for impl, label in kinds:
                series[label].append(by[(impl, p)] / by[("dense einsum (ceiling)", p)])
    _bars(ax, labels, series, lambda label, j, v: f"{v:.2f}x")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("x dense einsums (same FLOPs)")
    ax.set_title("MoE layer on one TPU v5e (T=4096, top-8 of 32, bf16, lax.ragged_dot)",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


def tpu_megablox(ax):
    shapes = [("H=2048, I=1024", "layer_H2048.json"), ("H=7168, I=2048", "layer_H7168.json")]
    kinds = [("dense einsums (same FLOPs)", "dense einsums (same FLOPs)"),
             ("plain layer, megablox tuned", "plain layer, megablox tuned"),
             ("moe_layer, megablox tuned, ids checked", "moe_layer, ids checked"),
             ("moe_layer, megablox tuned", "moe_layer (invalid_ids='ignore')")]
    labels, series = [], {label: [] for _, label in kinds}
    for shape, name in shapes:
        by = {r["impl"]: r for r in _report("tpu_v5e", "megablox", name)["layer"]}
        for key, p in (("fwd_x_maxtext", "forward"), ("fwd_bwd_x_maxtext", "fwd+bwd")):
            labels.append(f"{shape}\n{p}")
            for impl, label in kinds:
                series[label].append(by[impl][key])
    _bars(ax, labels, series, lambda label, j, v: f"{v:.2f}")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(0.9, color="grey", linewidth=1, linestyle="--")
    ax.set_ylim(0, 1.45)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("x MaxText's layer (megablox 512x1024x1024)")
    ax.set_title("MoE layer on megablox, one TPU v5e (T=4096, top-8 of 32, bf16)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def cutlass_passes(ax):
    from ep_comm.collectives.grouped_gemm import DEFAULT_CONFIGS
    rep = _report("h200x1_cutlass", "run3_layer_cutlass_deepseek.json")
    by = {(r["gemm"], r["pass_"], r["impl"]): r["x_dense"] for r in rep["results"]
          if "x_dense" in r}
    labels = [(g, p) for g in ("up", "down") for p in ("forward", "dlhs", "drhs")]
    series = {
        "ep_comm CUTLASS (default tile config)": [
            by[(g, p, f"ep_comm cutlass config {DEFAULT_CONFIGS[p]}")] for g, p in labels],
        "tokamax (ep_comm's config)": [by[(g, p, "tokamax ep_comm default")] for g, p in labels],
    }
    _bars(ax, labels, series, lambda label, j, v: f"{v:.2f}x")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_ylim(0, 1.3 * max(max(v) for v in series.values()))  # (room for the legend)
    ax.set_xticks(range(len(labels)), [f"{g}\n{p}" for g, p in labels], fontsize=8)
    ax.set_ylabel("x dense einsum (same FLOPs, same run)")
    ax.set_title("grouped GEMM passes, one H200 (DeepSeek-V3 EP8 rank, bf16)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")

PLOTS = {"dispatch_combine.png": dispatch_combine, "layer_vs_dense.png": layer_vs_dense,
         "overlap_chunks.png": overlap_chunks, "tpu_layer.png": tpu_layer,
         "cutlass_passes.png": cutlass_passes, "tpu_megablox.png": tpu_megablox}


def main(out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        draw(ax)
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "plots")):
        print(p)
