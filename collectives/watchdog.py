"""A watchdog for XLA's own collectives between CPU processes, which wait forever.

XLA:CPU's cross-process collectives (gloo) have no timeout: a peer that stays alive but never
joins a collective (it skipped a call, raised, or stalls) leaves every other process blocked in it
for good. The portable transport's exchanges, and dispatch's gather of the traffic counts on it,
run between two host callbacks (:func:`guard`): the first arms a deadline of ``EP_COMM_TIMEOUT_S``
seconds and records this process's arrival in the ``jax.distributed`` key-value store, the second
disarms it once the collective returned (and removes the record: every peer was there). A thread
checks the deadlines; past one it prints a diagnostic naming the operation, the call and the
processes that never arrived, and ends this process with status :data:`EXIT_CODE`: no thread can
unblock a gloo collective, and a process that can never finish must not hang.

Active between several processes on CPU (``EP_COMM_WATCHDOG=0`` turns it off); elsewhere
:func:`guard` is the collective itself. It guards the forward pass: the collectives XLA derives
for a backward pass (transposes) run unguarded.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from topology.jax_compat import distributed_client
from topology.processes import timeout_s

EXIT_CODE = 124  # the status of a process the watchdog ended (as timeout(1)'s)
_PREFIX = "ep_comm/watchdog"

_lock = threading.Lock()
_armed: dict = {}  # (label, call) -> (deadline, start)
_calls: collections.Counter = collections.Counter()
_thread: threading.Thread | None = None


def active() -> bool:
    """Whether :func:`guard` arms the watchdog here: several processes on CPU."""
    return (os.environ.get("EP_COMM_WATCHDOG", "1") != "0" and jax.process_count() > 1
            and jax.default_backend() == "cpu")


def guard(label: str, fn, x):
    """``fn(x)``, a collective, with the watchdog armed while it runs (see the module). ``fn``
    must be linear in ``x`` where ``x`` is floating (its derivative is ``fn`` of the tangent);
    integer ``x`` has none."""
    if not active():
        return fn(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return _armed_call(label, fn, x)
    return _differentiable(label, fn)(x)


def _differentiable(label, fn):
    @jax.custom_jvp
    def run(x):
        return _armed_call(label, fn, x)

    @run.defjvp
    def run_jvp(primals, tangents):
        return run(primals[0]), fn(tangents[0])

    return run


def _armed_call(label, fn, x):
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    # arm right before the collective (its operand waits for the callback), disarm right after
    call = io_callback(functools.partial(_arm, label), i32, x.reshape(-1)[:1])
    x, call = jax.lax.optimization_barrier((x, call))
    y = fn(x)
    done = io_callback(functools.partial(_disarm, label), i32, call, y.reshape(-1)[:1])
    y, _ = jax.lax.optimization_barrier((y, done))
    return y


def _key(label, call, process=None):
    tail = "" if process is None else f"/{process}"
    return f"{_PREFIX}/{label}/{call}{tail}"


def _arm(label, _dep):
    now = time.monotonic()
    with _lock:
        _calls[label] += 1
        call = _calls[label]
        _armed[(label, call)] = (now + timeout_s(), now)
    client = distributed_client()
    if client is not None:
        try:
            client.key_value_set(_key(label, call, jax.process_index()), "1")
        except Exception:  # noqa: BLE001  (the diagnostic then says the arrivals are unknown)
            pass
    _start_thread()
    return np.int32(call)


def _disarm(label, call, _dep):
    call = int(call)
    with _lock:
        _armed.pop((label, call), None)
    client = distributed_client()
    if client is not None:
        try:
            client.key_value_delete(_key(label, call, jax.process_index()))
        except Exception:  # noqa: BLE001
            pass
    return np.int32(0)


def _start_thread():
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="ep_comm watchdog", daemon=True)
            _thread.start()


def _watch():
    while True:
        time.sleep(min(1.0, max(0.05, timeout_s() / 20)))
        now = time.monotonic()
        with _lock:
            late = [(k, v) for k, v in _armed.items() if now > v[0]]
        if late:
            (label, call), (_, start) = min(late, key=lambda kv: kv[1][1])
            sys.stderr.write(diagnostic(label, call, now - start) + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(EXIT_CODE)


def missing_processes(label: str, call: int):
    """The processes that never recorded their arrival at call ``call`` of ``label``, or None when
    the key-value store cannot say."""
    client = distributed_client()
    if client is None:
        return None
    try:
        arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(
            _key(label, call) + "/")}
    except Exception:  # noqa: BLE001
        return None
    return sorted(set(range(jax.process_count())) - arrived)


def diagnostic(label: str, call: int, waited: float) -> str:
    missing = missing_processes(label, call)
    who = ("the key-value store could not say which peer is missing" if missing is None
           else f"peer process(es) {', '.join(map(str, missing))} never arrived" if missing
           else "every peer arrived (one is stuck inside the collective)")
    return (f"ep_comm watchdog: {label} (call {call}) timed out after {waited:.1f} s on rank "
            f"{jax.process_index()}: {who}; XLA's CPU collectives have no timeout "
            f"(EP_COMM_TIMEOUT_S={timeout_s():g}), so this process ends (status {EXIT_CODE})")
