"""Expert-parallel degree against data-parallel degree: what each costs one GPU of one MoE layer.

On ``gpus`` GPUs an expert-parallel group of ``ep`` ranks holds every expert once (``E / ep`` per
GPU); the ``dp = gpus / ep`` groups are data-parallel replicas of it (the experts of a rank are
the same on its ``dp`` replicas; the tokens are split over all ``gpus``). Per ``ep``, for one layer:

- **memory**: the GPU's expert weights, and with Adam in float32 (a master copy and two moments,
  12 bytes per parameter) its optimizer state; FSDP over the ``dp`` replicas divides both by
  ``dp`` (and gathers the weights for the layer);
- **the exchange**: dispatch and combine within the group, priced by the scale model
  (:func:`ep_comm.topology.scale.layer_time`: forward and backward, the hierarchical plan, uniform
  routing), with the bytes the bottleneck GPU sends between nodes;
- **the gradient sum** of the expert weights over the ``dp`` replicas, once per step: a ring
  all-reduce sends ``2 (dp - 1) / dp`` of the gradient's bytes per GPU, here over the network (the
  replicas of a GPU sit on other nodes when ``ep`` fills whole nodes).

Run ``python -m ep_comm.topology.parallelism`` (``--gpus``, ``--ep``, ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Sequence

from ep_comm.topology._checks import positive_int
from ep_comm.topology.scale import H200, Hardware, LayerSpec, Schedule, layer_time
from ep_comm.topology.scale_study import _table

ADAM_BYTES = 12  # float32 master weights and two moments per parameter


def ep_vs_dp(gpus: int = 64, eps: Sequence[int] = (8, 16, 32, 64), *, hw: Hardware = H200,
             spec: LayerSpec = LayerSpec(), schedule: Schedule = Schedule("hierarchical"),
             param_bytes: int = 2, routing: str = "uniform",
             sample_tokens: int = 256) -> list[dict]:
    """One row per expert-parallel degree ``ep`` in ``eps`` (each dividing ``gpus``): memory in
    bytes per GPU (``expert_bytes``, ``adam_bytes``, ``fsdp_bytes``: both over the ``dp``
    replicas), the layer's modelled ``time`` and ``exchange`` (seconds, forward and backward),
    ``network_bytes`` (the bottleneck GPU's, one forward exchange), ``grad_allreduce_bytes`` and
    its seconds over the network (``grad_allreduce``)."""
    positive_int("ep_vs_dp", "gpus", gpus)
    positive_int("ep_vs_dp", "param_bytes", param_bytes)
    rows = []
    for ep in eps:
        positive_int("ep_vs_dp", "ep", ep)
        if gpus % ep or spec.experts % ep:
            raise ValueError(f"ep_vs_dp: ep={ep} must divide gpus={gpus} and "
                             f"experts={spec.experts}")
        dp = gpus // ep
        params = spec.experts // ep * 3 * spec.hidden * spec.intermediate  # w_in (2I) + w_out (I)
        model = layer_time(hw, spec, schedule, gpus, routing=routing, ep=ep,
                           sample_tokens=sample_tokens)
        grad = params * param_bytes
        sent = 2 * (dp - 1) / dp * grad
        net = hw.links.network
        rows.append(dict(
            ep=ep, dp=dp, experts_per_gpu=spec.experts // ep,
            expert_bytes=params * param_bytes, adam_bytes=params * ADAM_BYTES,
            fsdp_bytes=params * (param_bytes + ADAM_BYTES) / dp,
            time=model["time"], exchange=model["exchange"],
            network_bytes=model["network_bytes"], grad_allreduce_bytes=sent,
            grad_allreduce=(sent / net.beta + 2 * (dp - 1) * net.alpha) if dp > 1 else 0.0))
    return rows


def table(rows: list[dict]) -> str:
    """The rows in GB, MB and ms."""
    shown = [dict(r, w_GB=r["expert_bytes"] / 1e9, adam_GB=r["adam_bytes"] / 1e9,
                  fsdp_GB=r["fsdp_bytes"] / 1e9, time_ms=r["time"] * 1e3,
                  exch_ms=r["exchange"] * 1e3, net_MB=r["network_bytes"] / 1e6,
                  ar_MB=r["grad_allreduce_bytes"] / 1e6, ar_ms=r["grad_allreduce"] * 1e3)
             for r in rows]
    return _table(shown, [("ep", "ep", "5"), ("dp", "dp", "4d"),
                          ("experts/GPU", "experts_per_gpu", "12d"),
                          ("weights GB", "w_GB", "11.2f"), ("+Adam GB", "adam_GB", "10.2f"),
                          ("FSDP GB", "fsdp_GB", "9.2f"), ("layer ms", "time_ms", "10.2f"),
                          ("exch ms", "exch_ms", "9.2f"), ("net MB", "net_MB", "8.1f"),
                          ("grad AR MB", "ar_MB", "11.1f"), ("grad AR ms", "ar_ms", "11.2f")])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ep_comm.topology.parallelism",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--ep", default="8,16,32,64", help="comma-separated expert-parallel degrees")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        eps = [int(e) for e in args.ep.split(",")]
    except ValueError:
        ap.error(f"--ep must be comma-separated integers, got {args.ep!r}")
    spec = LayerSpec(tokens_per_gpu=args.tokens)
    rows = ep_vs_dp(args.gpus, eps, spec=spec)
    print(f"# {args.gpus} x {H200.name}; DeepSeek-V3 MoE layer (E={spec.experts}, "
          f"top-{spec.topk}, H={spec.hidden}, I={spec.intermediate}), {spec.tokens_per_gpu} "
          f"tokens per GPU, bf16 weights, Adam float32; layer: forward+backward, hierarchical "
          f"plan, uniform routing (scale model); grad AR: the experts' gradient summed over dp, "
          f"once per step")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(hardware=H200.name, gpus=args.gpus, spec=dataclasses.asdict(spec),
                           rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
