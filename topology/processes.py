"""The processes of a launch: where this one sits, joining them into a ``jax.distributed``
cluster, gathering a value from each, and global arrays from the host values every process holds.

``initialize()`` turns an ``mpirun`` (OpenMPI or MPICH/Hydra) launch into a ``jax.distributed``
cluster: every process sees every device, and CPU collectives go over gloo. Single-process runs need
nothing (it returns without doing anything). Users reach it as ``ep_comm.distributed.initialize``;
it lives here, at the bottom of the stack, because topology discovery and the engine's bootstrap
gather over the processes too (:func:`process_allgather`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import jax
import numpy as np

from ep_comm.topology._checks import positive_int
from ep_comm.topology._jax_compat import distributed_client

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
        positive_int("initialize", "local_device_count", local_device_count)
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


def _bootstrap_how() -> str:
    how = os.environ.get("EP_COMM_BOOTSTRAP", "kv")
    if how not in ("kv", "mpi"):
        raise ValueError(f"EP_COMM_BOOTSTRAP must be 'kv' or 'mpi', got {how!r}")
    return how


def process_allgather(payload: dict, how: str | None = None,
                      what: str = "communicator setup") -> list[dict]:
    """Every process's JSON-able ``payload``, in process order (collective: every process calls
    it, in the same order). ``how``: ``"kv"`` (the ``jax.distributed`` key-value store) or
    ``"mpi"`` (mpi4py); default ``EP_COMM_BOOTSTRAP`` or ``"kv"``."""
    if jax.process_count() == 1:
        return [payload]
    how = how or _bootstrap_how()
    _STATE["generation"] = generation = _STATE.get("generation", 0) + 1
    if how == "mpi":
        from mpi4py import MPI
        got = MPI.COMM_WORLD.allgather((jax.process_index(), payload))
        return [p for _, p in sorted(got, key=lambda t: t[0])]
    client = distributed_client()
    if client is None:
        raise RuntimeError("ep_comm: several JAX processes but jax.distributed is not initialised; "
                           "call ep_comm.distributed.initialize() or set EP_COMM_BOOTSTRAP=mpi")
    prefix = f"ep_comm/bootstrap/{generation}"  # the same in every process: calls are collective
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(payload))
    timeout_ms = int(timeout_s() * 1000)
    out = []
    for p in range(jax.process_count()):
        try:
            out.append(json.loads(client.blocking_key_value_get(f"{prefix}/{p}", timeout_ms)))
        except Exception as e:  # the client raises its own error types
            raise TimeoutError(f"ep_comm bootstrap: process {p} did not publish its {what} "
                               f"within {timeout_ms / 1000:.0f} s ({e}); every process must "
                               f"make the same calls (lower the same program)") from None
    return out


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


def timeout_s() -> float:
    """``EP_COMM_TIMEOUT_S`` (default 300): how long a process waits for its peers."""
    return float(os.environ.get("EP_COMM_TIMEOUT_S", "300"))
