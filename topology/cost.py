"""Alpha-beta cost model of the exchange, per link class, and the plan choice built on it.

A message of ``m`` bytes over link class ``c`` costs ``alpha_c + m / beta_c``. In one exchange leg
a rank's links of different classes work in parallel (NVLink, the NIC and the copy engines are
different hardware), its messages of one class share that class's bandwidth, and a rank is limited
by what it sends and by what it receives alike; the leg takes as long as its slowest rank. Legs run
one after the other (the hierarchical plan's stage 2 waits for stage 1).

Defaults (:data:`H200_DEFAULTS`) are public figures for an HGX H100/H200 node, derated to what
all-to-all traffic reaches in practice:

- ``self``: a copy in HBM3e (4.8 TB/s peak; a copy reads and writes): 1.6 TB/s, 2 us per call.
- ``nvlink``: NVLink 4 through NVSwitch, 450 GB/s per direction per GPU; DeepEP reports ~155 GB/s
  for its intranode all-to-all kernels on H800 (400 GB/s NVLink): 160 GB/s, 3 us.
- ``pcie``: PCIe Gen5 x16, 64 GB/s per direction: 40 GB/s, 5 us.
- ``network``: one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU (50 GB/s); DeepEP reports 43-47
  GB/s RDMA for internode dispatch: 45 GB/s, 8 us.

Override any class (``CostModel(network=Link(5e-6, 25e9))``) or fit it to measurements with
:meth:`CostModel.calibrate`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from ep_comm.topology.machine import LINK_CLASSES
from ep_comm.topology.traffic import Traffic


@dataclasses.dataclass(frozen=True)
class Link:
    """``alpha`` seconds per message, ``beta`` bytes per second."""

    alpha: float
    beta: float

    def __post_init__(self):
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0 or (
                    name == "beta" and v == 0):
                raise ValueError(f"Link: {name} must be a finite number "
                                 f"{'> 0' if name == 'beta' else '>= 0'}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-link-class :class:`Link` parameters, and what the chunked MoE layer's choice of
    ``num_chunks`` needs besides (:meth:`pipeline_seconds`): ``gemm_flops``, the experts' grouped
    GEMM rate in FLOP/s, ``weight_bytes_per_s``, the rate at which a grouped GEMM streams its
    expert weights (every chunk reads all of them again), and ``step_seconds``, the fixed cost
    of one pipeline step (a chunk's layout, count gather and launches). The defaults fit an H200
    with tokamax's bf16 kernels at the DeepSeek-V3 shape (docs/bench/h200x1_overlap: the up
    projection took 3.1 ms over 32768 rows and 1.03 ms over 8192, both GEMMs reading 2.8 GB of
    weights)."""

    self: Link = Link(2e-6, 1.6e12)
    nvlink: Link = Link(3e-6, 160e9)
    pcie: Link = Link(5e-6, 40e9)
    network: Link = Link(8e-6, 45e9)
    gemm_flops: float = 700e12
    weight_bytes_per_s: float = 5.5e12
    step_seconds: float = 30e-6

    def __post_init__(self):
        for c in LINK_CLASSES:
            if not isinstance(getattr(self, c), Link):
                raise TypeError(f"CostModel: {c} must be a topology.Link, got "
                                f"{type(getattr(self, c)).__name__}")
        for name, low in (("gemm_flops", 0.0), ("weight_bytes_per_s", 0.0),
                          ("step_seconds", None)):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v)
                    or (v <= 0 if low is not None else v < 0)):
                raise ValueError(f"CostModel: {name} must be a finite number "
                                 f"{'> 0' if low is not None else '>= 0'}, got {v!r}")

    def pipeline_seconds(self, chunks: int, exchange_seconds: float, flops: float,
                         rows_per_group: float, weight_bytes: float = 0.0,
                         tile_rows: int = 128) -> float:
        """Predicted seconds of the MoE layer run as a pipeline of ``chunks`` token chunks.

        ``exchange_seconds``: one chunk's dispatch + combine exchanges; ``flops``: one chunk's
        expert FLOPs; ``rows_per_group``: rows each local expert gets in one chunk (balanced);
        ``weight_bytes``: the local experts' weights, which every chunk's GEMMs read again. One
        chunk's experts take ``flops / gemm_flops + weight_bytes / weight_bytes_per_s``, with
        each group padded to whole ``tile_rows`` tiles. The first chunk's dispatch and the last
        chunk's combine run alone; every other exchange runs under the experts of a neighbouring
        chunk, so each step takes the longer of its experts and its exchanges. Every step pays
        ``step_seconds``."""
        positive = lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
                              and np.isfinite(v) and v >= 0)
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"CostModel.pipeline_seconds: chunks must be a positive int, "
                             f"got {chunks!r}")
        for name, v in (("exchange_seconds", exchange_seconds), ("flops", flops),
                        ("rows_per_group", rows_per_group), ("weight_bytes", weight_bytes)):
            if not positive(v):
                raise ValueError(f"CostModel.pipeline_seconds: {name} must be a finite number "
                                 f">= 0, got {v!r}")
        pad = (np.ceil(rows_per_group / tile_rows) * tile_rows / rows_per_group
               if rows_per_group > 0 else 1.0)
        gemm = flops * pad / self.gemm_flops + weight_bytes / self.weight_bytes_per_s
        steps = chunks * max(gemm, exchange_seconds) if chunks > 1 else gemm
        return float(exchange_seconds + steps + chunks * self.step_seconds)

    def link(self, cls: str) -> Link:
        """The :class:`Link` (latency, bandwidth) of link class ``cls`` (one of
        ``LINK_CLASSES``)."""
        if cls not in LINK_CLASSES:
            raise ValueError(f"CostModel: link class must be one of {LINK_CLASSES}, got {cls!r}")
        return getattr(self, cls)

    def predict(self, traffic: Traffic) -> dict[str, float]:
        """Predicted seconds of ``dispatch``, ``combine`` and their ``total`` for ``traffic``;
        ``legs`` maps each leg's name to its seconds."""
        if not isinstance(traffic, Traffic):
            raise TypeError(f"CostModel.predict: traffic must be a topology.Traffic, got "
                            f"{type(traffic).__name__}")
        links = traffic.link_matrix()
        out = {"dispatch": 0.0, "combine": 0.0, "legs": {}}
        for ex in traffic.exchanges:
            rows = np.asarray(ex.rows, np.float64)
            t_leg = 0.0
            for c, cls in enumerate(LINK_CLASSES):
                on = links == c
                by = np.where(on, rows * ex.row_bytes, 0.0)
                msgs = np.where(on & (rows > 0), 1.0, 0.0)
                lk = self.link(cls)
                # senders and receivers: each rank's busiest side bounds the leg
                t_send = ex.calls * lk.alpha * (msgs.sum(1) > 0) + by.sum(1) / lk.beta
                t_recv = ex.calls * lk.alpha * (msgs.sum(0) > 0) + by.sum(0) / lk.beta
                t_leg = max(t_leg, float(np.max(np.maximum(t_send, t_recv))))
            out["legs"][ex.name] = t_leg
            out[ex.phase] += t_leg
        out["total"] = out["dispatch"] + out["combine"]
        return out

    @classmethod
    def calibrate(cls, samples: Iterable[tuple[str, float, float]],
                  base: "CostModel | None" = None) -> "CostModel":
        """Fit ``alpha`` and ``beta`` per link class to measurements.

        Args:
          samples: ``(link class, bytes per rank, seconds)`` triples, e.g. from timing a plain
            exchange over that class at several sizes (``python -m ep_comm.benchmarks.exchange --rows
            1024,8192,32768 --calibrate`` fits them). A class needs two or more sizes; classes
            without samples keep ``base``'s values (default: :class:`CostModel`'s).
        """
        base = base or cls()
        by_cls: dict[str, list[tuple[float, float]]] = {}
        for i, sample in enumerate(samples):
            try:
                c, nbytes, secs = sample
                nbytes, secs = float(nbytes), float(secs)
            except (TypeError, ValueError):
                raise ValueError(f"CostModel.calibrate: sample {i} must be (link class, bytes, "
                                 f"seconds), got {sample!r}") from None
            if c not in LINK_CLASSES:
                raise ValueError(f"CostModel.calibrate: sample {i} names link class {c!r}; "
                                 f"expected one of {LINK_CLASSES}")
            if nbytes < 0 or secs <= 0:
                raise ValueError(f"CostModel.calibrate: sample {i} needs bytes >= 0 and seconds "
                                 f"> 0, got {nbytes} and {secs}")
            by_cls.setdefault(c, []).append((nbytes, secs))
        fitted = {}
        for c, pts in by_cls.items():
            x = np.array([p[0] for p in pts])
            y = np.array([p[1] for p in pts])
            if len(np.unique(x)) < 2:
                raise ValueError(f"CostModel.calibrate: link class {c!r} needs samples at two or "
                                 f"more sizes, got sizes {sorted(set(x.tolist()))}")
            slope, intercept = np.polyfit(x, y, 1)
            if slope <= 0:
                raise ValueError(f"CostModel.calibrate: the {c!r} samples do not grow with size "
                                 f"(fitted {slope:.3g} s/B); time larger messages")
            fitted[c] = Link(max(float(intercept), 0.0), float(1.0 / slope))
        return dataclasses.replace(base, **fitted)


H200_DEFAULTS = CostModel()
