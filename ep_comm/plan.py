"""Which exchange plan dispatch/combine run, and over which axes its stages go.

- ``flat``: one ragged exchange over the whole expert-parallel axis. A token goes once to every
  rank that holds one of its experts; between nodes that is once per destination *rank*.
- ``hierarchical`` (``N`` nodes x ``G`` ranks, rank ``r`` = node ``r // G``, local ``r % G``):
  stage 1 exchanges among the ranks with the same local index (one per node: the network), a token
  going once per destination *node*; stage 2 exchanges inside each node (NVLink), forwarding each
  token to the ranks of the node that hold its experts. Combine runs the two stages backwards and
  the stage-1 receiver sums the partial results of its node before sending one row back per token.

Stage axes: with ``axis_name=(node_axis, local_axis)`` stage 1 runs over ``node_axis`` and stage 2
over ``local_axis``; over one flattened axis they run over the same axis split into groups
(``axis_index_groups``): stage 1 ``{l, G + l, 2G + l, ...}``, stage 2 ``{aG, ..., aG + G - 1}``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ep_comm import topology as topo_mod
from ep_comm.topology._jax_compat import axis_size
from ep_comm.config import EPConfig


@dataclasses.dataclass(frozen=True)
class Stage:
    """One exchange of a plan: its axis and its groups (``axis_index_groups``, or None)."""

    axis_name: object
    groups: tuple | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """A resolved plan: ``kind`` ``"flat"`` or ``"hierarchical"``, the ``ep_comm.topology`` used to name
    links, and the stages (one for flat, two for hierarchical)."""

    kind: str
    topology: topo_mod.Topology
    stages: tuple[Stage, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.topology.shape


def _node_local_axes(cfg: EPConfig):
    ax = cfg.axis_name
    if isinstance(ax, tuple) and len(ax) == 2:
        return ax
    return None


def machine(cfg: EPConfig, api: str, need: bool) -> topo_mod.Topology | None:
    """The topology of ``cfg``'s axis: the config's, the two mesh axes', or (when ``need``) the
    current machine's; ``None`` when nothing says and it is not needed."""
    pair = _node_local_axes(cfg)
    if pair is not None:
        shape = (axis_size(pair[0], api), axis_size(pair[1], api))
        if cfg.topology is not None and cfg.topology.shape != shape:
            raise ValueError(f"{api}: axis_name={cfg.axis_name!r} has shape {shape} (nodes, "
                             f"devices per node) but config.topology is "
                             f"{cfg.topology.shape[0]}x{cfg.topology.shape[1]}")
        return cfg.topology or topo_mod.simulated(*shape)
    if cfg.topology is not None:
        return cfg.topology
    found = topo_mod.current() if need else topo_mod.known()
    if found is None:
        return None
    if found.num_ranks != cfg.num_ranks:
        if found.num_nodes == 1:  # every rank of the axis is on this one node
            return topo_mod.simulated(1, cfg.num_ranks)
        raise ValueError(
            f"{api}: the machine has {found.num_ranks} devices on {found.num_nodes} nodes but "
            f"axis {cfg.axis_name!r} has {cfg.num_ranks} ranks, so which node each rank is on is "
            f"not known; pass EPConfig(topology=...) for the axis, use "
            f"axis_name=(node_axis, local_axis), or set plan='flat'")
    return found


def _stages(cfg: EPConfig, kind: str, topo: topo_mod.Topology) -> tuple[Stage, ...]:
    if kind == "flat":
        return (Stage(cfg.axis_name, None),)
    N, G = topo.shape
    inter = tuple(tuple(a * G + g for a in range(N)) for g in range(G))  # same local index
    intra = tuple(tuple(a * G + g for g in range(G)) for a in range(N))  # same node
    pair = _node_local_axes(cfg)
    if pair is not None:
        return (Stage(pair[0], None), Stage(pair[1], None))
    return (Stage(cfg.axis_name, inter), Stage(cfg.axis_name, intra))


def resolve_plan(cfg: EPConfig, hidden: int, dtype, api: str = "dispatch") -> Plan:
    """The plan ``cfg`` runs for tokens of ``hidden`` elements of ``dtype`` (inside shard_map)."""
    kind = cfg.plan
    topo = machine(cfg, api, need=kind != "flat") or topo_mod.simulated(1, cfg.num_ranks)
    if kind == "auto":
        kind = choose(cfg, topo, hidden, dtype)
    return Plan(kind, topo, _stages(cfg, kind, topo))


def replay(cfg: EPConfig, kind: str, api: str = "combine") -> Plan:
    """The plan dispatch resolved to (``handle.plan``), rebuilt for combine."""
    topo = machine(cfg, api, need=kind != "flat") or topo_mod.simulated(1, cfg.num_ranks)
    return Plan(kind, topo, _stages(cfg, kind, topo))


def predict(cfg: EPConfig, topo: topo_mod.Topology, hidden: int, dtype) -> dict[str, dict]:
    """The cost model's prediction of both plans for balanced (uniform random) routing."""
    model = cfg.cost_model or topo_mod.CostModel()
    out = {}
    for kind in topo_mod.PLANS:
        t = topo_mod.expected_traffic(num_experts=cfg.num_experts, topk=cfg.topk,
                                      tokens_per_rank=cfg.tokens_per_rank, topology=topo,
                                      hidden=hidden, dtype=np.dtype(dtype), plan=kind,
                                      combine_dtype=cfg.combine_dtype,
                                      wire_format=cfg.wire_format)
        out[kind] = model.predict(t)
    return out


def choose(cfg: EPConfig, topo: topo_mod.Topology, hidden: int, dtype) -> str:
    """``plan="auto"``: flat on one node or one rank per node (the plans coincide there), else the
    plan with the smaller predicted dispatch + combine time."""
    N, G = topo.shape
    if N == 1 or G == 1:
        return "flat"
    p = predict(cfg, topo, hidden, dtype)
    return "hierarchical" if p["hierarchical"]["total"] < p["flat"]["total"] else "flat"
