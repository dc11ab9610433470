"""Multi-process set-up and helpers for global arrays.

``initialize()`` turns an ``mpirun`` (OpenMPI or MPICH/Hydra) launch into a ``jax.distributed``
cluster: every process sees every device, and CPU collectives go over gloo. Single-process runs need
nothing (it returns without doing anything), so the same script runs both ways::

    import ep_comm
    ep_comm.distributed.initialize(local_device_count=2)   # before any other JAX call
    mesh = jax.make_mesh((jax.device_count(),), ("ep",))
"""

from __future__ import annotations

import dataclasses
import os
import socket

import jax
import numpy as np

_STATE: dict = {}


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the launch: ``launcher`` is ``"openmpi"``, ``"mpich"`` or
    ``"single"``."""

    launcher: str
    process_id: int
    num_processes: int


def launch_info(environ=None) -> LaunchInfo:
    """Read the MPI launcher's environment (no MPI call, no JAX call)."""
    env = os.environ if environ is None else environ
    for launcher, rank_var, size_var in (("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                         ("mpich", "PMI_RANK", "PMI_SIZE")):
        if rank_var in env and size_var in env:
            rank, size = int(env[rank_var]), int(env[size_var])
            if not 0 <= rank < size:
                raise RuntimeError(f"ep_comm.distributed: {rank_var}={rank} is not in "
                                   f"[0, {size_var}={size})")
            return LaunchInfo(launcher, rank, size)
    return LaunchInfo("single", 0, 1)


def _coordinator_from_mpi(info: LaunchInfo) -> str:
    """Rank 0 picks a free port and broadcasts ``host:port`` over MPI."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.num_processes:
        raise RuntimeError(f"ep_comm.distributed: MPI reports {comm.Get_size()} processes but the "
                           f"launcher environment says {info.num_processes}")
    single_host = len(set(comm.allgather(socket.gethostname()))) == 1
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        address = f"{'127.0.0.1' if single_host else socket.gethostname()}:{port}"
    return comm.bcast(address, root=0)


def initialize(local_device_count: int | None = None, coordinator_address: str | None = None,
               timeout_s: int = 300) -> LaunchInfo:
    """Join the ``jax.distributed`` cluster of an ``mpirun`` launch; no-op for a single process.

    Args:
      local_device_count: CPU devices per process (``jax_num_cpu_devices``); ``None`` keeps JAX's
        default (one, or what ``XLA_FLAGS=--xla_force_host_platform_device_count`` says).
      coordinator_address: ``host:port`` of process 0's coordinator; default: agreed over mpi4py.
      timeout_s: how long to wait for every process to join before failing.

    Must run before any other JAX call that touches devices. Returns the :class:`LaunchInfo`.
    """
    info = launch_info()
    if local_device_count is not None:
        if isinstance(local_device_count, bool) or not isinstance(local_device_count, int) \
                or local_device_count < 1:
            raise ValueError(f"initialize: local_device_count must be a positive int, got "
                             f"{local_device_count!r}")
        jax.config.update("jax_num_cpu_devices", local_device_count)
    if info.num_processes == 1:
        return info
    if _STATE.get("info") is not None:
        return _STATE["info"]
    if coordinator_address is None:
        try:
            coordinator_address = _coordinator_from_mpi(info)
        except ImportError:
            raise RuntimeError("ep_comm.distributed.initialize: running under mpirun with "
                               f"{info.num_processes} processes but mpi4py is not installed; "
                               "`pip install mpi4py` or pass coordinator_address='host:port'"
                               ) from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=info.num_processes, process_id=info.process_id,
                               initialization_timeout=timeout_s)
    _STATE["info"] = info
    return info


def global_array(host_array, sharding) -> jax.Array:
    """Build a global ``jax.Array`` from the full host array every process holds (same values)."""
    host_array = np.asarray(host_array)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda idx: host_array[idx])


def to_host(array) -> np.ndarray:
    """The full value of a global array on every process (all-gathers across processes)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
