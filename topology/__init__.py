"""What ep_comm knows about where things live: expert placement today; discovery, node grouping,
routing plans and the cost model as they are built."""

from topology.placement import ExpertPlacement

__all__ = ["ExpertPlacement"]
