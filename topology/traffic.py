"""Traffic accounting: which rows cross which link, for the flat and the hierarchical plan.

Everything here is numpy and independent of the JAX implementation, so tests can hold the two
against each other. A plan is a sequence of :class:`TrafficLeg` legs; each leg is an ``(n, n)``
matrix of rows rank ``s`` sends to rank ``d`` and the bytes of one row. Link classes
(:data:`ep_comm.topology.LINK_CLASSES`): ``self`` (a rank to itself: a device copy), ``nvlink`` or
``pcie`` (inside a node), ``network`` (between nodes).

Rows per plan (``T`` tokens per rank, ``K`` = top-k, ``b`` bytes per element, ``H`` hidden):

- flat dispatch: rank ``s`` sends token ``t`` once to every rank holding one of its experts
  (``H*b`` bytes of token plus ``8K`` bytes of routing: weights and ids in float32); combine sends
  one partial sum (``H`` elements of the combine dtype) back per (token, rank).
- hierarchical dispatch: stage 1 sends token ``t`` once per destination *node* to the rank with
  the same local index there (``network`` when the node is another one); stage 2 forwards it inside
  the node to every rank holding one of its experts (``nvlink``/``pcie``). Combine reverses stage 2
  (the forwarder sums the node's partials), then stage 1 (one partial per token per node).

With a user ``recv_capacity`` the rows a final rank cannot hold are not sent in the flat plan nor
forwarded in stage 2 (stage 1 still carries them: its buffers are sized for the worst case).
"""

from __future__ import annotations

import dataclasses
from math import comb

import numpy as np

from ep_comm.topology._checks import dtype_arg, positive_int
from ep_comm.topology.machine import LINK_CLASSES, Topology

PLANS = ("flat", "hierarchical")
# dispatch's token row formats on the wire (ep_comm.wire): None = the tokens' own dtype; FP8 e4m3
# values with one float32 scale per 128 elements, or OCP MXFP8 (one e8m0 byte per 32 elements)
WIRE_FORMATS = (None, "e4m3", "mxfp8")
_WIRE_BLOCK = {"e4m3": (128, 4), "mxfp8": (32, 1)}  # elements per scale, bytes per scale


def token_bytes(hidden: int, dtype, wire_format=None, *, owner: str = "token_bytes") -> int:
    """Bytes of one token row on the wire, scales included."""
    positive_int(owner, "hidden", hidden)
    itemsize = dtype_arg(owner, "dtype", dtype).itemsize
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"{owner}: wire_format must be one of {WIRE_FORMATS}, got "
                         f"{wire_format!r}")
    if wire_format is None:
        return hidden * itemsize
    block, per_scale = _WIRE_BLOCK[wire_format]
    return hidden + -(-hidden // block) * per_scale


@dataclasses.dataclass(frozen=True)
class TrafficLeg:
    """One leg: ``rows[s, d]`` rows of ``row_bytes`` bytes from rank ``s`` to rank ``d``, moved by
    ``calls`` collective calls (the latency term counts each)."""

    name: str
    phase: str  # "dispatch" or "combine"
    rows: np.ndarray
    row_bytes: int
    calls: int = 1


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The exchanges of one dispatch + combine under one plan, and the topology they run on."""

    plan: str
    topology: Topology
    exchanges: tuple[TrafficLeg, ...]

    def link_matrix(self) -> np.ndarray:
        """``(n, n)`` index into :data:`LINK_CLASSES` of the link between each pair of ranks."""
        return link_matrix(self.topology)

    def rows_by_link(self, phase: str) -> np.ndarray:
        """``(n, len(LINK_CLASSES))`` rows each rank sends over each link class in ``phase``."""
        return self._by_link(phase, lambda ex: ex.rows)

    def bytes_by_link(self, phase: str | None = None) -> np.ndarray:
        """``(n, len(LINK_CLASSES))`` bytes each rank sends over each link class (both phases
        when ``phase`` is None)."""
        return self._by_link(phase, lambda ex: ex.rows * ex.row_bytes)

    def _by_link(self, phase, value) -> np.ndarray:
        if phase not in (None, "dispatch", "combine"):
            raise ValueError(f"Traffic: phase must be 'dispatch', 'combine' or None, got {phase!r}")
        links = self.link_matrix()
        n = links.shape[0]
        out = np.zeros((n, len(LINK_CLASSES)), np.float64)
        for ex in self.exchanges:
            if phase is None or ex.phase == phase:
                v = np.asarray(value(ex), np.float64)
                for c in range(len(LINK_CLASSES)):
                    out[:, c] += np.where(links == c, v, 0).sum(axis=1)
        return out

    def network_bytes(self, phase: str | None = None) -> np.ndarray:
        """``(n,)`` bytes each rank sends between nodes."""
        return self.bytes_by_link(phase)[:, LINK_CLASSES.index("network")]

    def summary(self) -> dict:
        """Per link class: total bytes and the bottleneck rank's bytes, per phase (JSON-able)."""
        out = {}
        for phase in ("dispatch", "combine"):
            b = self.bytes_by_link(phase)
            out[phase] = {c: {"total": float(b[:, i].sum()), "max_rank": float(b[:, i].max())}
                          for i, c in enumerate(LINK_CLASSES)}
        return out


def link_matrix(topology: Topology) -> np.ndarray:
    """``(n, n)`` index into :data:`LINK_CLASSES` of the link each pair of ranks crosses
    (:meth:`Topology.link`, vectorised: thousands of ranks are fine)."""
    n, G = topology.num_ranks, topology.gpus_per_node
    node = np.arange(n) // G
    same_node = node[:, None] == node[None, :]
    out = np.where(same_node, LINK_CLASSES.index(topology.intra_node_link()),
                   LINK_CLASSES.index("network"))
    np.fill_diagonal(out, LINK_CLASSES.index("self"))
    return out.astype(np.int32)


def _check_plan(plan: str, owner: str) -> None:
    if plan not in PLANS:
        raise ValueError(f"{owner}: plan must be one of {PLANS}, got {plan!r}")


def row_bytes(hidden: int, dtype, topk: int, combine_dtype=None,
              wire_format=None, *, owner: str = "row_bytes") -> tuple[int, int]:
    """Bytes of one dispatch row (the token as ``wire_format`` sends it: ``hidden`` elements of
    ``dtype``, or FP8 with its scales; and ``2 * topk`` float32 of routing) and of one combine row
    (``hidden`` elements of ``combine_dtype``, default ``dtype``)."""
    positive_int(owner, "topk", topk)
    token = token_bytes(hidden, dtype, wire_format, owner=owner)
    wire = dtype_arg(owner, "combine_dtype" if combine_dtype is not None else "dtype",
                     combine_dtype if combine_dtype is not None else dtype).itemsize
    return token + 2 * topk * 4, hidden * wire


def _legs(plan: str, topology: Topology, kept: np.ndarray, node_tok: np.ndarray,
          fwd: np.ndarray, hidden: int, dtype, topk: int, combine_dtype,
          wire_format=None) -> tuple[TrafficLeg, ...]:
    """Legs from the count matrices (exact or expected): ``kept[s, d]`` tokens s sends d that d
    keeps, ``node_tok[s, b]`` tokens s->node b, ``fwd[f, d]`` rows forwarder f sends to d in
    stage 2."""
    disp, comb_ = row_bytes(hidden, dtype, topk, combine_dtype, wire_format)
    if plan == "flat":
        return (TrafficLeg("dispatch exchange", "dispatch", kept, disp, 2),
                TrafficLeg("combine exchange", "combine", kept.T.copy(), comb_, 1))
    N, G = topology.shape
    n = N * G
    stage1 = np.zeros((n, n), node_tok.dtype)
    for s in range(n):
        for b in range(N):
            stage1[s, b * G + s % G] = node_tok[s, b]
    return (TrafficLeg("dispatch stage 1", "dispatch", stage1, disp, 2),
            TrafficLeg("dispatch stage 2", "dispatch", fwd, disp, 2),
            TrafficLeg("combine stage 2", "combine", fwd.T.copy(), comb_, 1),
            TrafficLeg("combine stage 1", "combine", stage1.T.copy(), comb_, 1))


def _ids_array(topk_ids) -> np.ndarray:
    ids = np.asarray(topk_ids)
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"count_traffic: topk_ids must be an integer array of shape "
                         f"(ranks, tokens, topk), got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def count_matrices(topk_ids, num_experts: int, topology: Topology,
                   recv_token_rows: int | None = None) -> dict[str, np.ndarray]:
    """Exact count matrices of one routing (see :func:`count_traffic`)."""
    ids = _ids_array(topk_ids)
    n, T, K = ids.shape
    topology.check_ranks(n, "count_traffic")
    positive_int("count_traffic", "num_experts", num_experts)
    if recv_token_rows is not None:
        positive_int("count_traffic", "recv_token_rows", recv_token_rows)
    if num_experts % n:
        raise ValueError(f"count_traffic: num_experts={num_experts} must be divisible by the "
                         f"{n} ranks")
    L = num_experts // n
    N, G = topology.shape
    valid = (ids >= 0) & (ids < num_experts)
    dest = np.where(valid, ids // max(L, 1), -1)
    hit = np.zeros((n, T, n), bool)  # hit[s, t, d]: token t of s goes to rank d
    for k in range(K):
        s_i, t_i = np.nonzero(valid[:, :, k])
        hit[s_i, t_i, dest[s_i, t_i, k]] = True
    tok = hit.sum(axis=1)  # (n, n)
    R = n * T if recv_token_rows is None else recv_token_rows
    start = np.cumsum(tok, axis=0) - tok
    kept = np.clip(R - start, 0, tok)
    node_tok = hit.reshape(n, T, N, G).any(axis=3).sum(axis=1)  # (n, N)
    # stage 2: the forwarder of s's tokens on d's node has s's local index
    fwd = np.zeros((n, n), np.int64)
    for s in range(n):
        for d in range(n):
            fwd[(d // G) * G + s % G, d] += kept[s, d]
    return dict(tok=tok, kept=kept, node_tok=node_tok, fwd=fwd)


def count_traffic(topk_ids, *, num_experts: int, topology: Topology, hidden: int, dtype,
                  plan: str, combine_dtype=None, recv_token_rows: int | None = None,
                  wire_format=None) -> Traffic:
    """Exact traffic of one routing.

    Args:
      topk_ids: ``(ranks, tokens, topk)`` integer expert ids of every rank (``-1``: none).
      num_experts: experts, in contiguous blocks per rank.
      topology: the machine; ``ep_comm.topology.num_ranks`` must equal ``ranks``.
      hidden, dtype: the token rows (``x.shape[1]``, ``x.dtype``).
      plan: ``"flat"`` or ``"hierarchical"``.
      combine_dtype: dtype of the partial sums sent back (default ``dtype``).
      recv_token_rows: rows of each rank's token receive buffer
        (``EPConfig.recv_token_rows``; default: the dropless worst case).
      wire_format: dispatch's token format on the wire (:data:`WIRE_FORMATS`).
    """
    _check_plan(plan, "count_traffic")
    K = _ids_array(topk_ids).shape[2]
    row_bytes(hidden, dtype, K, combine_dtype, wire_format, owner="count_traffic")  # the checks
    m = count_matrices(topk_ids, num_experts, topology, recv_token_rows)
    return Traffic(plan, topology, _legs(plan, topology, m["kept"], m["node_tok"],
                                         m["fwd"], hidden, dtype, K, combine_dtype,
                                         wire_format))


def _p_any(num_experts: int, topk: int, hit_experts: int) -> float:
    """P(a uniformly random set of ``topk`` distinct experts meets a given set of
    ``hit_experts``)."""
    return 1.0 - comb(num_experts - hit_experts, topk) / comb(num_experts, topk)


def expected_traffic(*, num_experts: int, topk: int, tokens_per_rank: int, topology: Topology,
                     hidden: int, dtype, plan: str, combine_dtype=None,
                     wire_format=None) -> Traffic:
    """Expected traffic when every token picks ``topk`` distinct experts uniformly at random
    (balanced routing, no capacity limit): the rows matrices hold expectations (floats)."""
    _check_plan(plan, "expected_traffic")
    for name, value in (("num_experts", num_experts), ("topk", topk),
                        ("tokens_per_rank", tokens_per_rank)):
        positive_int("expected_traffic", name, value)
    row_bytes(hidden, dtype, topk, combine_dtype, wire_format, owner="expected_traffic")
    n = topology.num_ranks
    N, G = topology.shape
    if num_experts % n:
        raise ValueError(f"expected_traffic: num_experts={num_experts} must be divisible by the "
                         f"{n} ranks")
    L = num_experts // n
    T = tokens_per_rank
    p_rank = _p_any(num_experts, topk, L)
    p_node = _p_any(num_experts, topk, L * G)
    tok = np.full((n, n), T * p_rank)
    node_tok = np.full((n, N), T * p_node)
    # stage 2: forwarder (b, l) sends to (b, l') the tokens of the N sources (a, l)
    fwd = np.zeros((n, n))
    for d in range(n):
        for lf in range(G):
            fwd[(d // G) * G + lf, d] = N * T * p_rank
    return Traffic(plan, topology, _legs(plan, topology, tok, node_tok, fwd, hidden, dtype,
                                         topk, combine_dtype, wire_format))
