"""``ep_comm.ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` on every platform.

Same signature and semantics as :func:`jax.lax.ragged_all_to_all` plus a ``backend=`` choice. The
transports live in :mod:`collectives`; this module validates the call (JAX's own messages for the
checks JAX makes, clear ones for the rest) and hands it to the chosen transport.

Transform rules: both transports are built from differentiable, batchable ``lax`` primitives
(``portable``) or are JAX's own primitive (``xla``), so ``jit``, ``grad`` (w.r.t. ``operand`` and
``output``), ``jvp`` and ``vmap`` work without extra rules. The offsets and sizes are integer
arrays and have no gradient.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import jax.numpy as jnp

import collectives
from ep_comm._compat import axis_size

_API = "ragged_all_to_all"


def _check_index_array(name: str, x) -> None:
    # Messages identical to JAX's abstract-eval checks of ragged_all_to_all.
    if not jnp.issubdtype(x.dtype, np.integer):
        raise ValueError(f"ragged_all_to_all {name} must be integer type.")
    if x.ndim != 1 or x.shape[0] < 1:
        raise ValueError(f"ragged_all_to_all {name} must be rank 1 with positive dimension size, "
                         f"but got shape {tuple(x.shape)}")


def canonical_groups(axis_index_groups, axis_n: int, api_name: str = _API):
    """Validate ``axis_index_groups`` against an axis of ``axis_n`` members; return it as tuples."""
    if axis_index_groups is None:
        return None
    try:
        groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
    except TypeError:
        raise TypeError(f"{api_name}: axis_index_groups must be a list of lists of axis indices, "
                        f"got {axis_index_groups!r}") from None
    if not groups or any(len(g) != len(groups[0]) for g in groups) or not groups[0]:
        raise ValueError(f"{api_name}: axis_index_groups must be non-empty groups of equal size, "
                         f"got sizes {[len(g) for g in groups]}")
    members = sorted(i for g in groups for i in g)
    if members != list(range(axis_n)):
        raise ValueError(f"{api_name}: axis_index_groups must cover every axis index 0..{axis_n - 1} "
                         f"exactly once, got {[list(g) for g in groups]}")
    return groups


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups: Sequence[Sequence[int]] | None = None,
                      backend: str = "auto"):
    """Ragged all-to-all with the exact semantics of :func:`jax.lax.ragged_all_to_all`.

    Must be called inside ``jax.shard_map`` (or another context that binds ``axis_name``).

    Args:
      operand: ``(N, ...)`` rows to send.
      output: ``(M, ...)``, same dtype and trailing shape as ``operand``; received rows are written
        into it, rows nobody writes keep their value.
      input_offsets, send_sizes: ``(K,)`` integer; segment ``i`` is
        ``operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]`` and goes to group member
        ``i // (K // n)`` where ``n`` is the group size.
      output_offsets: ``(K,)`` integer; where segment ``i`` lands in the *receiver's* ``output``.
      recv_sizes: ``(K,)`` integer; rows received in segment ``i`` from member ``i // (K // n)``.
      axis_name: mesh axis name (or tuple of names) to exchange over.
      axis_index_groups: optional partition of the axis indices into equal-size groups; the
        exchange runs inside each group and offsets index group members.
      backend: ``"auto"`` (``nccl`` on GPUs where the engine is built, else ``portable``),
        ``"portable"`` (padded ``all_to_all``, every platform), ``"xla"`` (XLA's native op,
        GPU/TPU only, exact bytes but slow on GPUs today; see the README's numbers), ``"nccl"``
        (the compiled engine, GPUs) or ``"mpi"`` (the compiled engine over MPI, CPU, one device
        per process under ``mpirun``).

    Returns:
      ``(M, ...)`` array: ``output`` with the received segments written in.
    """
    return _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, axis_name=axis_name, axis_index_groups=axis_index_groups,
                              backend=backend)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                       axis_name, axis_index_groups=None, backend="auto",
                       max_segment_rows: int | None = None, label: str = _API, tag: int = 0):
    """:func:`ragged_all_to_all` plus what dispatch and combine know: ``max_segment_rows``, a
    static bound on every ``send_sizes`` entry (the portable transport sizes its slots with it);
    ``label``, the operation's name in errors and profiles; ``tag``, a fingerprint of the caller's
    configuration that the native engine compares across ranks."""
    operand = jnp.asarray(operand)
    output = jnp.asarray(output)
    index_arrays = tuple(map(jnp.asarray, (input_offsets, send_sizes, output_offsets, recv_sizes)))
    for name, x in zip(("input_offsets", "send_sizes", "output_offsets", "recv_sizes"),
                       index_arrays, strict=True):
        _check_index_array(name, x)
    if operand.ndim < 1 or output.ndim < 1:
        raise ValueError(f"{_API}: operand and output must have a leading row axis, got shapes "
                         f"{operand.shape} and {output.shape}")
    if operand.dtype != output.dtype:
        raise ValueError(f"{_API}: operand and output must have the same dtype, got "
                         f"{operand.dtype} and {output.dtype}")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"{_API}: operand and output must agree on every dimension but the first, "
                         f"got shapes {operand.shape} and {output.shape}")
    lengths = {a.shape[0] for a in index_arrays}
    if len(lengths) != 1:
        raise ValueError(f"{_API}: input_offsets, send_sizes, output_offsets and recv_sizes must "
                         f"have the same length, got "
                         f"{', '.join(str(tuple(a.shape)) for a in index_arrays)}")
    _, transport = collectives.resolve(backend, caller=_API)
    axis_n = axis_size(axis_name, _API)
    groups = canonical_groups(axis_index_groups, axis_n)
    group_n = len(groups[0]) if groups else axis_n
    (k,) = lengths
    if k % group_n:
        raise ValueError(f"{_API}: the offsets and sizes have length {k}, which is not a multiple of "
                         f"the number of participants {group_n} (axis {axis_name!r}"
                         f"{' groups' if groups else ''})")
    return transport(operand, output, *index_arrays, axis_name=axis_name,
                     axis_index_groups=[list(g) for g in groups] if groups else None,
                     max_segment_rows=max_segment_rows, label=label, tag=tag)
