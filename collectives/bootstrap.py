"""Loading the native engine and bootstrapping its communicators.

The compiled libraries (built from ``collectives/csrc`` by the package build) are optional:
``load("mpi")`` / ``load("nccl")`` return the module or the reason it is not usable, and
:func:`ep_comm.collectives.available` reports those reasons.

Communicators are created when a program that uses a native transport is *lowered* (every process
lowers the same program, so creation is collective), once per set of device groups, and reused by
every later program over the same groups. They are owned by the native registry (RAII state in
C++) and destroyed by :func:`finalize` (also run at interpreter exit).

- MPI: ``MPI.COMM_WORLD.Split`` into one communicator per group, with the axis index as the rank
  key; one device per process (MPI ranks are processes).
- NCCL: the process that owns a group's first device draws an ``ncclUniqueId``; the ids travel
  through the ``jax.distributed`` key-value store (default) or an mpi4py allgather
  (``EP_COMM_BOOTSTRAP=mpi``); every process then creates the communicators of its local devices in
  one NCCL group call (so one process may drive several GPUs). Engine and NCCL versions are
  compared across processes first: a mismatch fails here, not in the first exchange.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import importlib
import json
import os
import threading
import warnings
from typing import Sequence

import jax

from ep_comm.topology._jax_compat import command_buffer_traits
from ep_comm.topology.processes import process_allgather

PROTOCOL = 1  # keep in step with kMagic in csrc/engine/exchange_plan.h ("epc1")

_lock = threading.RLock()
_modules: dict[str, object] = {}
_reasons: dict[str, str] = {}
_registered: set[str] = set()
_comms: dict[int, dict] = {}  # key -> {"transport", "groups", "mpi_comm"?}
_atexit = False


def _preload_nccl() -> None:
    """Load the wheel's libnccl.so.2 globally so that the extension binds to the same library as
    JAX's CUDA plugin (the extension names libnccl.so.2 without a path)."""
    try:
        import nvidia.nccl as wheel
    except ImportError:
        return
    for root in getattr(wheel, "__path__", []):
        path = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def _version(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


@functools.lru_cache(maxsize=None)
def build_info() -> dict | None:
    """What the installed native build holds (``_build_info.json``, written by CMake beside the
    modules): ``built`` (the modules), ``skipped`` ({module: why not}), ``cuda_architectures``,
    ``selftests``, ``wheel``; None where no build installed one (a source tree without a build)."""
    # (each folder of the package: an editable install keeps the built files apart from the
    # sources)
    for folder in importlib.import_module(__package__).__path__:
        try:
            with open(os.path.join(folder, "_build_info.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return None


def load(name: str):
    """Return ``(module, None)`` for the native transport ``name`` ("mpi" or "nccl"), the row
    kernels ("rows") or the grouped GEMM ("gemm"), or ``(None, reason)`` when it is not usable in
    this process."""
    with _lock:
        if name in _modules:
            return _modules[name], None
        if name in _reasons:
            return None, _reasons[name]
        try:
            if name == "nccl":
                _preload_nccl()
            mod = importlib.import_module(f"{__package__}._ep_{name}")
            reason = _check(name, mod)
        except ImportError as e:
            what = {"rows": "row kernels are", "gemm": "grouped GEMM (CUTLASS, sm_90a) is"}.get(
                name, f"{name} transport is")
            skipped = (build_info() or {}).get("skipped", {})
            why = skipped[name] if name in skipped else f"{e}; see docs/native_engine.md"
            mod, reason = None, f"the native {what} not built into this install: {why}"
        if reason is not None:
            _reasons[name] = reason
            return None, reason
        _modules[name] = mod
        return mod, None


def _check(name: str, mod) -> str | None:
    if name in ("rows", "gemm"):
        return None
    if name == "mpi":
        try:
            from mpi4py import MPI
        except ImportError:
            return "mpi4py is not installed (pip install 'ep_comm[mpi]')"
        ours, theirs = mod.library_version().strip(), MPI.Get_library_version().strip()
        if ours != theirs:
            return (f"the engine was built against another MPI library than mpi4py loads "
                    f"({ours.splitlines()[0]!r} vs {theirs.splitlines()[0]!r}); rebuild ep_comm")
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return ("MPI was initialised without MPI_THREAD_MULTIPLE (XLA calls the handler from "
                    "its own threads); do not set mpi4py.rc.thread_level lower")
        return None
    built, runtime = mod.built_version(), mod.runtime_version()
    if runtime // 100 < built // 100:
        return (f"the loaded NCCL {_version(runtime)} is older than the NCCL {_version(built)} "
                f"the engine was built against; rebuild ep_comm against this NCCL")
    if runtime // 100 != built // 100:
        warnings.warn(f"ep_comm: NCCL engine built against NCCL {_version(built)} but NCCL "
                      f"{_version(runtime)} is loaded", RuntimeWarning, stacklevel=3)
    return None


def register_targets(name: str) -> None:
    """Register the transport's FFI handlers with XLA (once)."""
    mod, reason = load(name)
    if mod is None:
        raise RuntimeError(reason)
    with _lock:
        if name in _registered:
            return
        # The row kernels launch shape-determined work and never wait on the host: XLA may put
        # them in its CUDA graphs (one launch for many kernels). Not the others: the GEMM runs
        # CUTLASS's host-side initialize on every call; the NCCL engine's start and done wait on
        # the host.
        platform = "cpu" if name == "mpi" else "CUDA"
        traits = command_buffer_traits() if name == "rows" else {}
        # each module lists its handlers once (csrc/*/handlers.def); handlers() returns them
        for target, capsule in mod.handlers().items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform, **traits)
        _registered.add(name)


def comm_key(transport: str, groups: Sequence[Sequence[jax.Device]]) -> int:
    """Deterministic 62-bit key of a set of device groups (the same in every process)."""
    text = transport + ":" + ";".join(",".join(str(d.id) for d in g) for g in groups)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _agree(transport: str, infos: list[dict]) -> None:
    """Fail when the processes run different engines or libraries."""
    first = {k: v for k, v in infos[0].items() if k != "ids"}
    for p, info in enumerate(infos[1:], 1):
        other = {k: v for k, v in info.items() if k != "ids"}
        if other != first:
            raise RuntimeError(f"ep_comm {transport} bootstrap: process 0 runs {first} but process "
                               f"{p} runs {other}; install the same ep_comm and {transport} "
                               f"everywhere")


def _local_members(groups):
    me = jax.process_index()
    return [(gi, pos, d) for gi, g in enumerate(groups) for pos, d in enumerate(g)
            if d.process_index == me]


def communicator(transport: str, groups: Sequence[Sequence[jax.Device]]) -> int:
    """Create (once) the communicators of ``groups`` for ``transport``; return their key."""
    key = comm_key(transport, groups)
    with _lock:
        if key in _comms:
            return key
        register_targets(transport)
        mod, _ = load(transport)
        if transport == "mpi":
            entry = _bootstrap_mpi(mod, key, groups)
        else:
            entry = _bootstrap_nccl(mod, key, groups)
        _comms[key] = entry
        global _atexit
        if not _atexit:
            atexit.register(finalize)
            _atexit = True
        return key


def _bootstrap_mpi(mod, key, groups) -> dict:
    from mpi4py import MPI
    for g in groups:
        procs = [d.process_index for d in g]
        if len(set(procs)) != len(procs):
            raise ValueError(
                f"backend='mpi' needs one device per process along the exchange axis (MPI ranks are "
                f"processes), but devices {[d.id for d in g]} of one group live in processes "
                f"{procs}; run one CPU device per process (jax_num_cpu_devices=1) or use "
                f"backend='portable'")
    local = _local_members(groups)
    if len(local) > 1:
        raise ValueError(f"backend='mpi' drives one device per process, but process "
                         f"{jax.process_index()} holds {len(local)} devices of the mesh; use "
                         f"backend='portable' or one device per process")
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "backend='mpi' needs MPI initialised with MPI_THREAD_MULTIPLE (XLA:CPU runs "
            f"independent exchanges on several threads), but this MPI runs at thread level "
            f"{MPI.Query_thread()}; leave mpi4py.rc.thread_level at its default 'multiple' or use "
            f"an MPI built with thread support")
    world = MPI.COMM_WORLD
    infos = world.allgather({"protocol": PROTOCOL, "mpi": MPI.Get_library_version().strip(),
                             "groups": len(groups), "group_size": len(groups[0])})
    _agree("mpi", infos)
    gi, pos = (local[0][0], local[0][1]) if local else (MPI.UNDEFINED, 0)
    sub = world.Split(gi, pos)
    if local and (sub.Get_size() != len(groups[gi]) or sub.Get_rank() != pos):
        raise RuntimeError(f"ep_comm mpi bootstrap: the communicator of group {gi} has "
                           f"{sub.Get_size()} ranks (rank {sub.Get_rank()}) but the mesh puts "
                           f"{len(groups[gi])} devices in it (this one at {pos}); are all MPI "
                           f"processes JAX processes of this mesh?")
    if local:
        mod.register_comm(key, MPI._handleof(sub))
    return {"transport": "mpi", "groups": groups, "mpi_comm": sub if local else None}


def _bootstrap_nccl(mod, key, groups) -> dict:
    me = jax.process_index()
    ids = {str(gi): mod.unique_id().hex() for gi, g in enumerate(groups)
           if g[0].process_index == me}
    infos = process_allgather({"protocol": PROTOCOL, "nccl_built": mod.built_version(),
                               "nccl_runtime": mod.runtime_version(), "groups": len(groups),
                               "group_size": len(groups[0]), "ids": ids})
    _agree("nccl", infos)
    all_ids = {}
    for info in infos:
        all_ids.update(info["ids"])
    members = [(d.local_hardware_id, pos, len(groups[gi]), bytes.fromhex(all_ids[str(gi)]))
               for gi, pos, d in _local_members(groups)]
    if members:
        mod.init(key, members)
    return {"transport": "nccl", "groups": groups}


def status(key: int) -> dict[int, str]:
    """Per local device ordinal (0 for MPI): "ok", "missing" or "broken: <why>"."""
    entry = _comms.get(key)
    if entry is None:
        return {}
    mod, _ = load(entry["transport"])
    if entry["transport"] == "mpi":
        return {0: mod.comm_status(key)}
    me = jax.process_index()
    return {d.local_hardware_id: mod.status(key, d.local_hardware_id)
            for g in entry["groups"] for d in g if d.process_index == me}


def finalize() -> None:
    """Destroy every communicator of this process (NCCL comms, MPI sub-communicators) and clear
    JAX's compilation caches, so that the next call of a program lowers it again and so
    bootstraps new communicators (collectively: every process must call finalize)."""
    with _lock:
        if "nccl" in _modules:
            _modules["nccl"].finalize()
        if "mpi" in _modules:
            _modules["mpi"].unregister_all()
            for entry in _comms.values():
                comm = entry.get("mpi_comm")
                if comm is not None:
                    try:
                        comm.Free()
                    except Exception:  # MPI already finalised at exit
                        pass
        _comms.clear()
    try:
        jax.clear_caches()
    except Exception:  # at interpreter exit
        pass
