"""``EPConfig``: the static description of one expert-parallel exchange."""

from __future__ import annotations

import dataclasses
from typing import Hashable

import zlib

import numpy as np

from ep_comm import collectives
from ep_comm.placement import ExpertPlacement
from ep_comm.topology import PLANS, WIRE_FORMATS, CostModel, Topology, row_bytes
from ep_comm.topology._checks import dtype_arg, positive_int

OVERFLOW_MODES = ("count", "raise")
INVALID_IDS_MODES = ("warn", "raise", "ignore")
PLAN_CHOICES = ("auto", *PLANS)
CHUNK_BY = ("tokens", "experts")


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Static configuration of dispatch/combine over one expert-parallel mesh axis.

    Attributes:
      axis_name: the mesh axis (or tuple of axes) experts are sharded over.
      num_ranks: size of that axis (the expert-parallel size).
      num_experts: total routed experts; divisible by ``num_ranks``. Rank ``r`` holds experts
        ``[r * E_local, (r + 1) * E_local)`` with ``E_local = num_experts // num_ranks``.
      topk: experts per token.
      tokens_per_rank: tokens each rank dispatches (``T``; the first dim of ``x``).
      recv_capacity: rows of the per-rank expert buffer ``expert_x`` (one row per received
        (token, local expert) pair). Default ``None`` is the worst case
        ``num_ranks * tokens_per_rank * min(topk, E_local)``, so no pair can ever be dropped.
        A smaller value saves memory; pairs that do not fit are dropped, **counted** in
        ``EPHandle.num_dropped`` and reported by :func:`ep_comm.check` (or raised at run time with
        ``overflow="raise"``). :func:`ep_comm.moe_layer` drops nothing at any capacity: it runs
        in rounds of at most ``recv_capacity`` pairs per rank (:mod:`ep_comm.rounds`).
      backend: transport for the exchanges: ``"auto"``, ``"portable"``, ``"xla"``, ``"nccl"`` or
        ``"mpi"`` (see :func:`ep_comm.ragged_all_to_all` and :mod:`ep_comm.collectives`).
      overflow: ``"count"`` (default: pairs a user-set ``recv_capacity`` drops are counted in the
        handle; call :func:`ep_comm.check` on it) or ``"raise"`` (dispatch raises
        ``EPOverflowError`` at run time when any pair is dropped: catch it around a step wrapped
        in :func:`ep_comm.checked`; see :mod:`ep_comm.overflow`).
      invalid_ids: what an expert id outside ``[-1, num_experts)`` in ``topk_ids`` does (a bug in
        the caller: ``-1`` is the documented "no expert"; such ids are never routed):
        ``"warn"`` (an ``ep_comm.overflow.EPInvalidIdsWarning`` once per program, with the count,
        the first bad id and the rank that saw it), ``"raise"`` (``EPOverflowError`` at run time,
        as ``overflow="raise"``) or ``"ignore"`` (counted in the handle only). Default ``None``:
        ``"raise"`` with ``overflow="raise"``, else ``"warn"``. On the device the check is a
        ``lax.cond`` on counts dispatch gathers anyway (its host callback runs only when an id
        is bad), but a program holding a host callback costs each call host time even when it
        does not run: 2.0-2.2 ms per ``moe_layer`` call on a TPU v5e at T=4096, 7-11% of the
        layer's forward (``tools/ids_check_probe.py``, docs/performance.md). Ids from
        ``lax.top_k`` over ``num_experts`` scores cannot be out of range: ``"ignore"`` then
        (as ``ep_comm.nnx.MoE`` does for its own router).
      combine_dtype: dtype of the partial sums sent back by combine (default ``None``: the dtype
        of ``expert_y``). ``"float32"`` makes bf16 combine exact up to one final rounding, at twice
        the bytes.
      plan: how tokens travel (see :mod:`ep_comm.plan`): ``"flat"`` (one exchange over the whole
        axis: a token crosses the network once per destination *rank*), ``"hierarchical"`` (stage
        1 over the network once per destination *node* to the same-local-index rank there, stage
        2 inside the node; combine reduces inside the node first) or ``"auto"`` (default: the
        plan the cost model predicts faster for balanced routing on ``ep_comm.topology``; ``"flat"`` on a
        single node).
      topology: the :class:`ep_comm.topology.Topology` the axis runs on (``num_ranks`` ranks, node-major).
        Default ``None``: with ``axis_name=(node_axis, local_axis)`` the two mesh axes are the
        nodes and the devices of a node; otherwise ``ep_comm.topology.current()`` (``EP_COMM_TOPOLOGY``
        or discovery) when the plan needs one.
      cost_model: the :class:`ep_comm.topology.CostModel` that ``plan="auto"`` consults (default: the
        H200-class defaults).
      wire_format: how dispatch sends token rows (:mod:`ep_comm.wire`): ``None`` (default: in
        ``x``'s dtype), ``"e4m3"`` (FP8 with one float32 scale per 128 elements: 0.52x of bf16's
        bytes at H = 7168) or ``"mxfp8"`` (OCP MXFP8: one power-of-two scale byte per 32). The
        sender quantizes each row, the scales travel in the row, the receiver dequantizes into
        ``expert_x`` in ``x``'s dtype. The backward of dispatch runs in full precision: the
        quantization is straight-through. Combine is not quantized.
      zero_fill: ``False`` (default): the rows of ``expert_x`` past ``sum(group_sizes)`` are
        **unspecified** but for the first ``ep_comm.expand.ZERO_TAIL_ROWS`` (256), which are zero
        (grouped GEMM tiles that run past the last group read them). On GPUs the rest are never
        written: the worst-case buffer costs no fill; the XLA path on other platforms fills them
        with NaN, so that a consumer reading them shows. Grouped GEMMs, :func:`combine` and the
        layer read only the groups. ``True`` writes zeros there (a pass over the whole buffer).
      num_chunks: :func:`ep_comm.moe_layer` only: token chunks the layer runs as a pipeline
        (:mod:`ep_comm.pipeline`): while the experts of chunk ``c`` run, the dispatch of chunk
        ``c + 1`` and the combine of chunk ``c - 1`` are in flight (on the nccl transport, on the
        engine's own stream). ``1`` (default): no chunks. An int must divide
        ``tokens_per_rank``; every chunk is one ``tokens_per_rank / num_chunks``-token exchange.
        ``"auto"``: the count the cost model predicts fastest (:meth:`CostModel.pipeline_seconds`,
        from ``cost_model``), among the divisors of ``tokens_per_rank`` up to 16. Every rank
        must use the same value (it changes the exchanges' sizes, which the native transports
        check).
      chunk_by: what the pipeline's chunks cut (:mod:`ep_comm.pipeline`). ``"tokens"``
        (default): chunk ``c`` is tokens ``[c * T / C, (c + 1) * T / C)`` with all their
        experts; each chunk's GEMMs read all the local expert weights again. ``"experts"``:
        chunk ``c`` is every token's pairs with the local experts ``[c * L / C, (c + 1) * L /
        C)`` of each rank (``L = experts_per_rank``); each expert's GEMM runs once, over all its
        rows, so the weights are read once, but a token with experts in several chunks on one
        rank is sent once per chunk. ``num_chunks`` must then divide ``experts_per_rank`` and
        leave at least ``topk`` experts per chunk (``num_experts / num_chunks >= topk``: each
        chunk's exchange is one of that many experts). Every rank must use the same value.
      capacity_factor: :func:`ep_comm.moe_layer` only, with ``recv_capacity=None``: the layer's
        expert buffer per round, as a multiple of the balanced load (``tokens_per_rank * topk /
        num_chunks`` pairs per rank per chunk: what every rank receives under uniform routing),
        rounded up and at most the worst case. Default ``2.0``: at EP8 with top-8 a quarter of
        the worst case; routing that sends a rank more runs in dropless rounds
        (:mod:`ep_comm.rounds`) instead of sizing every step for the worst case. ``None``: the
        worst case (one round, whatever the routing; the layer then returns dispatch's handle).
        A number at least 1. Dispatch alone does not read it (its default stays the worst case).

    Memory per rank (``H`` hidden size, ``b`` bytes per element of ``x``), see :meth:`buffer_bytes`:
      send buffer ``S = T * min(topk, num_ranks)`` rows; token receive buffer
      ``R = min(num_ranks * T, recv_capacity)`` rows; expert buffer ``recv_capacity`` rows;
      total ``(S + R + recv_capacity) * H * b + R * topk * 8`` bytes (the last term: local expert
      ids and weights received with each token).
    """

    axis_name: Hashable
    num_ranks: int
    num_experts: int
    topk: int
    tokens_per_rank: int
    recv_capacity: int | None = None
    backend: str = "auto"
    overflow: str = "count"
    invalid_ids: str | None = None
    combine_dtype: str | None = None
    plan: str = "auto"
    topology: Topology | None = None
    cost_model: CostModel | None = None
    wire_format: str | None = None
    zero_fill: bool = False
    num_chunks: int | str = 1
    chunk_by: str = "tokens"
    capacity_factor: float | None = 2.0

    def __post_init__(self):
        owner = "EPConfig"
        if self.axis_name is None or (isinstance(self.axis_name, tuple) and not self.axis_name):
            raise ValueError(f"{owner}: axis_name must name a mesh axis, got {self.axis_name!r}")
        for name in ("num_ranks", "num_experts", "topk", "tokens_per_rank"):
            positive_int(owner, name, getattr(self, name))
        if self.num_experts % self.num_ranks:
            raise ValueError(f"{owner}: num_experts={self.num_experts} must be divisible by "
                             f"num_ranks={self.num_ranks}")
        if self.num_experts > 2**24:
            raise ValueError(f"{owner}: num_experts={self.num_experts} must be at most 2**24 "
                             f"(expert ids travel exactly in float32)")
        if self.topk > self.num_experts:
            raise ValueError(f"{owner}: topk={self.topk} must be at most "
                             f"num_experts={self.num_experts}")
        if self.recv_capacity is not None:
            positive_int(owner, "recv_capacity", self.recv_capacity)
        if self.backend not in collectives.BACKENDS:
            raise ValueError(f"{owner}: backend must be one of {collectives.BACKENDS}, "
                             f"got {self.backend!r}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"{owner}: overflow must be one of {OVERFLOW_MODES}, "
                             f"got {self.overflow!r}")
        if self.invalid_ids is not None and self.invalid_ids not in INVALID_IDS_MODES:
            raise ValueError(f"{owner}: invalid_ids must be None or one of {INVALID_IDS_MODES}, "
                             f"got {self.invalid_ids!r}")
        if self.combine_dtype is not None:
            try:
                dt = np.dtype(self.combine_dtype)
            except TypeError:
                dt = None
            if dt is None or dt.kind != "f":
                raise ValueError(f"{owner}: combine_dtype must be None or a floating dtype name, "
                                 f"got {self.combine_dtype!r}")
            object.__setattr__(self, "combine_dtype", dt.name)
        if self.plan not in PLAN_CHOICES:
            raise ValueError(f"{owner}: plan must be one of {PLAN_CHOICES}, got {self.plan!r}")
        if self.topology is not None:
            if not isinstance(self.topology, Topology):
                raise TypeError(f"{owner}: topology must be a topology.Topology or None, got "
                                f"{type(self.topology).__name__}")
            self.topology.gpus_per_node  # raises for unequal nodes
            self.topology.check_ranks(self.num_ranks, owner)
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(f"{owner}: cost_model must be a topology.CostModel or None, got "
                            f"{type(self.cost_model).__name__}")
        if self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"{owner}: wire_format must be one of {WIRE_FORMATS}, got "
                             f"{self.wire_format!r}")
        if not isinstance(self.zero_fill, bool):
            raise TypeError(f"{owner}: zero_fill must be a bool, got "
                            f"{type(self.zero_fill).__name__}")
        if self.capacity_factor is not None:
            f = self.capacity_factor
            if (isinstance(f, bool) or not isinstance(f, (int, float, np.integer, np.floating))
                    or not np.isfinite(f) or f < 1):
                raise ValueError(f"{owner}: capacity_factor must be None or a number >= 1 (the "
                                 f"layer's expert buffer per round as a multiple of the balanced "
                                 f"load), got {f!r}")
            object.__setattr__(self, "capacity_factor", float(f))
        if self.chunk_by not in CHUNK_BY:
            raise ValueError(f"{owner}: chunk_by must be one of {CHUNK_BY}, got "
                             f"{self.chunk_by!r}")
        if self.num_chunks != "auto":
            if (not isinstance(self.num_chunks, (int, np.integer)) or isinstance(
                    self.num_chunks, bool) or self.num_chunks < 1):
                raise ValueError(f"{owner}: num_chunks must be a positive int or 'auto', got "
                                 f"{self.num_chunks!r}")
            if self.chunk_by == "tokens" and self.tokens_per_rank % self.num_chunks:
                raise ValueError(f"{owner}: num_chunks={self.num_chunks} must divide "
                                 f"tokens_per_rank={self.tokens_per_rank} (every chunk is an "
                                 f"exchange of the same size)")
            if self.chunk_by == "experts" and self.experts_per_rank % self.num_chunks:
                raise ValueError(f"{owner}: num_chunks={self.num_chunks} must divide "
                                 f"experts_per_rank={self.experts_per_rank} with "
                                 f"chunk_by='experts' (every chunk holds as many experts)")
            if (self.chunk_by == "experts"
                    and self.num_experts // self.num_chunks < self.topk):
                raise ValueError(f"{owner}: num_chunks={self.num_chunks} leaves "
                                 f"{self.num_experts // self.num_chunks} experts per chunk with "
                                 f"chunk_by='experts', fewer than topk={self.topk} (each "
                                 f"chunk's exchange is one of num_experts / num_chunks experts)")
            object.__setattr__(self, "num_chunks", int(self.num_chunks))

    @property
    def fingerprint(self) -> int:
        """A stable 32-bit digest of the fields every rank must agree on; the native transports
        compare it across ranks on every exchange and fail on a mismatch."""
        fields = (self.num_ranks, self.num_experts, self.topk, self.tokens_per_rank,
                  self.recv_capacity, self.combine_dtype, self.plan, self.wire_format,
                  self.ids_check,
                  None if self.topology is None else self.topology.shape)
        return zlib.crc32(repr(fields).encode())

    @property
    def ids_check(self) -> str:
        """What ids out of range do: ``invalid_ids``, or its default (``"raise"`` with
        ``overflow="raise"``, else ``"warn"``)."""
        if self.invalid_ids is not None:
            return self.invalid_ids
        return "raise" if self.overflow == "raise" else "warn"

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def placement(self) -> ExpertPlacement:
        """Which rank holds which experts: contiguous blocks of :attr:`experts_per_rank`."""
        return ExpertPlacement(self.num_experts, self.num_ranks)

    @property
    def experts_per_rank(self) -> int:
        """Experts each rank holds: ``num_experts // num_ranks``."""
        return self.num_experts // self.num_ranks

    @property
    def worst_case_rows(self) -> int:
        """Most (token, local expert) pairs one rank can receive."""
        return self.num_ranks * self.tokens_per_rank * min(self.topk, self.experts_per_rank)

    @property
    def expert_rows(self) -> int:
        """Rows of ``expert_x`` (the expert buffer): ``recv_capacity`` or the worst case."""
        return self.worst_case_rows if self.recv_capacity is None else self.recv_capacity

    @property
    def send_rows(self) -> int:
        """Rows of the send buffer: each token goes at most once to each of ``min(topk, n)`` ranks."""
        return self.tokens_per_rank * min(self.topk, self.num_ranks)

    @property
    def recv_token_rows(self) -> int:
        """Rows of the token receive buffer (each received token needs at least one expert row)."""
        return min(self.num_ranks * self.tokens_per_rank, self.expert_rows)

    @property
    def is_dropless(self) -> bool:
        """True when no routing can overflow the buffers."""
        return self.expert_rows >= self.worst_case_rows

    def buffer_bytes(self, hidden: int, dtype, plan: str = "flat",
                     num_nodes: int | None = None) -> dict[str, int]:
        """Bytes per rank of each buffer dispatch allocates for ``x`` of shape ``(T, hidden)``.

        ``plan="hierarchical"`` (``num_nodes`` nodes, default: the topology's) adds stage 1's
        buffers: a send buffer of ``T * min(topk, N)`` rows, a forwarding buffer of ``N * T``
        rows (the worst case: every source on the other nodes sends every token) and stage 2's
        send buffer of ``N * T * min(topk, G)`` rows; stage 2 receives into the flat plan's
        token receive buffer."""
        owner = "EPConfig.buffer_bytes"
        positive_int(owner, "hidden", hidden)
        if plan not in PLANS:
            raise ValueError(f"{owner}: plan must be 'flat' or 'hierarchical', got {plan!r}")
        b = dtype_arg(owner, "dtype", dtype).itemsize
        row, _ = row_bytes(hidden, dtype, self.topk, wire_format=self.wire_format,
                           owner=owner)  # + routing
        out = {
            "recv_tokens": self.recv_token_rows * row,
            "expert_x": self.expert_rows * hidden * b,
        }
        if plan == "flat":
            out["send"] = self.send_rows * row
        else:
            if num_nodes is None:
                if self.topology is None:
                    raise ValueError(f"{owner}: plan='hierarchical' needs num_nodes (or "
                                     f"EPConfig.topology)")
                num_nodes = self.topology.num_nodes
            positive_int(owner, "num_nodes", num_nodes)
            if self.num_ranks % num_nodes:
                raise ValueError(f"{owner}: num_nodes={num_nodes} must divide num_ranks="
                                 f"{self.num_ranks}")
            G = self.num_ranks // num_nodes
            T, K = self.tokens_per_rank, self.topk
            out["send"] = T * min(K, num_nodes) * row
            out["forward"] = num_nodes * T * row
            out["forward_send"] = num_nodes * T * min(K, G) * row
        out["total"] = sum(out.values())
        return out
