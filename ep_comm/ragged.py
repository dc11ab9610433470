"""``ep_comm.ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` on every platform.

Same signature and semantics as :func:`jax.lax.ragged_all_to_all` plus a ``backend=`` choice. The
transports live in :mod:`ep_comm.collectives`; this module validates the call (JAX's own messages for the
checks JAX makes, clear ones for the rest) and hands it to the chosen transport.

Transform rules: of the four transports, ``portable`` is built from differentiable, batchable
``lax`` primitives and ``xla`` is JAX's own primitive; ``nccl`` and ``mpi`` are the engine's
primitive, which carries jvp, transpose and batching rules of its own (:mod:`ep_comm.collectives.native`).
So ``jit``, ``grad`` (w.r.t. ``operand`` and ``output``), ``jvp`` and ``vmap`` work on every one.
The offsets and sizes are integer arrays and have no gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp

from ep_comm import collectives
from ep_comm.topology._jax_compat import axis_size

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
      backend: ``"auto"`` (``nccl`` on GPUs where the engine is built, ``xla`` on TPUs, else
        ``portable``: :func:`ep_comm.collectives.auto_choice`),
        ``"portable"`` (padded ``all_to_all``, every platform), ``"xla"`` (XLA's native op,
        GPU/TPU only, exact bytes but slow on GPUs today; see docs/performance.md), ``"nccl"``
        (the compiled engine, GPUs) or ``"mpi"`` (the compiled engine over MPI, CPU, one device
        per process under ``mpirun``).

    Returns:
      ``(M, ...)`` array: ``output`` with the received segments written in.
    """
    return _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, axis_name=axis_name, axis_index_groups=axis_index_groups,
                              backend=backend)


def _validate(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
              axis_index_groups, backend, api=_API):
    """Check a call; returns (operand, output, index arrays, backend name, transport, groups)."""
    operand = jnp.asarray(operand)
    output = jnp.asarray(output)
    index_arrays = tuple(map(jnp.asarray, (input_offsets, send_sizes, output_offsets, recv_sizes)))
    for name, x in zip(("input_offsets", "send_sizes", "output_offsets", "recv_sizes"),
                       index_arrays, strict=True):
        _check_index_array(name, x)
    if operand.ndim < 1 or output.ndim < 1:
        raise ValueError(f"{api}: operand and output must have a leading row axis, got shapes "
                         f"{operand.shape} and {output.shape}")
    if operand.dtype != output.dtype:
        raise ValueError(f"{api}: operand and output must have the same dtype, got "
                         f"{operand.dtype} and {output.dtype}")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"{api}: operand and output must agree on every dimension but the first, "
                         f"got shapes {operand.shape} and {output.shape}")
    lengths = {a.shape[0] for a in index_arrays}
    if len(lengths) != 1:
        raise ValueError(f"{api}: input_offsets, send_sizes, output_offsets and recv_sizes must "
                         f"have the same length, got "
                         f"{', '.join(str(tuple(a.shape)) for a in index_arrays)}")
    name, transport = collectives.resolve_transport(backend, caller=api)
    axis_n = axis_size(axis_name, api)
    groups = canonical_groups(axis_index_groups, axis_n, api)
    group_n = len(groups[0]) if groups else axis_n
    (k,) = lengths
    if k % group_n:
        raise ValueError(f"{api}: the offsets and sizes have length {k}, which is not a multiple of "
                         f"the number of participants {group_n} (axis {axis_name!r}"
                         f"{' groups' if groups else ''})")
    return (operand, output, index_arrays, name, transport,
            [list(g) for g in groups] if groups else None)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                       axis_name, axis_index_groups=None, backend="auto",
                       max_segment_rows: int | None = None, label: str = _API, tag: int = 0):
    """:func:`ragged_all_to_all` plus what dispatch and combine know: ``max_segment_rows``, a
    static bound on every ``send_sizes`` entry (the portable transport sizes its slots with it);
    ``label``, the operation's name in errors and profiles; ``tag``, a fingerprint of the caller's
    configuration that the native engine compares across ranks."""
    operand, output, idx, _, transport, groups = _validate(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
        axis_index_groups, backend)
    return transport(operand, output, *idx, axis_name=axis_name, axis_index_groups=groups,
                     max_segment_rows=max_segment_rows, label=label, tag=tag)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingExchange:
    """An exchange issued by :func:`ragged_all_to_all_start`; pass it to
    :func:`ragged_all_to_all_done`. Its arrays are the engine's (the result being written, its
    metadata workspace, and the inputs kept alive until done); do not read them."""
    result: jax.Array
    workspace: jax.Array
    keep: tuple
    params: tuple = dataclasses.field(metadata=dict(static=True))  # hashable (key, value) pairs


def ragged_all_to_all_start(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name, axis_index_groups=None,
                            backend: str = "auto") -> PendingExchange:
    """Issue :func:`ragged_all_to_all` and return at once; finish with
    :func:`ragged_all_to_all_done`.

    With ``backend="nccl"`` the exchange runs on the engine's own CUDA stream from start to done,
    so work issued in between overlaps it. To keep XLA from moving that work before start or after
    done, thread it through ``lax.optimization_barrier`` together with the pending exchange (see
    ``collectives/bench.py``). Other backends do the whole exchange in start. Not differentiable:
    use :func:`ragged_all_to_all` under ``grad``.
    """
    return _ragged_all_to_all_start(operand, output, input_offsets, send_sizes, output_offsets,
                                    recv_sizes, axis_name=axis_name,
                                    axis_index_groups=axis_index_groups, backend=backend,
                                    api="ragged_all_to_all_start")


def _ragged_all_to_all_start(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name, axis_index_groups=None, backend="auto",
                             max_segment_rows: int | None = None, label: str | None = None,
                             tag: int = 0, api: str = _API) -> PendingExchange:
    """:func:`ragged_all_to_all_start` plus :func:`_ragged_all_to_all`'s ``max_segment_rows``,
    ``label`` and ``tag``."""
    operand, output, idx, name, transport, groups = _validate(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
        axis_index_groups, backend, api)
    label = label or _API
    if name in collectives.native.TRANSPORTS:
        result, ws, keep, params = collectives.native.exchange_start(
            name, operand, output, *idx, axis_name=axis_name, axis_index_groups=groups,
            label=label, tag=tag)
        return PendingExchange(result, ws, keep, tuple(sorted(params.items())))
    result = transport(operand, output, *idx, axis_name=axis_name, axis_index_groups=groups,
                       max_segment_rows=max_segment_rows, label=label, tag=tag)
    return PendingExchange(result, jnp.zeros((0,), jnp.int32), (), ())


def ragged_all_to_all_done(pending: PendingExchange):
    """Wait for an exchange issued by :func:`ragged_all_to_all_start`; returns its output."""
    if not isinstance(pending, PendingExchange):
        raise TypeError(f"ragged_all_to_all_done: expected the PendingExchange returned by "
                        f"ragged_all_to_all_start, got {type(pending).__name__}")
    if not pending.params:
        return pending.result
    return collectives.native.exchange_done(pending.result, pending.workspace, pending.keep,
                                            dict(pending.params))
