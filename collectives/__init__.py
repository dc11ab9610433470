"""The all-to-all engine: transports that carry a ragged exchange, and the choice between them.

Transports (each a function with ``lax.ragged_all_to_all``'s signature):

- ``"portable"``: fixed-size ``lax.all_to_all`` of per-segment slots (:mod:`ep_comm.collectives.portable`);
  runs on every platform, CPU included; pads every segment to a static slot.
- ``"xla"``: XLA's native ``ragged-all-to-all`` (:mod:`ep_comm.collectives.xla`); GPU and TPU only; moves
  exactly the rows requested.
- ``"nccl"``: the compiled engine on GPUs (:mod:`ep_comm.collectives.native`): NCCL point-to-point of exactly
  the requested bytes on its own CUDA stream, as an async start/done pair of XLA custom calls.
- ``"mpi"``: the same engine on CPUs, over the MPI library mpi4py loads (one device per process,
  under ``mpirun``); it exercises the engine's protocol and error paths without a GPU.

``available()`` says which transports (and which native kernels: the row kernels, the grouped
GEMM) can run on a platform and why the others cannot;
``resolve_transport(backend, platform)`` turns a user's ``backend=`` (including ``"auto"``)
into a transport.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ep_comm.collectives import bootstrap, native, portable, xla
from ep_comm.collectives.bootstrap import finalize  # noqa: F401  (public: collectives.finalize)

__all__ = ["BACKENDS", "auto_choice", "available", "finalize", "resolve_transport"]

BACKENDS = ("auto", "portable", "xla", "mpi", "nccl")

_TRANSPORTS: Mapping[str, Callable] = {
    "portable": portable.ragged_all_to_all,
    "xla": xla.ragged_all_to_all,
    "mpi": native.transport_fn("mpi"),
    "nccl": native.transport_fn("nccl"),
}
_GPU_PLATFORMS = ("cuda", "gpu")

# Platforms whose XLA backend implements the ragged-all-to-all HLO.
_XLA_RAGGED_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")


# The native kernels that are not transports, by the name available() gives them: their module.
_KERNELS = {"row_kernels": "rows", "grouped_gemm": "gemm"}


def _reason(name: str, platform: str) -> str | None:
    """None if transport (or native kernel) ``name`` can run on ``platform``, else why not."""
    if name == "portable":
        return None
    if name in _KERNELS:
        if platform not in _GPU_PLATFORMS:
            what = {"row_kernels": "row kernels run", "grouped_gemm": "grouped GEMM runs"}[name]
            return f"the {what} on CUDA GPUs, not {platform}"
        return bootstrap.load(_KERNELS[name])[1]
    if name == "xla":
        return (None if platform in _XLA_RAGGED_PLATFORMS else
                f"XLA:{platform.upper()} does not implement the ragged-all-to-all HLO")
    platforms = ("cpu",) if name == "mpi" else _GPU_PLATFORMS
    if platform not in platforms:
        return f"the {name} transport runs on {'/'.join(platforms)}, not {platform}"
    return bootstrap.load(name)[1]


def available(platform: str | None = None) -> dict[str, str | None]:
    """Which transports run on ``platform`` (default: JAX's default backend), and which of the
    native kernels that are not transports: ``"row_kernels"`` (dispatch's and combine's CUDA row
    kernels; elsewhere their XLA lowerings run) and ``"grouped_gemm"`` (the CUTLASS grouped GEMM,
    Hopper; ``ep_comm.collectives.grouped_gemm.unavailable_reason`` also checks the GPU).

    Returns a dict ``{name: None if usable else "reason it is not"}``; a part this install was
    built without names why (the binary wheel, for one, holds no MPI transport).
    :func:`auto_choice` says which transport ``backend="auto"`` takes there, and why.
    """
    if platform is None:
        import jax

        platform = jax.default_backend()
    return {name: _reason(name, platform) for name in (*_TRANSPORTS, *_KERNELS)}


def auto_choice(platform: str | None = None) -> tuple[str, str]:
    """``(transport, why)``: what ``backend="auto"`` runs on ``platform`` (default: JAX's default
    backend). GPUs: ``"nccl"`` where the engine is built (XLA's native ragged all-to-all is 28x
    slower than even the portable transport on an H200, see docs/performance.md), else
    ``"portable"``; TPUs: ``"xla"``, XLA's native ragged all-to-all over ICI (exact bytes, no
    padded slots); elsewhere ``"portable"`` (XLA:CPU has no ragged all-to-all; ``"mpi"`` is
    opt-in: it needs one device per process under ``mpirun``)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    if (reason := _reason("nccl", platform)) is None:
        return "nccl", "the compiled NCCL engine is built and this is a GPU"
    if platform == "tpu" and _reason("xla", platform) is None:
        return "xla", "XLA:TPU's native ragged all-to-all moves exactly the rows asked for"
    return "portable", f"nccl: {reason}; the portable transport runs everywhere"


def resolve_transport(backend: str, platform: str | None = None, *, caller: str = "ragged_all_to_all"
            ) -> tuple[str, Callable]:
    """Map ``backend`` to ``(name, transport function)`` for ``platform``.

    ``"auto"`` takes :func:`auto_choice`'s transport. An explicitly requested transport that
    cannot run raises ``ValueError`` with the reason (naming the platform).
    """
    if backend not in BACKENDS:
        raise ValueError(f"{caller}: backend must be one of {BACKENDS}, got {backend!r}")
    if platform is None:
        import jax

        platform = jax.default_backend()
    if backend == "auto":
        backend = auto_choice(platform)[0]
    elif (reason := _reason(backend, platform)) is not None:
        raise ValueError(f"{caller}: backend={backend!r} is not available here: {reason}; "
                         f"use backend='portable' or 'auto'")
    return backend, _TRANSPORTS[backend]
