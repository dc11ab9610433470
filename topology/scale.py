"""Scale model: one MoE layer's forward and backward per GPU, 8 to 1,024 GPUs, event by event.

Only one GPU is lent to this project, so what ep_comm's schedule does at scale is said by a model
calibrated on what one H200 measured and on public link figures, and checked against published
results (:mod:`ep_comm.topology.scale_study`, ``python -m ep_comm.topology.scale_study``).

What one layer is here (per GPU of an expert-parallel group of ``ep`` ranks, ``T`` tokens each,
top-``K`` of ``E`` experts, SwiGLU width ``I``, hidden ``H``):

- **exchanges** (``dispatch``, ``combine``; in the backward their transposes) with the rows the
  routing puts on every pair of ranks, priced per leg by :class:`ep_comm.topology.CostModel` (alpha-beta
  per link class, the slowest rank bounding the leg) for the flat or the hierarchical plan and a
  bf16 or FP8 wire (row bytes with their scales);
- **local passes** (pack, expand, the weighted sums) at the effective rates of ep_comm's local data
  path measured on the H200;
- **expert GEMMs** at the grouped-GEMM rates measured per pass (forward, dlhs, drhs), for each
  rank's own load (skewed routing loads ranks unevenly) plus the elementwise work around them
  (SwiGLU, and in the backward the layout transposes tokamax's kernels need), and every piece
  past the first (a token chunk, a round) reading the rank's expert weights again
  (``Hardware.weight_bw``);
- **the schedule**: ``num_chunks`` pieces of the tokens, issued as the layer's pipeline places
  them: the exchanges in order on one communication stream (dispatch of chunk c+1 and combine of
  chunk c-1 while the experts of chunk c run), the local passes and GEMMs in order on the compute
  stream; ``num_chunks=1`` is the serial layer. Dropless rounds (a receive capacity) run one
  after the other, each a serial layer over its share of the pairs. Chunks of experts
  (``EPConfig.chunk_by="experts"``) are not modelled.

Every operation is an event with a start and an end per rank; a collective starts when its last
rank is ready and ends when its slowest leg does. The model's exchange on one node is exactly
``CostModel.predict``'s (a test holds them equal).

GPUs beyond the expert-parallel group (``ep = min(gpus, experts)`` by default: at least one
expert per GPU) are data-parallel replicas of it: their layer time is the group's. The weight
gradients' data-parallel all-reduce is not part of the MoE layer's exchange and not modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from ep_comm.topology.cost import CostModel, Link
from ep_comm.topology.machine import simulated
from ep_comm.topology.traffic import PLANS, Traffic, _legs, row_bytes

WIRES = ("bf16", "e4m3", "mxfp8")
ROUTINGS = ("uniform", "zipf", "node_limited")
PASSES = ("forward", "dlhs", "drhs")


def wire_row_bytes(hidden: int, wire: str, topk: int) -> int:
    """Bytes of one dispatch row on the wire: the token (bf16; e4m3 with one float32 scale per 128
    elements, DeepEP's layout; MXFP8 with one e8m0 byte per 32) and its routing (``2 * topk``
    float32: weights and ids); ``ep_comm.topology.row_bytes``'s count."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    return row_bytes(hidden, np.float16, topk, None, None if wire == "bf16" else wire)[0]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU kind and its links.

    Attributes:
      name: for the report.
      gpus_per_node: GPUs sharing the fast intra-node link.
      links: alpha-beta per link class (:class:`CostModel`).
      gemm_tflops: effective grouped-GEMM rates per pass (``PASSES``), TFLOP/s.
      local_bw: effective bytes/s of the local dispatch and combine passes (their compulsory
        bytes: the token rows read and the expert rows written, or the reverse).
      elementwise_bw: bytes/s of an elementwise pass (SwiGLU, transposes).
      weight_bw: bytes/s at which a grouped GEMM reads expert weights once more: every piece of
        the layer past the first (a chunk of tokens, a round) reads the rank's expert weights
        again in the forward, and reads them and writes their gradient again in the backward.
      sources: where each figure comes from.
    """

    name: str
    gpus_per_node: int
    links: CostModel
    gemm_tflops: tuple[float, float, float]
    local_bw: tuple[float, float]
    elementwise_bw: float
    weight_bw: float = 5.5e12
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Hardware: gpus_per_node must be a positive int, got "
                             f"{self.gpus_per_node!r}")
        if not isinstance(self.links, CostModel):
            raise TypeError(f"Hardware: links must be a topology.CostModel, got "
                            f"{type(self.links).__name__}")
        for name, vals in (("gemm_tflops", self.gemm_tflops), ("local_bw", self.local_bw),
                           ("elementwise_bw", (self.elementwise_bw,)),
                           ("weight_bw", (self.weight_bw,))):
            if not all(isinstance(v, (int, float)) and v > 0 and np.isfinite(v) for v in vals):
                raise ValueError(f"Hardware: {name} must be positive finite numbers, got {vals!r}")


# One H200 as measured (docs/bench/h200x1_layer/, h200x1_topology/, h200x1_final/; jax 0.11.2,
# tokamax 0.0.17, bf16, T=4096, H=7168, I=2048, 32 local experts):
# - grouped GEMM, ep_comm's tile configs: forward up 3138 us + down 1955 us for 2.886 TFLOP
#   (567 TFLOP/s); dlhs 3370 + 1716 us (567); drhs 5636 + 2931 us (337) (gemm_sweep.txt);
# - local data path: dispatch alone 1018.6 us, combine alone 474.2 us (layer.txt), less the
#   self-exchange of 4096 rows (74.4 us, h200x1_final/bench_T4096 and the exchange bench), over the
#   compulsory 529 MB (T*H read + T*K*H written, bf16): 0.56 and 1.32 TB/s;
# - elementwise: about 3.0 TB/s of a bf16 pass (../shared/NOTES.md: 3.0-3.3 TB/s measured);
# - self link: the engine's self-exchange fitted at 1024-32768 rows (h200x1_topology/
#   calibration.json): alpha 31.2 us per call, beta 1703 GB/s;
# - weight re-reads: the layer's GEMM kernels took 4.6 ms at 1 token chunk, 6.3 ms at 4 and
#   8.5 ms at 8 (h200x1_overlap/README.md): 0.51-0.57 ms per extra read of the rank's 2.8 GB of
#   weights, about 5.5 TB/s (topology.CostModel's weight_bytes_per_s).
# Links between GPUs cannot be measured with one GPU: public figures. NVLink 4 (H100/H200 HGX,
# 450 GB/s per direction): DeepEP measures ~155 GB/s for all-to-all traffic on H800's 400 GB/s
# NVLink, so 160 GB/s effective, 3 us; network: one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s),
# DeepEP's internode kernels reach 43-58 GB/s RDMA: 45 GB/s, 8 us (topology.cost's defaults).
H200_LINKS = CostModel(self=Link(31.2e-6, 1.703e12))
H200 = Hardware(
    name="H200 (HGX: 8 per node, NVLink 4, one 400G NIC per GPU)",
    gpus_per_node=8,
    links=H200_LINKS,
    gemm_tflops=(567.0, 567.0, 337.0),
    local_bw=(0.56e12, 1.32e12),
    elementwise_bw=3.0e12,
    sources=("docs/bench/h200x1_layer/gemm_sweep.txt", "docs/bench/h200x1_layer/layer.txt",
             "docs/bench/h200x1_topology/calibration.json",
             "DeepEP README (github.com/deepseek-ai/DeepEP): H800 NVLink ~160 GB/s, CX7 ~50 GB/s"),
)
# H800 for the validation against DeepEP's published figures, on their hardware: NVLink at
# "~160 GB/s maximum bandwidth" and one CX7 400 Gb/s NIC at "~50 GB/s maximum" per GPU (DeepEP
# README). Compute as H200 (H800 is an H100 with less NVLink: same SMs; not used by the anchors).
H800 = dataclasses.replace(
    H200, name="H800 (DeepEP's testbed: NVLink ~160 GB/s, CX7 400G ~50 GB/s)",
    links=CostModel(self=Link(31.2e-6, 1.703e12), nvlink=Link(3e-6, 160e9),
                    network=Link(8e-6, 50e9)),
    sources=("DeepEP README (github.com/deepseek-ai/DeepEP), Performance section",))


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The MoE layer (DeepSeek-V3's by default) and the tokens each GPU holds."""

    experts: int = 256
    topk: int = 8
    hidden: int = 7168
    intermediate: int = 2048
    tokens_per_gpu: int = 4096

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LayerSpec: {f.name} must be a positive int, got {v!r}")
        if self.topk > self.experts:
            raise ValueError(f"LayerSpec: topk={self.topk} must be <= experts={self.experts}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the layer runs: exchange ``plan``, ``wire`` format of dispatch, ``num_chunks`` of the
    pipeline (1: serial), and an optional receive ``capacity_factor`` (rows per rank in units of
    the balanced ``T * K``) that splits the pairs into dropless rounds."""

    plan: str = "hierarchical"
    wire: str = "bf16"
    num_chunks: int = 1
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.plan not in PLANS:
            raise ValueError(f"Schedule: plan must be one of {PLANS}, got {self.plan!r}")
        if self.wire not in WIRES:
            raise ValueError(f"Schedule: wire must be one of {WIRES}, got {self.wire!r}")
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise ValueError(f"Schedule: num_chunks must be a positive int, got "
                             f"{self.num_chunks!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"Schedule: capacity_factor must be > 0 or None, got "
                             f"{self.capacity_factor!r}")

    @property
    def label(self) -> str:
        s = f"{self.plan}, {self.wire}, " + (
            "serial" if self.num_chunks == 1 else f"{self.num_chunks} chunks")
        return s + (f", rounds at {self.capacity_factor:g}x" if self.capacity_factor else "")


# --- routing draws -------------------------------------------------------------------------------

def draw_routing(routing: str, n: int, spec: LayerSpec, gpus_per_node: int, *,
                 sample_tokens: int = 512, seed: int = 0, max_nodes: int = 4,
                 zipf_s: float = 0.8) -> dict[str, np.ndarray]:
    """Count matrices of one routing draw, scaled to ``tokens_per_gpu``: ``tok[s, d]`` tokens rank
    ``s`` sends rank ``d``, ``pairs[s, d]`` its (token, expert) pairs on ``d``, ``node_tok[s, b]``
    tokens ``s`` sends node ``b``, ``load[d]`` (token, expert) rows rank ``d`` computes.
    ``sample_tokens`` tokens per rank are drawn and the counts scaled (expectations are exact;
    the spread across ranks shrinks with more samples).

    - ``uniform``: ``topk`` distinct experts uniformly;
    - ``zipf``: expert popularity ``~ 1 / rank^zipf_s`` over a random order of the experts;
    - ``node_limited``: DeepSeek-V3's: ``max_nodes`` nodes by their best two scores, then the
      top-k experts among theirs (uniform scores otherwise).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    E, K, T = spec.experts, spec.topk, spec.tokens_per_gpu
    if n < 1 or E % n:
        raise ValueError(f"experts={E} must be divisible by the {n} ranks of the expert-parallel "
                         f"group")
    if n % gpus_per_node and n > gpus_per_node:
        raise ValueError(f"the {n} ranks must fill whole nodes of {gpus_per_node} GPUs")
    G = min(gpus_per_node, n)
    N = n // G
    Ts = min(sample_tokens, T)
    rng = np.random.default_rng(seed)
    logp = np.zeros(E)
    if routing == "zipf":
        logp = -zipf_s * np.log(1.0 + rng.permutation(E))
    ids = np.zeros((n, Ts, K), np.int64)
    for s in range(n):
        scores = logp[None, :] + rng.gumbel(size=(Ts, E))
        if routing == "node_limited" and N > max_nodes:
            per_node = np.sort(scores.reshape(Ts, N, E // N), axis=2)[:, :, -2:].sum(2)
            keep = np.argsort(-per_node, axis=1)[:, :max_nodes]
            allowed = np.zeros((Ts, N), bool)
            np.put_along_axis(allowed, keep, True, axis=1)
            scores = np.where(np.repeat(allowed, E // N, axis=1), scores, -np.inf)
        ids[s] = np.argpartition(-scores, K - 1, axis=1)[:, :K]  # distinct experts
    counts = counts_from_ids(ids, E, G)
    return {k: v * (T / Ts) for k, v in counts.items()}


@functools.lru_cache(maxsize=64)
def _cached_draw(routing, n, spec, G, sample_tokens, seed):
    return draw_routing(routing, n, spec, G, sample_tokens=sample_tokens, seed=seed)


def counts_from_ids(ids, experts: int, gpus_per_node: int) -> dict[str, np.ndarray]:
    """The count matrices (see :func:`draw_routing`) of explicit ``(ranks, tokens, topk)`` expert
    ids (``-1``: none), rank by rank (no ``(ranks, tokens, ranks)`` array: thousands of ranks
    are fine)."""
    ids = np.asarray(ids)
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be an integer array of shape (ranks, tokens, topk), got "
                         f"{ids.dtype} {ids.shape}")
    n, Ts, _ = ids.shape
    if experts % n:
        raise ValueError(f"experts={experts} must be divisible by the {n} ranks")
    G = min(gpus_per_node, n)
    if n % G:
        raise ValueError(f"the {n} ranks must fill whole nodes of {G} GPUs")
    N, L = n // G, experts // n
    tok, pairs = np.zeros((n, n)), np.zeros((n, n))
    node_tok = np.zeros((n, N))
    rows = np.arange(Ts)[:, None]
    for s in range(n):
        valid = (ids[s] >= 0) & (ids[s] < experts)
        dest = np.where(valid, ids[s] // L, n)  # n: not routed
        hit = np.zeros((Ts, n + 1), bool)
        hit[rows, dest] = True
        hit = hit[:, :n]
        tok[s] = hit.sum(0)
        node_tok[s] = hit.reshape(Ts, N, G).any(2).sum(0)
        pairs[s] = np.bincount(dest.ravel(), minlength=n + 1)[:n]
    return dict(tok=tok, pairs=pairs, node_tok=node_tok, load=pairs.sum(0))


def _forward_matrix(tok: np.ndarray, G: int) -> np.ndarray:
    """Stage 2 of the hierarchical plan: forwarder ``(node of d, local index of s)`` sends ``d``
    what ``s`` sent it (``ep_comm.topology.traffic.count_matrices``'s rule, vectorised)."""
    n = tok.shape[0]
    N = n // G
    by_local = tok.reshape(N, G, n).sum(0)  # [l, d]: rows from sources of local index l to d
    fwd = np.zeros((n, n))
    for b in range(N):
        fwd[b * G:(b + 1) * G, b * G:(b + 1) * G] = by_local[:, b * G:(b + 1) * G]
    return fwd


def traffic(counts: dict, n: int, G: int, spec: LayerSpec, schedule: Schedule) -> Traffic:
    """The exchanges of one dispatch + combine for ``counts`` (:func:`draw_routing`), with the
    wire's row bytes for dispatch (combine sends bf16 partial sums)."""
    G = min(G, n)
    topo = simulated(n // G, G)
    plan = schedule.plan if n // G > 1 else "flat"  # one node: the plans coincide
    # any 2-byte dtype prices bf16 rows (numpy has no bfloat16); dispatch's are replaced below
    legs = _legs(plan, topo, counts["tok"], counts["node_tok"],
                 _forward_matrix(counts["tok"], G), spec.hidden, np.float16, spec.topk, None)
    disp = wire_row_bytes(spec.hidden, schedule.wire, spec.topk)
    legs = tuple(dataclasses.replace(ex, row_bytes=disp) if ex.phase == "dispatch" else ex
                 for ex in legs)
    return Traffic(plan, topo, legs)


# --- the event simulation ------------------------------------------------------------------------

@dataclasses.dataclass
class _Op:
    name: str
    stream: str  # "comm" or "compute"
    seconds: np.ndarray  # (n,) per rank; a collective ends with its slowest rank
    deps: tuple[int, ...]
    collective: bool


def simulate(ops: Sequence[_Op], n: int) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Issue ``ops`` in order on in-order streams (per rank); returns each rank's end time and
    each op's (start, end) per rank."""
    free = {"comm": np.zeros(n), "compute": np.zeros(n)}
    spans = []
    for op in ops:
        ready = free[op.stream].copy()
        for d in op.deps:
            ready = np.maximum(ready, spans[d][1])
        if op.collective:  # every rank takes part: it starts when the last one is ready
            start = np.full(n, ready.max())
            end = start + op.seconds.max()
        else:
            start = ready
            end = start + op.seconds
        free[op.stream] = end
        spans.append((start, end))
    end = np.maximum(free["comm"], free["compute"])
    return end, spans


def _leg_seconds(links: CostModel, tr: Traffic, phase: str, scale: float) -> float:
    t = 0.0
    for ex in tr.exchanges:
        if ex.phase == phase:
            part = Traffic(tr.plan, tr.topology, (dataclasses.replace(ex, rows=ex.rows * scale),))
            t += links.predict(part)["total"]
    return t


def layer_ops(hw: Hardware, spec: LayerSpec, schedule: Schedule, counts: dict, tr: Traffic,
              n: int, backward: bool, tr_backward: Traffic | None = None) -> list[_Op]:
    """The layer's operations in issue order (see the module docstring); ``tr_backward``: the
    backward's traffic (bf16 whatever the forward's wire; default ``tr``)."""
    T, K, H, I = spec.tokens_per_gpu, spec.topk, spec.hidden, spec.intermediate
    load = counts["load"]  # (n,) (token, expert) rows per rank
    C = schedule.num_chunks
    rounds = 1
    if schedule.capacity_factor:
        cap = schedule.capacity_factor * T * K
        rounds = max(1, math.ceil(load.max() / cap))
    pieces = C * rounds
    f = 1.0 / pieces
    b = 2  # bf16 bytes
    ones = np.ones(n)
    gemm = lambda p, rows: rows * 6.0 * H * I / (hw.gemm_tflops[p] * 1e12)
    # local passes: token rows read + expert rows written (dispatch; combine the reverse)
    tok_in = counts["tok"].sum(0)  # token rows each rank receives
    local_bytes = (tok_in + load) * H * b
    disp_local = local_bytes / hw.local_bw[0]
    comb_local = local_bytes / hw.local_bw[1]
    swiglu = load * (3 * I) * b / hw.elementwise_bw  # read gate|up, write the activation
    # backward only: the layout transposes tokamax's kernels need (weights for dlhs, inputs
    # for drhs: w_in, w_out of the rank's experts, expert_x and the activation) read + written
    L = spec.experts // n
    transposes = 2 * b * (L * 3 * H * I + load * (H + I)) / hw.elementwise_bw
    # every piece past the first reads the weights again (forward), and reads them and writes
    # their gradient again (backward)
    reread = (pieces - 1) * L * 3 * H * I * b / hw.weight_bw * ones
    passes = [("forward", ("dispatch", "combine"), gemm(0, load) + reread, swiglu, 0.0)]
    if backward:  # combine's transpose moves like dispatch, dispatch's like combine
        passes.append(("backward", ("dispatch", "combine"),
                       gemm(1, load) + gemm(2, load) + 2 * reread, 2 * swiglu, transposes))
    ops: list[_Op] = []
    for name, (first, second), experts_s, act_s, extra_s in passes:
        tr_pass = tr if name == "forward" else (tr_backward or tr)
        t_first = _leg_seconds(hw.links, tr_pass, first, f)
        t_second = _leg_seconds(hw.links, tr_pass, second, f)
        for r in range(rounds):
            # pack on the compute stream, then the pipeline: comm stream D0 D1 C0 D2 C1 ...
            order = []
            for c in range(C + 1):
                if c < C:
                    order.append(("D", c))
                if c >= 1:
                    order.append(("C", c - 1))
            idx = {}
            pack = len(ops)
            ops.append(_Op(f"{name} r{r} local ({first})", "compute", disp_local * f / 2,
                           (len(ops) - 1,) if ops else (), False))
            for kind, c in order:
                if kind == "D":
                    idx[("D", c)] = len(ops)
                    ops.append(_Op(f"{name} r{r} {first} exchange c{c}", "comm",
                                   ones * t_first, (pack,), True))
                    # expand, experts, weighted sums of this chunk on the compute stream
                    idx[("E", c)] = len(ops)
                    ops.append(_Op(f"{name} r{r} experts c{c}", "compute",
                                   disp_local * f / 2 + (experts_s + act_s + extra_s) * f
                                   + comb_local * f / 2, (idx[("D", c)],), False))
                else:
                    idx[("C", c)] = len(ops)
                    ops.append(_Op(f"{name} r{r} {second} exchange c{c}", "comm",
                                   ones * t_second, (idx[("E", c)],), True))
            ops.append(_Op(f"{name} r{r} local ({second} sum)", "compute", comb_local * f / 2,
                           tuple(idx[("C", c)] for c in range(C)), False))
    return ops


def layer_time(hw: Hardware, spec: LayerSpec, schedule: Schedule, gpus: int, *,
               routing: str = "uniform", ep: int | None = None, backward: bool = True,
               seed: int = 0, sample_tokens: int = 512) -> dict:
    """Model one layer (forward, and backward unless ``backward=False``) on ``gpus`` GPUs.

    Returns seconds: ``time`` (the slowest rank), ``compute`` (its busy compute stream),
    ``exchange`` (summed exchange time), ``exposed`` (time not covered by compute), and ``ep``,
    ``rounds``, the bottleneck leg bytes."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    G = hw.gpus_per_node
    if gpus > G and gpus % G:
        raise ValueError(f"gpus={gpus} must be a multiple of gpus_per_node={G} (whole nodes)")
    ep = ep if ep is not None else min(gpus, spec.experts)
    if not isinstance(ep, int) or ep < 1 or gpus % ep:
        raise ValueError(f"ep={ep!r} must be a positive int dividing gpus={gpus}")
    if spec.experts % ep:
        raise ValueError(f"experts={spec.experts} must be divisible by ep={ep} (expert-parallel "
                         f"ranks)")
    counts = _cached_draw(routing, ep, spec, G, sample_tokens, seed)
    tr = traffic(counts, ep, G, spec, schedule)
    tr_b = tr if schedule.wire == "bf16" else traffic(
        counts, ep, G, spec, dataclasses.replace(schedule, wire="bf16"))
    ops = layer_ops(hw, spec, schedule, counts, tr, ep, backward, tr_b)
    end, spans = simulate(ops, ep)
    slow = int(np.argmax(end))
    busy = sum(float(e[slow] - s[slow]) for op, (s, e) in zip(ops, spans)
               if op.stream == "compute")
    exch = sum(float(e[slow] - s[slow]) for op, (s, e) in zip(ops, spans)
               if op.stream == "comm")
    cf = schedule.capacity_factor
    rounds = 1 if not cf else max(1, math.ceil(counts["load"].max() /
                                               (cf * spec.tokens_per_gpu * spec.topk)))
    return dict(gpus=gpus, ep=ep, time=float(end.max()), compute=busy, exchange=exch,
                exposed=float(end.max()) - busy, rounds=rounds,
                network_bytes=float(tr.network_bytes().max()))


# --- weak scaling, validation, report ------------------------------------------------------------
