"""Fault injection, bounded (the full matrix is ``python tests/faults.py``): under ``mpirun`` with
the mpi transport, a rank that makes one call fewer and a rank that stalls between the metadata and
the payload leave the survivors with a diagnostic naming the operation and the peer within the
timeout (plus start-up), never a hang; with the portable transport, a rank that makes one call
fewer leaves them the barrier's diagnostic (``ep_comm.collectives.barrier``)."""

import os
import shutil

import faults  # tests/faults.py: the fault matrix's runner, beside this test
import pytest

from ep_comm import collectives

needs_mpi = pytest.mark.skipif(
    shutil.which("mpirun") is None or collectives.available("cpu")["mpi"] is not None
    or os.environ.get("OMPI_COMM_WORLD_SIZE") is not None,  # not from inside an mpirun phase
    reason="needs mpirun and the engine's mpi transport, outside mpirun")


@needs_mpi
@pytest.mark.parametrize("fault", ["one_call_fewer",
                                   pytest.param("stall_after_metadata", marks=pytest.mark.full)])
def test_survivors_get_a_diagnostic_within_the_timeout(fault):
    timeout = 5.0
    r = faults.run_one("mpi", 2, fault, timeout, startup=60.0)
    assert r["outcome"] == "diagnostic", r
    assert r["diag_s"] <= timeout + 10, r
    assert r["names_operation"] and r["names_peer"], r["message"]
    assert "DEADLINE_EXCEEDED" in r["message"] and "timed out after 5" in r["message"], r["message"]


@pytest.mark.skipif(shutil.which("mpirun") is None
                    or os.environ.get("OMPI_COMM_WORLD_SIZE") is not None,
                    reason="needs mpirun, outside mpirun")
def test_portable_barrier_ends_a_hang_with_a_diagnostic():
    """The portable transport's collectives (gloo) have no timeout: a peer that stays alive and
    never joins used to hang the others; the barrier in front of them fails the survivors' call
    with the operation and the peer."""
    timeout = 5.0
    r = faults.run_one("portable", 2, "one_call_fewer", timeout, startup=60.0)
    assert r["outcome"] == "diagnostic", r
    assert timeout <= r["diag_s"] <= timeout + 10, r
    assert r["names_operation"] and r["names_peer"], r["message"]
    assert ("ep_comm barrier: dispatch (counts) (call 2) on process 0: peer process(es) 1 did not "
            "arrive within EP_COMM_TIMEOUT_S=5 s") in r["message"], r["message"]
