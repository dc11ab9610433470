"""ep_comm: dropless expert-parallel communication for JAX.

Public API (everything else is private):

- :func:`ragged_all_to_all` -- ``jax.lax.ragged_all_to_all`` on every platform, ``backend=`` choice.
- :class:`EPConfig`, :func:`dispatch_layout`, :func:`dispatch`, :func:`combine`, :class:`EPHandle`,
  :func:`check`, :class:`EPOverflowError` -- the MoE token exchange.
- :mod:`ep_comm.distributed` -- multi-process set-up (``mpirun``) and global-array helpers.
"""

from ep_comm import distributed
from ep_comm.config import EPConfig
from ep_comm.layout import DispatchLayout, dispatch_layout
from ep_comm.moe import EPHandle, EPOverflowError, check, combine, dispatch
from ep_comm.ragged import ragged_all_to_all

__all__ = [
    "DispatchLayout",
    "EPConfig",
    "EPHandle",
    "EPOverflowError",
    "check",
    "combine",
    "dispatch",
    "dispatch_layout",
    "distributed",
    "ragged_all_to_all",
]
