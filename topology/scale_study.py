"""The scale model's studies, and its command line (``python -m ep_comm.topology.scale_study``).

:func:`weak_scaling` (one row per schedule and GPU count, 8 to 1,024 GPUs), :func:`validate`
(the model on the published anchors' hardware against their figures), :func:`one_gpu` (the model
at the one GPU this project measures), :func:`reach` (which schedules and NIC counts reach a
weak-scaling target) and their tables and plot. The model itself: :mod:`ep_comm.topology.scale`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Sequence

from ep_comm.topology.cost import CostModel, Link
from ep_comm.topology.scale import (H200, H800, ROUTINGS, Hardware, LayerSpec, Schedule,
                                    _cached_draw, layer_time, traffic)
from ep_comm.topology.traffic import Traffic

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
SCHEDULES = (
    Schedule("flat", "bf16", 1),
    Schedule("hierarchical", "bf16", 1),
    Schedule("hierarchical", "bf16", 4),
    Schedule("hierarchical", "e4m3", 4),
)


def weak_scaling(hw: Hardware = H200, spec: LayerSpec = LayerSpec(),
                 schedules: Sequence[Schedule] = SCHEDULES, gpus: Sequence[int] = GPU_COUNTS,
                 routing: str = "node_limited", seed: int = 0, sample_tokens: int = 256) -> list:
    """One row per (schedule, GPU count): the layer's forward+backward time and its weak-scaling
    efficiency against the fastest of the schedules at the first GPU count (tokens per GPU
    fixed; one baseline for all, so that a schedule that is slow on few GPUs -- chunks re-read
    the weights -- does not look efficient for it)."""
    times = {(sched, g): layer_time(hw, spec, sched, g, routing=routing, seed=seed,
                                    sample_tokens=sample_tokens)
             for sched in schedules for g in gpus}
    base = min(times[(sched, gpus[0])]["time"] for sched in schedules)
    return [dict(schedule=sched.label, routing=routing, **times[(sched, g)],
                 efficiency=base / times[(sched, g)]["time"])
            for sched in schedules for g in gpus]


# Published anchors on their hardware (DeepEP V1 on H800 + one CX7 400G NIC per GPU, hidden 7168,
# top-8 of 256, FP8 dispatch (e4m3 + one float32 scale per 128) / BF16 combine;
# github.com/deepseek-ai/DeepEP, docs/legacy.md "Performance", and tests/test_internode.py for
# how the bandwidth is counted). Normal kernels, 4096 tokens per rank, top-4 groups (nodes):
# "bottleneck bandwidth" = logical bytes / kernel time, the logical bytes counting the local rank
# (intranode: every token row a rank receives; internode: every (token, node) pair a rank sends,
# its own node included). Low-latency kernels, 128 tokens: latency.
_EP16 = ("DeepEP's EP16 figure sits below its own EP32/EP64 ones on the same NIC (43 against 58 "
         "and 51 GB/s); the model prices the NIC alike at every size: 27% above it, 9-16% above "
         "the others")
ANCHORS = (
    dict(name="normal dispatch EP8 (NVLink)", ep=8, phase="dispatch", gbps=153.0),
    dict(name="normal combine EP8 (NVLink)", ep=8, phase="combine", gbps=158.0),
    dict(name="normal dispatch EP16 (RDMA)", ep=16, phase="dispatch", gbps=43.0, note=_EP16),
    dict(name="normal combine EP16 (RDMA)", ep=16, phase="combine", gbps=43.0, note=_EP16),
    dict(name="normal dispatch EP32 (RDMA)", ep=32, phase="dispatch", gbps=58.0),
    dict(name="normal combine EP32 (RDMA)", ep=32, phase="combine", gbps=57.0),
    dict(name="normal dispatch EP64 (RDMA)", ep=64, phase="dispatch", gbps=51.0),
    dict(name="normal combine EP64 (RDMA)", ep=64, phase="combine", gbps=50.0),
    dict(name="low-latency dispatch EP8, 128 tokens", ep=8, phase="dispatch", us=77.0),
    dict(name="low-latency combine EP8, 128 tokens", ep=8, phase="combine", us=114.0),
)


def _phase_legs(links: CostModel, tr: Traffic, phase: str) -> list[float]:
    return [links.predict(Traffic(tr.plan, tr.topology, (ex,)))["total"]
            for ex in tr.exchanges if ex.phase == phase]


def validate(hw: Hardware = H800, seed: int = 0, sample_tokens: int = 1024) -> list:
    """The model against each anchor (:data:`ANCHORS`) on the anchor's hardware, with the
    anchor's byte counting. Two schedules of the legs: ``serial`` (ep_comm today: the
    hierarchical plan's network stage, then the NVLink forward) and ``pipelined`` (DeepEP's
    normal kernels forward chunks over NVLink while the network delivers the next: the slower
    leg bounds the phase). The low-latency kernels send one row per (token, expert), not per
    (token, rank), each straight to its rank (NVLink inside a node): the model prices those
    rows on the flat plan."""
    out = []
    G = hw.gpus_per_node
    for a in ANCHORS:
        ll = "us" in a
        ep, phase = a["ep"], a["phase"]
        spec = LayerSpec(tokens_per_gpu=128 if ll else 4096)
        routing = "uniform" if ep <= G else "node_limited"
        counts = _cached_draw(routing, ep, spec, G, min(sample_tokens, spec.tokens_per_gpu),
                              seed)
        wire = "e4m3" if phase == "dispatch" else "bf16"
        row = (spec.hidden * (1 + 4 / 128)) if wire == "e4m3" else 2 * spec.hidden
        if ll:
            per_expert = dict(counts, tok=counts["pairs"])
            tr = traffic(per_expert, ep, G, spec, Schedule("flat", wire))
            serial = pipelined = sum(_phase_legs(hw.links, tr, phase))
            model, anchor, unit = serial * 1e6, a["us"], "us"
            serial_v = model
        else:
            tr = traffic(counts, ep, G, spec, Schedule("hierarchical", wire))
            legs = _phase_legs(hw.links, tr, phase)
            serial, pipelined = sum(legs), max(legs)
            if ep <= G:  # every token row the rank receives, its own included
                logical = counts["tok"].sum(0).max() * row
            else:  # every (token, node) pair the rank sends, its own node included
                logical = counts["node_tok"].sum(1).max() * row
            model, serial_v = logical / pipelined / 1e9, logical / serial / 1e9
            anchor, unit = a["gbps"], "GB/s"
        out.append(dict(anchor=a["name"], unit=unit, published=anchor, model=model,
                        model_serial=serial_v, ratio=model / anchor,
                        within_25pct=bool(abs(model / anchor - 1) <= 0.25),
                        note=a.get("note", "")))
    return out


def one_gpu(hw: Hardware = H200, spec: LayerSpec = LayerSpec(experts=32)) -> dict:
    """The one-GPU layer (every exchange a self copy) as the model prices it: forward and
    forward+backward seconds, for the check against the measured layer."""
    sched = Schedule("flat", "bf16", 1)
    f = layer_time(hw, spec, sched, 1, backward=False, sample_tokens=spec.tokens_per_gpu)
    fb = layer_time(hw, spec, sched, 1, backward=True, sample_tokens=spec.tokens_per_gpu)
    return dict(forward=f["time"], fwd_bwd=fb["time"])


def reach(target: float = 0.97, gpus: int = 1024, hw: Hardware = H200,
          spec: LayerSpec = LayerSpec(), routing: str = "node_limited",
          chunks: Sequence[int] = (1, 4, 16), wires: Sequence[str] = ("bf16", "e4m3"),
          nics: Sequence[int] = (1, 2, 4), sample_tokens: int = 256) -> list:
    """Which schedules (plan hierarchical; ``chunks`` x ``wires``) on which network (``nics``
    400G NICs per GPU) reach ``target`` weak-scaling efficiency at ``gpus`` against the fastest
    of them on 8 GPUs (one node: the network does not matter there), and the exposed exchange
    that keeps the others below it."""
    scheds = [Schedule("hierarchical", wire, C) for C in chunks for wire in wires]
    t8 = min(layer_time(hw, spec, sched, 8, routing=routing, sample_tokens=sample_tokens)["time"]
             for sched in scheds)
    rows = []
    for k in nics:
        net = hw.links.network
        hw_k = dataclasses.replace(hw, links=dataclasses.replace(
            hw.links, network=Link(net.alpha, net.beta * k)))
        for sched in scheds:
            tn = layer_time(hw_k, spec, sched, gpus, routing=routing,
                            sample_tokens=sample_tokens)
            eff = t8 / tn["time"]
            rows.append(dict(nics=k, schedule=sched.label, gpus=gpus, time=tn["time"],
                             exposed=tn["exposed"], efficiency=eff, reaches=bool(eff >= target)))
    return rows


def _table(rows: list, cols: Sequence[tuple[str, str, str]]) -> str:
    """Columns ``(header, key, format)``; the first left-aligned, the rest right-aligned."""
    width = lambda fmt: int(re.match(r"\d+", fmt).group())
    lines = ["".join(f"{h:<{width(f)}}" if i == 0 else f"{h:>{width(f)}}"
                     for i, (h, _, f) in enumerate(cols))]
    for r in rows:
        lines.append("".join(f"{str(r[k]):<{width(f)}}" if i == 0 else
                             (f"{r[k]:{f}}" if not isinstance(r[k], (bool, str))
                              else f"{str(r[k]):>{width(f)}}")
                             for i, (_, k, f) in enumerate(cols)))
    return "\n".join(lines)


def _display_units(rows: list) -> None:
    """Add ms / % / MB copies of the seconds, efficiency and bytes fields the rows have."""
    for r in rows:
        for key, new, scale in (("time", "time_ms", 1e3), ("exposed", "exposed_ms", 1e3),
                                ("compute", "compute_ms", 1e3), ("efficiency", "eff_pct", 100),
                                ("network_bytes", "net_MB", 1e-6)):
            if key in r:
                r[new] = scale * r[key]


def plot(rows: list, path: str) -> bool:
    """Efficiency against GPUs per schedule as a PNG; False (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed: {path} not written "
              f"(pip install 'ep_comm[plot]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["schedule"] for r in rows):
        rs = [r for r in rows if r["schedule"] == label]
        ax.plot([r["gpus"] for r in rs], [100 * r["efficiency"] for r in rs], marker="o",
                label=label)
    ax.axhline(97, color="grey", linestyle="--", linewidth=1, label="97% (the seed's claim)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (tokens per GPU fixed)")
    ax.set_ylabel("weak-scaling efficiency vs the fastest on 8 GPUs (%)")
    ax.set_title("DeepSeek-V3 MoE layer, forward+backward (model)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ep_comm.topology.scale_study", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--gpus", default=",".join(map(str, GPU_COUNTS)),
                    help="comma-separated GPU counts (whole nodes of 8)")
    ap.add_argument("--routing", default="node_limited", choices=ROUTINGS)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    ap.add_argument("--sample-tokens", type=int, default=256,
                    help="tokens drawn per rank for the routing (counts are scaled up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    try:
        gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        ap.error(f"--gpus must be comma-separated integers, got {args.gpus!r}")
    spec = LayerSpec(tokens_per_gpu=args.tokens)
    rows = weak_scaling(H200, spec, SCHEDULES, gpus, args.routing, args.seed, args.sample_tokens)
    val = validate(H800, args.seed)
    one = one_gpu()
    print(f"# scale model: {H200.name}; DeepSeek-V3 layer (E={spec.experts}, top-{spec.topk}, "
          f"H={spec.hidden}, I={spec.intermediate}), {spec.tokens_per_gpu} tokens per GPU, "
          f"{args.routing} routing; forward+backward; ep = min(GPUs, experts); eff % against "
          f"the fastest schedule on {gpus[0]} GPUs")
    _display_units(rows)
    print(_table(rows, [("schedule", "schedule", "32"), ("GPUs", "gpus", "6d"),
                        ("ep", "ep", "5d"), ("time(ms)", "time_ms", "10.2f"),
                        ("compute", "compute_ms", "9.2f"), ("exposed", "exposed_ms", "9.2f"),
                        ("net MB", "net_MB", "9.1f"), ("eff %", "eff_pct", "8.1f")]))
    print("\n# validation against published figures (model on the anchor's hardware: "
          f"{H800.name})")
    print(_table(val, [("DeepEP V1 anchor", "anchor", "40"), ("unit", "unit", "6"),
                       ("published", "published", "10.1f"), ("model", "model", "9.1f"),
                       ("ratio", "ratio", "7.2f"), ("±25%", "within_25pct", "6"),
                       ("legs serial", "model_serial", "12.1f")]))
    for r in val:
        if not r["within_25pct"]:
            print(f"#   {r['anchor']}: {r['note']}")
    print(f"\n# one GPU (32 experts, self exchanges), model: forward {1e3 * one['forward']:.2f} ms, "
          f"forward+backward {1e3 * one['fwd_bwd']:.2f} ms")
    gmax = max(gpus)
    grid = reach(0.97, gmax, H200, spec, args.routing, sample_tokens=args.sample_tokens)
    print(f"\n# which schedules reach 97% weak-scaling efficiency at {gmax} GPUs "
          f"(hierarchical plan; network: 400G NICs per GPU, {H200.links.network.beta / 1e9:g} "
          f"GB/s each; eff % against the fastest of them on 8 GPUs)")
    _display_units(grid)
    print(_table(grid, [("NICs", "nics", "6d"), ("schedule", "schedule", "30"),
                        ("time(ms)", "time_ms", "10.2f"), ("exposed", "exposed_ms", "9.2f"),
                        ("eff %", "eff_pct", "8.1f"), ("97%?", "reaches", "6")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(hardware=H200.name, spec=dataclasses.asdict(spec), scaling=rows,
                           validation=val, one_gpu=one, reach_97=grid), f, indent=1)
    if args.png:
        plot(rows, args.png)
    return dict(scaling=rows, validation=val, one_gpu=one, reach_97=grid)


if __name__ == "__main__":
    main()
