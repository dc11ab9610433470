"""A timed barrier in front of XLA's own collectives between CPU processes, which wait forever.

XLA:CPU's cross-process collectives (gloo) have no timeout: a peer that stays alive but never
joins a collective (it skipped a call, raised before it, or stalls) leaves every other process
blocked in it for good, and no thread can unblock it. So the portable transport's exchanges, and
dispatch's gather of the traffic counts on it, run through :func:`guard`: first a host callback in
which every process waits at a barrier of the ``jax.distributed`` coordination service, for at
most ``EP_COMM_TIMEOUT_S`` seconds (default 300). Only when every process arrived does the
collective start; a process that does not arrive in time fails the program on the others with an
error that names the operation, the call and the missing processes. Nothing stays armed behind a
program that fails (no deadline, no thread): the barrier is part of the program.

Order: the barrier and a marker after each guarded collective are *ordered* host callbacks, which
JAX runs in trace order, so every process runs its guarded collectives in the same order, one at a
time. (Unordered barriers deadlocked at 4 processes: XLA ran two independent exchanges in
different orders on different processes, and a process blocked at the second barrier could not
join the first collective that another process was waiting in.) Every call is one use of one
shared barrier (the service counts the uses, so the barriers do not pile up): a process's k-th use
meets every other process's k-th.

Not yet for processes that drive several CPU devices: there each device's program runs the
callbacks, and a program that failed on one device after another device's barrier (dispatch's
overflow check raising) left the process's count of calls behind its peers' (seen in the test
command's 2-devices-per-process phase: the next calls met the wrong uses). Those processes run
their collectives unguarded, as before.

Active between several processes on CPU with one device each, for a collective over a mesh axis
that spans every device (so every process runs it; ``EP_COMM_BARRIER=0`` turns it off);
elsewhere :func:`guard` is the collective alone (an axis over some devices may be one process's alone: a barrier of all
processes would then wait for processes that never run it). It guards the forward pass: the
collectives XLA derives for a backward pass (transposes) run in the same program after it,
unguarded. A peer that dies inside a collective is gloo's to report (it fails on the closed
connection).
"""

from __future__ import annotations

import collections
import functools
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ep_comm.topology._jax_compat import axis_size, distributed_client
from ep_comm.topology.processes import timeout_s

_BARRIER_ID = "ep_comm/barrier"  # the one barrier every guarded call uses

_lock = threading.Lock()
_uses: collections.Counter = collections.Counter()  # calls per operation in this process


def active() -> bool:
    """Whether :func:`guard` can wait at the barrier here: several processes on CPU, one device
    each (see the module)."""
    return (os.environ.get("EP_COMM_BARRIER", "1") != "0" and jax.process_count() > 1
            and jax.default_backend() == "cpu" and jax.local_device_count() == 1)


def _guards(axis_name) -> bool:
    return active() and axis_size(axis_name, "ep_comm barrier") == jax.device_count()


def guard(label: str, axis_name, collective, *operands):
    """``collective(*operands)``, a collective over mesh axis ``axis_name`` (bound: inside
    ``shard_map``), started once every process arrived at the barrier for this call of ``label``
    (see the module). The barrier and a marker after the collective are ordered host callbacks:
    JAX runs a program's ordered callbacks in trace order, so every process runs its guarded
    collectives in the same order, one after the other. (Two independent exchanges, each behind
    its own unordered barrier, deadlocked at 4 processes: one process waited at the second barrier
    while another waited inside the first collective for it.) Differentiable as ``collective``
    (the barrier is an identity)."""
    if not _guards(axis_name):
        return collective(*operands)
    out = collective(*_admitted(label, operands))
    _ordered(_passed, jax.lax.stop_gradient(_first_values(jax.tree.leaves(out))))
    return out


def _first_values(arrays):
    """Each array's first element as float32, in one vector: a callback's operand that makes it
    wait for the arrays."""
    return jnp.concatenate([jnp.ravel(a)[:1].astype(jnp.float32) for a in arrays])


def _ordered(fn, dep):
    """``fn(dep)``, an ordered host callback returning an int32 scalar. Under ``vmap`` it runs
    once for the whole batch (JAX cannot batch an ordered callback; a batch of exchanges is one
    collective, one barrier)."""
    @jax.custom_batching.custom_vmap
    def call(d):
        return io_callback(fn, jax.ShapeDtypeStruct((), jnp.int32), d, ordered=True)

    @call.def_vmap
    def _batched(axis_size, in_batched, d):
        del axis_size, in_batched
        return call(jnp.ravel(d)[:1]), False

    return call(dep)


def _passed(_dep) -> np.int32:
    return np.int32(0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _admitted(label, operands):
    call = _ordered(functools.partial(_arrive, label), _first_values(operands))
    # the operands through a select on the call's number (always >= 1, which XLA cannot know):
    # a data dependence that survives to the schedule, so the collective runs after the barrier
    # (an optimization barrier's ordering ends before XLA schedules; the select fuses into the
    # operands' producers)
    admitted = call >= 0
    return tuple(jnp.where(admitted, o, jnp.zeros((), o.dtype)) for o in operands)


@_admitted.defjvp
def _admitted_jvp(label, primals, tangents):
    return _admitted(label, *primals), tangents[0]


def _arrive(label: str, _dep) -> np.int32:
    with _lock:
        _uses[label] += 1
        call = _uses[label]
    error = _wait(label, call)
    if error:
        raise RuntimeError(error)
    return np.int32(call)


def _wait(label: str, call: int) -> str | None:
    """Wait at the barrier; None once every process arrived, else the diagnostic."""
    client = distributed_client()
    if client is None:
        return None  # (one process: nothing to wait for)
    limit = timeout_s()
    try:
        client.wait_at_barrier(_BARRIER_ID, int(limit * 1000))
        return None
    except Exception as e:  # noqa: BLE001  (the coordination service's error, as text)
        return diagnostic(label, call, limit, str(e))


def missing_processes(message: str) -> list[int] | None:
    """The processes a coordination-service barrier error names as not arrived (its "timed out
    task names": bare indices, or ``.../task:N`` names), or None when it names none."""
    parts = message.split("timed out task names:", 1)
    if len(parts) < 2:
        return None
    names = parts[1].split("RPC:")[0]
    found = re.findall(r"task:(\d+)", names) or re.findall(r"^\s*(\d+)\s*$", names, re.M)
    return sorted({int(t) for t in found}) or None


def diagnostic(label: str, call: int, limit: float, message: str) -> str:
    missing = missing_processes(message)
    who = (f"peer process(es) {', '.join(map(str, missing))} did not arrive" if missing
           else "not every process arrived (the coordination service did not say which)")
    first = message.strip().splitlines()[0] if message.strip() else ""
    return (f"ep_comm barrier: {label} (call {call}) on process {jax.process_index()}: {who} "
            f"within EP_COMM_TIMEOUT_S={limit:g} s (a process that skipped this call, raised "
            f"before it, stalls or died); XLA's CPU collectives have no timeout, so every process "
            f"must arrive here first. Coordination service: {first}")
