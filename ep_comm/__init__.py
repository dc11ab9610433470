"""ep_comm: dropless expert-parallel communication for JAX.

Public API (everything else is private):

- :func:`ragged_all_to_all` -- ``jax.lax.ragged_all_to_all`` on every platform, ``backend=`` choice.
- :func:`ragged_all_to_all_start` / :func:`ragged_all_to_all_done` (:class:`PendingExchange`) --
  the same exchange split in two, so that work placed in between overlaps it.
- :class:`EPConfig`, :func:`dispatch_layout`, :func:`dispatch`, :func:`combine`, :class:`EPHandle`,
  :func:`check`, :func:`checked`, :class:`EPOverflowError`, :class:`EPInvalidIdsWarning` -- the
  MoE token exchange, and run-time errors a caller can catch; :func:`link_bytes` -- what
  it sent over each link class; :mod:`ep_comm.plan` -- flat or hierarchical (two-stage) route.
- :func:`moe_layer` (:class:`MoEOutput`, :func:`swiglu_experts`) -- the whole MoE FFN in one
  call; :func:`grouped_matmul` -- the experts' GEMM (``ragged_dot`` semantics, fast kernels);
  ``ep_comm.nnx.MoE`` -- a Flax NNX module over it (needs flax).
- :mod:`ep_comm.distributed` -- multi-process set-up (``mpirun``) and global-array helpers.
"""

from ep_comm import distributed
from ep_comm.config import EPConfig
from ep_comm.layout import DispatchLayout, dispatch_layout
from ep_comm import plan
from ep_comm.gemm import grouped_matmul
from ep_comm.handle import EPHandle, link_bytes
from ep_comm.layer import MoEOutput, moe_layer, swiglu_experts
from ep_comm.dispatch_combine import combine, dispatch
from ep_comm.overflow import EPInvalidIdsWarning, EPOverflowError, check, checked
from ep_comm.ragged import (PendingExchange, ragged_all_to_all, ragged_all_to_all_done,
                            ragged_all_to_all_start)

__all__ = [
    "DispatchLayout",
    "EPConfig",
    "EPHandle",
    "EPInvalidIdsWarning",
    "EPOverflowError",
    "MoEOutput",
    "PendingExchange",
    "check",
    "checked",
    "combine",
    "dispatch",
    "dispatch_layout",
    "distributed",
    "grouped_matmul",
    "link_bytes",
    "moe_layer",
    "plan",
    "ragged_all_to_all",
    "ragged_all_to_all_done",
    "ragged_all_to_all_start",
    "swiglu_experts",
]
