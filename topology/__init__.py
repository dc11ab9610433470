"""What ep_comm knows about the machine: discovery and node grouping
(:class:`Topology`), traffic accounting per link class, the alpha-beta cost model that picks the
exchange plan, and node-limited routing."""

from ep_comm.topology.cost import H200_DEFAULTS, CostModel, Link
from ep_comm.topology.machine import (ENV, LINK_CLASSES, Device, Node, Topology, current, discover, known,
                              parse, simulated)
from ep_comm.topology.router import Routing, group_limited_topk, node_limited_topk
from ep_comm.topology.traffic import (PLANS, WIRE_FORMATS, TrafficLeg, Traffic, count_matrices,
                              count_traffic, expected_traffic, link_matrix, row_bytes,
                              token_bytes)

__all__ = [
    "CostModel", "Device", "ENV", "TrafficLeg", "H200_DEFAULTS", "LINK_CLASSES",
    "Link", "Node", "PLANS", "Routing", "Topology", "Traffic", "count_matrices", "count_traffic",
    "current", "discover", "expected_traffic", "group_limited_topk", "known", "link_matrix",
    "node_limited_topk", "parse", "row_bytes", "simulated", "token_bytes", "WIRE_FORMATS",
]
