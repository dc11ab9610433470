"""Multi-process set-up and helpers for global arrays.

Everything here is :mod:`ep_comm.topology.processes`' (the bottom of the stack, where topology discovery,
the engine's bootstrap and its benchmark use it too), re-exported for users.

``initialize()`` turns an ``mpirun`` (OpenMPI or MPICH/Hydra) launch into a ``jax.distributed``
cluster: every process sees every device, and CPU collectives go over gloo. Single-process runs need
nothing (it returns without doing anything), so the same script runs both ways::

    import ep_comm
    ep_comm.distributed.initialize(local_device_count=2)   # before any other JAX call
    mesh = jax.make_mesh((jax.device_count(),), ("ep",))
"""

from __future__ import annotations

from ep_comm.topology.processes import LaunchInfo, global_array, initialize, launch_info, to_host

__all__ = ["LaunchInfo", "global_array", "initialize", "launch_info", "to_host"]
