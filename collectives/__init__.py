"""The all-to-all engine: transports that carry a ragged exchange, and the choice between them.

Transports (each a function with ``lax.ragged_all_to_all``'s signature):

- ``"portable"``: fixed-size ``lax.all_to_all`` of per-segment slots (:mod:`collectives.portable`);
  runs on every platform, CPU included; pads every segment to a static slot.
- ``"xla"``: XLA's native ``ragged-all-to-all`` (:mod:`collectives.xla`); GPU and TPU only; moves
  exactly the rows requested.

``available()`` says which transports can run on a platform and why the others cannot;
``resolve(backend, platform)`` turns a user's ``backend=`` (including ``"auto"``) into a transport.
"""

from __future__ import annotations

from typing import Callable, Mapping

from collectives import portable, xla

BACKENDS = ("auto", "portable", "xla")

_TRANSPORTS: Mapping[str, Callable] = {
    "portable": portable.ragged_all_to_all,
    "xla": xla.ragged_all_to_all,
}

# Platforms whose XLA backend implements the ragged-all-to-all HLO.
_XLA_RAGGED_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")


def available(platform: str | None = None) -> dict[str, str | None]:
    """Which transports run on ``platform`` (default: JAX's default backend).

    Returns a dict ``{transport: None if usable else "reason it is not"}``.
    """
    if platform is None:
        import jax

        platform = jax.default_backend()
    reasons: dict[str, str | None] = {"portable": None}
    reasons["xla"] = (None if platform in _XLA_RAGGED_PLATFORMS else
                      f"XLA:{platform.upper()} does not implement the ragged-all-to-all HLO")
    return reasons


def resolve(backend: str, platform: str | None = None, *, caller: str = "ragged_all_to_all"
            ) -> tuple[str, Callable]:
    """Map ``backend`` to ``(name, transport function)`` for ``platform``.

    ``"auto"`` picks ``"portable"`` everywhere for now: measured on one H200 (``python -m
    ep_comm.bench``, 4096 tokens x 7168 bf16), XLA's native ragged all-to-all took 22.8 ms for a
    dispatch that the portable transport does in 0.8 ms (see README). The NCCL engine will take
    over ``"auto"`` on GPUs. An explicitly requested transport that cannot run raises
    ``ValueError`` with the reason.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{caller}: backend must be one of {BACKENDS}, got {backend!r}")
    reasons = available(platform)
    if backend == "auto":
        backend = "portable"
    elif reasons[backend] is not None:
        raise ValueError(f"{caller}: backend={backend!r} is not available here: {reasons[backend]}; "
                         f"use backend='portable' or 'auto'")
    return backend, _TRANSPORTS[backend]
