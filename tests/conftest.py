"""Shared test set-up: one expert-parallel mesh over every device, single- or multi-process.

Single process: ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` gives 8 CPU devices.
Under ``mpirun -n N``: ``ep_comm.distributed.initialize`` joins the processes (gloo), each with
``EP_COMM_CPU_DEVICES`` devices (default 2). Every test builds the same full numpy inputs on every
process (seeds are agreed across processes), runs on the global mesh and compares the full results.

Seeds: every run draws a fresh base seed, prints it in the header and exports it as
``EP_COMM_TEST_SEED`` (so subprocesses and pytest-xdist workers share it); setting
``EP_COMM_TEST_SEED`` replays a run. The ``rng`` fixture and the hypothesis search both derive
from it.

Markers: ``multiprocess`` marks the tests whose outcome depends on running as several processes
(the native MPI engine, bootstrap and launch helpers, the exchanges and dispatch/combine
equalities across process boundaries and at other rank counts). ``scripts/run.sh test`` runs
the whole suite once on 8 devices and only these under ``mpirun``. ``processes`` marks those
that depend on the number of processes itself (launch, bootstrap, barrier, discovery, and every
case of the MPI transport, one process per rank: added here); the fast command's ``mpirun -n 2``
and ``-n 4`` phases run them, its 2 x 2 phase every multiprocess test. ``full`` marks the tests
and parameters that only the exhaustive matrices run (``scripts/run.sh test-full``, or
``EP_COMM_TEST_FULL=1``): the fast command deselects them. :func:`matrix` parametrizes over a
cartesian product whose fast part is a covering set (docs/testing.md).

The run ends with the compiled programs per test file and the slowest tests
(``compile_accounting``).
"""

from __future__ import annotations

import itertools
import os
import zlib

import numpy as np
import pytest

import ep_comm

_INFO = ep_comm.distributed.initialize(
    local_device_count=(int(os.environ.get("EP_COMM_CPU_DEVICES", "2"))
                        if ep_comm.distributed.launch_info().num_processes > 1 else None))

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

if jax.default_backend() == "tpu":  # float32 references: TPUs' default matmul rounds to bf16
    jax.config.update("jax_default_matmul_precision", "highest")

# the compile accounting's hooks (pytest finds them by name in this module)
from compile_accounting import (  # noqa: E402, F401
    pytest_runtest_protocol, pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown)

AXIS = "ep"
if os.environ.get("EP_COMM_TEST_COMPILE_CACHE") and _INFO.num_processes == 1:
    # Repeated runs of the same programs (scripts/seed_sweep.sh: only the data changes) load them
    # from JAX's persistent compilation cache instead of compiling them again. Single process
    # only: tried under mpirun (with jax_share_binary_between_hosts, so that one process compiles
    # for all), the first tests failed and the run hung; mpirun runs stay uncached.
    jax.config.update("jax_compilation_cache_dir", os.environ["EP_COMM_TEST_COMPILE_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Tests compare against float64 references; on GPUs XLA's default float32 matmul is TF32.
jax.config.update("jax_default_matmul_precision", "highest")


def _base_seed() -> int:
    if "EP_COMM_TEST_SEED" in os.environ:
        return int(os.environ["EP_COMM_TEST_SEED"])
    seed = int.from_bytes(os.urandom(4), "little")
    if _INFO.num_processes > 1:
        from mpi4py import MPI

        seed = MPI.COMM_WORLD.bcast(seed, root=0)
    return seed


BASE_SEED = _base_seed()
# Subprocesses a test starts (and pytest-xdist workers) inherit the seed.
os.environ["EP_COMM_TEST_SEED"] = str(BASE_SEED)

# Every transport the suite knows; BACKENDS (below) are those that run in this process.
ALL_BACKENDS = ["portable", "xla", "mpi", "nccl"]

# The exhaustive matrices (scripts/run.sh test-full) or the fast covering sets (scripts/run.sh
# test).
FULL = os.environ.get("EP_COMM_TEST_FULL", "0") not in ("", "0")
full = pytest.mark.full  # a test or parameter that only test-full runs


def covering(*axes, strength: int = 2) -> list[int]:
    """Indices into ``itertools.product(*axes)`` of a covering set: every combination of values
    of any ``strength`` axes (2: pairwise, 1: each value once) appears in at least one case.
    Greedy, deterministic, starting from the product's first case."""
    product = list(itertools.product(*axes))
    sets = list(itertools.combinations(range(len(axes)), min(strength, len(axes))))

    def tuples(case):
        return {(s, tuple(case[i] for i in s)) for s in sets}

    want = set().union(*(tuples(c) for c in product)) if product else set()
    keep = []
    while want:
        k = max((k for k in range(len(product)) if k not in keep),
                key=lambda k: (len(tuples(product[k]) & want), -k))
        keep.append(k)
        want -= tuples(product[k])
    return sorted(keep)


def matrix(names: str, *axes, strength: int = 2):
    """``pytest.mark.parametrize(names, ...)`` over the cartesian product of ``axes``; the cases
    outside :func:`covering`'s set are marked :data:`full` (the fast command leaves them out)."""
    keep = set(covering(*axes, strength=strength))
    params = [pytest.param(*c, marks=() if k in keep else full)
              for k, c in enumerate(itertools.product(*axes))]
    return pytest.mark.parametrize(names, params)


def backend_skip_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run in this test process (None: it can)."""
    from ep_comm import collectives
    why = collectives.available()[backend]
    if why is None and backend == "mpi" and jax.local_device_count() != 1:
        why = ("backend='mpi' needs one device per process (mpirun with EP_COMM_CPU_DEVICES=1); "
               f"this process has {jax.local_device_count()}")
    return why


# Parametrizations use the transports that run in this process (a parameter that could only skip
# is not collected; the header names the others and why they cannot run here) and the device
# count of this run.
BACKENDS = [b for b in ALL_BACKENDS if backend_skip_reason(b) is None]
N_DEVICES = jax.device_count()


def pytest_report_header(config):
    return (f"ep_comm: {jax.device_count()} devices ({jax.default_backend()}), "
            f"process {_INFO.process_id}/{_INFO.num_processes} ({_INFO.launcher}); "
            f"EP_COMM_TEST_SEED={BASE_SEED}; transports {BACKENDS}"
            + "".join(f"; not {b}: {backend_skip_reason(b)}" for b in ALL_BACKENDS
                      if b not in BACKENDS) + "; "
            + ("full matrices (EP_COMM_TEST_FULL=1)" if FULL else
               "fast covering sets (EP_COMM_TEST_FULL=1 runs the full matrices)"))


def pytest_collection_modifyitems(config, items):
    for it in items:  # the MPI transport (one process per rank) depends on the process count
        params = getattr(it, "callspec", None)
        if params and "mpi" in (params.params.get("backend"), params.params.get("native")):
            it.add_marker(pytest.mark.processes)
    if FULL:
        return
    left_out = [it for it in items if it.get_closest_marker("full")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [it for it in items if not it.get_closest_marker("full")]


@pytest.fixture
def rng(request):
    """Fresh per run (``EP_COMM_TEST_SEED`` reproduces a run), identical on every process."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**32
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def mesh():
    return jax.make_mesh((jax.device_count(),), (AXIS,),
                         axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="session")
def n(mesh):
    return mesh.shape[AXIS]


class Sharded:
    """Helpers to move full host arrays onto the mesh (split along rows) and back."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.rows = NamedSharding(mesh, P(AXIS))
        self.replicated = NamedSharding(mesh, P())

    def put(self, *arrays):
        out = tuple(ep_comm.distributed.global_array(a, self.rows) for a in arrays)
        return out if len(out) > 1 else out[0]

    def put_replicated(self, a):
        return ep_comm.distributed.global_array(a, self.replicated)

    def get(self, tree):
        return jax.tree.map(ep_comm.distributed.to_host, tree)

    def smap(self, f):
        """jit(shard_map(f)) with every input and output split along rows over the mesh."""
        return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


@pytest.fixture(scope="session")
def sharded(mesh):
    return Sharded(mesh)
