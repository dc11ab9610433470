"""The timed barrier in front of XLA's CPU collectives between processes (collectives.barrier):
its diagnostics, and, under mpirun, that it passes values and gradients through, counts one call
per program whatever the devices per process, and orders the collective after it. A peer that
never arrives: tests/test_faults.py (a real mpirun job with one rank skipping a call)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ep_comm.collectives import barrier
from conftest import AXIS

_SERVICE_ERROR = (
    "DEADLINE_EXCEEDED: Barrier timed out. Id: ep_comm/barrier::41. This usually "
    "happens because a task triggered the barrier too early or too slowly.\n# of tasks that "
    "reached the barrier: 2/4.\nThe first task at the barrier: 0. Some timed out task names:\n1\n"
    "3\n\n\nRPC: /xla.coordination.CoordinationService/Barrier [type.googleapis.com/tensorflow."
    "CoordinationServiceError='']")


def test_missing_processes_from_the_service_error():
    assert barrier.missing_processes(_SERVICE_ERROR) == [1, 3]
    assert barrier.missing_processes(
        "Some timed out task names: /job:jax_worker/replica:0/task:2") == [2]
    assert barrier.missing_processes("UNAVAILABLE: the service is gone") is None


def test_diagnostic_names_operation_call_and_peers():
    msg = barrier.diagnostic("combine", 7, 10.0, _SERVICE_ERROR)
    assert msg.startswith(f"ep_comm barrier: combine (call 7) on process {jax.process_index()}: "
                          "peer process(es) 1, 3 did not arrive within EP_COMM_TIMEOUT_S=10 s"), msg
    assert "Coordination service: DEADLINE_EXCEEDED: Barrier timed out." in msg, msg
    msg = barrier.diagnostic("combine", 7, 10.0, "UNAVAILABLE: gone")
    assert "not every process arrived (the coordination service did not say which)" in msg, msg


def test_inactive_in_one_process_or_off(monkeypatch):
    monkeypatch.setenv("EP_COMM_BARRIER", "0")
    assert not barrier.active()
    x = jnp.arange(3.0)
    assert barrier.guard("x", "ep", lambda a: a + 1, x).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.multiprocess
@pytest.mark.processes
def test_values_gradient_and_order_between_processes(sharded, n, rng):
    """Between processes the barrier sits in the program (one host callback per call),
    every process's call number advances by one per program run, and the collective behind it is
    scheduled after it (a data dependence XLA keeps); an axis of one process's devices has none."""
    if not barrier.active():
        pytest.skip("the barrier is active between CPU processes only")
    x = rng.standard_normal((n * 2, 3)).astype(np.float32)

    def body(v):  # every shard: all of x, gathered behind the barrier
        return barrier.guard("test gather", AXIS,
                             lambda a: jax.lax.all_gather(a, AXIS, tiled=True)[None], v)

    f = sharded.smap(body)
    xs = sharded.put(x)
    before = barrier._uses["test gather"]
    for _ in range(3):
        np.testing.assert_array_equal(sharded.get(f(xs)), np.broadcast_to(x, (n,) + x.shape))
    assert barrier._uses["test gather"] - before == 3
    g = sharded.smap(jax.grad(lambda v: jnp.sum(barrier.guard("test grad", AXIS,
                                                              lambda a: a ** 2, v))))
    np.testing.assert_allclose(sharded.get(g(xs)), 2 * x, rtol=1e-6)
    # an axis over this process's devices alone: no barrier (the other processes never run it)
    mine = jax.make_mesh((1,), (AXIS,), devices=jax.local_devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    local = jax.shard_map(lambda v: barrier.guard("test local", AXIS, lambda a: a, v), mesh=mine,
                          in_specs=jax.sharding.PartitionSpec(AXIS),
                          out_specs=jax.sharding.PartitionSpec(AXIS))
    assert "callback" not in str(jax.make_jaxpr(local)(jnp.zeros((2, 3)))), "barrier on a local axis"
    hlo = f.lower(xs).compile().as_text()
    order = [m.group(0) for m in re.finditer(r"xla_ffi_python_cpu_callback|all-gather\(", hlo)]
    assert order[:1] == ["xla_ffi_python_cpu_callback"] and "all-gather(" in order, order
