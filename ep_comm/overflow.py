"""Overflow is never silent: :class:`EPOverflowError`, :func:`check` on a handle, and the run-time
check that ``EPConfig(overflow="raise")`` inserts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ep_comm.config import EPConfig
from ep_comm.handle import EPHandle
from ep_comm.routes import gather_counts
from topology.jax_compat import is_tracer


class EPOverflowError(RuntimeError):
    """(token, expert) pairs were dropped (a user-set ``recv_capacity`` overflowed) or expert ids
    were out of range."""


def _raise_if_bad(num_dropped, num_invalid, config: EPConfig):
    dropped = np.asarray(num_dropped).reshape(-1)
    invalid = np.asarray(num_invalid).reshape(-1)
    if dropped.sum() == 0 and invalid.sum() == 0:
        return
    parts = []
    if dropped.sum():
        ranks = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(dropped) if v)
        parts.append(f"dropped {int(dropped.sum())} (token, expert) pairs ({ranks}): the expert "
                     f"buffer holds recv_capacity={config.expert_rows} rows per rank; the dropless "
                     f"worst case is {config.worst_case_rows} (EPConfig(recv_capacity=None))")
    if invalid.sum():
        parts.append(f"{int(invalid.sum())} expert ids outside [-1, {config.num_experts}) were not "
                     f"routed")
    raise EPOverflowError("ep_comm dispatch " + "; ".join(parts))


def runtime_check(handle: EPHandle) -> EPHandle:
    """Inside shard_map: raise EPOverflowError at run time when anything was dropped."""
    cfg = handle.config
    # (n, 2): per-rank counts, identical on all ranks
    everyone = gather_counts(cfg, jnp.concatenate([handle.num_dropped, handle.num_invalid]),
                             "dispatch (overflow check)")

    def host_check(counts):
        _raise_if_bad(counts[:, 0], counts[:, 1], cfg)
        return np.zeros((1,), np.int32)

    ok = io_callback(host_check, jax.ShapeDtypeStruct((1,), jnp.int32), everyone)
    return dataclasses.replace(handle, num_dropped=handle.num_dropped + ok)


def check(handle: EPHandle) -> EPHandle:
    """Raise :class:`EPOverflowError` if dispatch dropped any pair or saw out-of-range ids.

    On a concrete handle (returned from ``shard_map``/``jit`` with ``out_specs=P(axis)``) it checks
    now and names the ranks. Inside ``shard_map`` it inserts a run-time check (the error surfaces
    when the results are computed) and returns the handle, which must be used for the check to stay
    in the program.
    """
    if not isinstance(handle, EPHandle):
        raise TypeError(f"check: expected an ep_comm.EPHandle, got {type(handle).__name__}")
    if is_tracer(handle.num_dropped):
        return runtime_check(handle)
    if not getattr(handle.num_dropped, "is_fully_addressable", True):
        from jax.experimental import multihost_utils
        dropped, invalid = multihost_utils.process_allgather(
            (handle.num_dropped, handle.num_invalid), tiled=True)
    else:
        dropped, invalid = handle.num_dropped, handle.num_invalid
    _raise_if_bad(dropped, invalid, handle.config)
    return handle
