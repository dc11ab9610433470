"""Nothing is dropped or misrouted silently: :class:`EPOverflowError`, :func:`check` on a handle,
the run-time reports dispatch inserts, and :func:`checked`, which turns a run-time report into an
exception the caller can catch.

Two things can go wrong at run time, both data, so both are found while the program runs:

- **expert ids out of range** in ``topk_ids`` (outside ``[-1, num_experts)``): a bug in the
  caller. ``EPConfig.invalid_ids`` says what happens: ``"warn"`` (the default: an
  :class:`EPInvalidIdsWarning` once per program, with the count, the first bad id and its rank),
  ``"raise"`` (the default with ``overflow="raise"``) or ``"ignore"``;
- **pairs dropped** by a user-set ``recv_capacity``: counted in the handle (``overflow="count"``,
  the default) or raised (``overflow="raise"``).

Every rank learns every rank's counts with dispatch's gather of the traffic counts (the ids) or one
more small gather (the drops), and a host callback runs only in a step where a count is not zero
(``lax.cond``: a step without a problem pays the predicate, not the callback).

A host callback cannot raise an exception of its own type out of a JAX program: JAX fails the
program with a ``JaxRuntimeError`` holding the callback's message. So a report that must raise
does it in one of two ways:

- inside :func:`checked` (``step = ep_comm.checked(jax.jit(train_step))``), the callback records
  the error and the program runs to its end; ``checked`` waits for the step and raises the
  :class:`EPOverflowError` itself, once per step, in every process;
- elsewhere the callback raises, on every device (so that no device goes on to a collective its
  peers never join), and the program fails with a ``JaxRuntimeError`` that holds the message; the
  per-device tracebacks JAX logs for these errors are left out (the message is in the error).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ep_comm.config import EPConfig
from ep_comm.handle import EPHandle
from ep_comm.routes import gather_counts
from ep_comm.topology._jax_compat import is_tracer, match_vma


class EPOverflowError(RuntimeError):
    """(token, expert) pairs were dropped (a user-set ``recv_capacity`` overflowed) or expert ids
    in ``topk_ids`` were out of range."""


class EPInvalidIdsWarning(UserWarning):
    """``topk_ids`` held expert ids outside ``[-1, num_experts)`` (not routed); given once per
    program (``EPConfig(invalid_ids="ignore")`` silences it, ``"raise"`` raises instead)."""


# --- the messages -----------------------------------------------------------------------------

def invalid_ids_message(rows, config: EPConfig) -> str | None:
    """The report of ``rows``: ``(n, 4)`` per rank ``[count, token, k, value]`` of its first id
    outside ``[-1, num_experts)`` (see :func:`first_invalid`); ``None`` when there is none."""
    rows = np.asarray(rows).reshape(-1, 4)
    counts = rows[:, 0]
    if not counts.sum():
        return None
    r = int(np.flatnonzero(counts)[0])
    _, t, k, v = (int(a) for a in rows[r])
    ranks = ", ".join(f"rank {i}: {int(c)}" for i, c in enumerate(counts) if c)
    return (f"topk_ids holds {int(counts.sum())} expert ids outside [-1, {config.num_experts}) "
            f"({ranks} of mesh axis {config.axis_name!r}), which were not routed; the first: "
            f"topk_ids[{t}, {k}] = {v} on rank {r}")


def dropped_message(dropped, config: EPConfig) -> str | None:
    """The report of ``dropped``: ``(n,)`` pairs each rank did not keep; ``None`` when none."""
    dropped = np.asarray(dropped).reshape(-1)
    if not dropped.sum():
        return None
    ranks = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(dropped) if v)
    return (f"dropped {int(dropped.sum())} (token, expert) pairs ({ranks}): the expert buffer "
            f"holds recv_capacity={config.expert_rows} rows per rank; the dropless worst case is "
            f"{config.worst_case_rows} (EPConfig(recv_capacity=None))")


def _error(parts) -> EPOverflowError | None:
    parts = [p for p in parts if p]
    return EPOverflowError("ep_comm dispatch: " + "; ".join(parts)) if parts else None


# --- in the program ---------------------------------------------------------------------------

def first_invalid(topk_ids, num_experts: int) -> jax.Array:
    """``(4,)`` int32 ``[count, token, k, value]``: how many ids of ``topk_ids`` ``(T, K)`` are
    outside ``[-1, num_experts)``, and where the first (row-major) is and what it holds
    (``[0, -1, -1, 0]`` when none)."""
    ids = topk_ids.astype(jnp.int32)
    bad = ((ids < -1) | (ids >= num_experts)).reshape(-1)
    at = jnp.argmax(bad).astype(jnp.int32)
    any_bad = jnp.any(bad)
    K = ids.shape[1]
    where = lambda v, none: jnp.where(any_bad, v, none).astype(jnp.int32)  # noqa: E731
    return jnp.stack([jnp.sum(bad, dtype=jnp.int32), where(at // K, -1), where(at % K, -1),
                      where(ids.reshape(-1)[at], 0)])


_sites = itertools.count()


def report(config: EPConfig, rows, message, mode: str) -> jax.Array:
    """Inside ``shard_map``: a host report of ``rows`` (identical on every rank of the axis; its
    first column counts the problems) in a step where they are not all zero. ``message(rows,
    config)`` words it; ``mode`` is ``"warn"`` (an :class:`EPInvalidIdsWarning` once per program)
    or ``"raise"`` (:class:`EPOverflowError`: see the module). Returns a ``()`` int32 zero that
    the caller keeps in its results, so that the report stays in the program."""
    site = next(_sites)
    host = functools.partial(_host_report, site, config, message, mode)
    zero = match_vma(jnp.zeros((), jnp.int32), rows)

    def call(rows):
        return match_vma(io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), rows), rows)

    return jax.lax.cond(jnp.any(rows[:, 0] > 0), call, lambda rows: zero, rows)


# --- on the host ------------------------------------------------------------------------------

_lock = threading.Lock()
_warned: set[int] = set()  # sites that have warned
_catching = 0  # checked() calls running
_pending: dict[str, None] = {}  # errors recorded for checked(), in order, each once


def _host_report(site, config, message, mode, rows):
    text = message(rows, config)
    if text is None:
        return np.zeros((), np.int32)
    if mode == "warn":
        with _lock:
            first = site not in _warned
            _warned.add(site)
        if first:
            warnings.warn(f"ep_comm dispatch: {text} (warned once per program; "
                          f"EPConfig(invalid_ids='raise') raises, 'ignore' silences this)",
                          EPInvalidIdsWarning, stacklevel=2)
        return np.zeros((), np.int32)
    error = _error([text])
    with _lock:
        if _catching:
            _pending.setdefault(str(error))  # (every device of the step reports it)
            return np.zeros((), np.int32)
    raise error


class _QuietReports(logging.Filter):
    """Leaves out the traceback JAX logs for each device whose callback raised one of ours (the
    message is in the program's error)."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, EPOverflowError)


logging.getLogger("jax._src.callback").addFilter(_QuietReports())


def _take_pending() -> EPOverflowError | None:
    with _lock:
        messages = list(_pending)
        _pending.clear()
    if not messages:
        return None
    more = f" (and {len(messages) - 1} more reports)" if len(messages) > 1 else ""
    return EPOverflowError(messages[0] + more)


def checked(fn):
    """``fn`` (a step: a jitted function, an ``nnx.jit`` one...) made to raise
    :class:`EPOverflowError` when a dispatch in it reports one: ``EPConfig(overflow="raise")``'s
    drops, ``invalid_ids="raise"``'s ids, :func:`check` inside ``shard_map``.

    The wrapped function calls ``fn``, waits for its results and its host callbacks, then raises
    the first error its dispatches recorded (once, however many devices saw it), or returns
    ``fn``'s results. Waiting costs the overlap of this step's end with the next step's launch.
    A step that failed for another reason re-raises that error. Use it as::

        step = ep_comm.checked(jax.jit(train_step))
        try:
            params, loss = step(params, batch)
        except ep_comm.EPOverflowError as e:
            ...  # params are the previous step's: a jitted step changes nothing in place
    """
    if not callable(fn):
        raise TypeError(f"checked: fn must be a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        global _catching
        with _lock:
            _catching += 1
        try:
            out = fn(*args, **kwargs)
            jax.block_until_ready(out)
            jax.effects_barrier()
        except jax.errors.JaxRuntimeError as e:
            error = _take_pending()
            if error is not None:
                raise error from e
            raise
        finally:
            with _lock:
                _catching -= 1
        error = _take_pending()
        if error is not None:
            raise error
        return out

    return run


# --- a handle's counters ----------------------------------------------------------------------

def runtime_check(handle: EPHandle) -> EPHandle:
    """Inside shard_map: report (raise) at run time when dispatch dropped any pair."""
    cfg = handle.config
    everyone = gather_counts(cfg, handle.num_dropped, "dispatch (overflow check)")  # (n, 1)
    flag = report(cfg, everyone, lambda rows, c: dropped_message(rows[:, 0], c), "raise")
    return dataclasses.replace(handle, num_dropped=handle.num_dropped + flag)


def check(handle: EPHandle) -> EPHandle:
    """Raise :class:`EPOverflowError` if dispatch dropped any pair or saw out-of-range ids.

    On a concrete handle (returned from ``shard_map``/``jit`` with ``out_specs=P(axis)``) it checks
    now and names the ranks. Inside ``shard_map`` it inserts a run-time check of the drops and the
    ids (the error surfaces when the results are computed: as an :class:`EPOverflowError` inside
    :func:`checked`) and returns the handle, which must be used for the check to stay in the
    program.
    """
    if not isinstance(handle, EPHandle):
        raise TypeError(f"check: expected an ep_comm.EPHandle, got {type(handle).__name__}")
    cfg = handle.config
    if is_tracer(handle.num_dropped):
        rows = gather_counts(cfg, jnp.concatenate([handle.num_dropped, handle.first_invalid]),
                             "dispatch (check)")  # (n, 5)
        flag = report(cfg, jnp.concatenate([rows[:, :1] + rows[:, 1:2], rows], axis=1),
                      lambda rows, c: "; ".join(p for p in (dropped_message(rows[:, 1], c),
                                                            invalid_ids_message(rows[:, 2:], c))
                                                if p) or None,
                      "raise")
        return dataclasses.replace(handle, num_dropped=handle.num_dropped + flag)
    dropped, invalid = handle.num_dropped, handle.first_invalid
    if not getattr(dropped, "is_fully_addressable", True):
        from jax.experimental import multihost_utils
        dropped, invalid = multihost_utils.process_allgather((dropped, invalid), tiled=True)
    error = _error([dropped_message(dropped, cfg), invalid_ids_message(invalid, cfg)])
    if error is not None:
        raise error
    return handle
