"""One process of a fault-injection run (tests/faults.py launches it under ``mpirun``).

Every rank runs two dispatch + combine round trips over the mesh of all processes (one CPU device
each); the last rank (the victim) injects ``--fault``. A survivor that gets an error prints
``DIAG <seconds since the call began> <message>`` and exits with status 2 at once (no atexit
barrier can then wait for the dead peer); a clean run prints ``OK``.

Faults: ``none``; ``exit_before_bootstrap`` (the victim exits before its first exchange);
``exit_in_metadata`` (it exits a second into the others' second exchange); ``one_call_fewer`` (it
skips the second exchange and stays alive); ``exit_after_metadata`` / ``stall_after_metadata``
(inside the engine, between the metadata and the payload of its first exchange with peers:
``EP_COMM_FAULT``); ``other_config`` (it runs another EPConfig); ``raise_between`` (it raises
between the two exchanges).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--fault", default="none")
ap.add_argument("--backend", default="mpi")
args = ap.parse_args()

from mpi4py import MPI  # noqa: E402

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
victim = rank == size - 1
if victim and args.fault in ("exit_after_metadata", "stall_after_metadata"):
    os.environ["EP_COMM_FAULT"] = args.fault  # read when the engine's communicator is created

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ep_comm  # noqa: E402

ep_comm.distributed.initialize(local_device_count=1)
mesh = jax.make_mesh((jax.device_count(),), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
n, T, H, K = jax.device_count(), 16, 32, 2
topk = 1 if (victim and args.fault == "other_config") else K
cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=topk, tokens_per_rank=T,
                       backend=args.backend)
rng = np.random.default_rng(0)
x = rng.standard_normal((n * T, H)).astype(np.float32)
ids = rng.integers(0, 4 * n, (n * T, topk)).astype(np.int32)
w = rng.random((n * T, topk)).astype(np.float32)
put = lambda a: ep_comm.distributed.global_array(a, NamedSharding(mesh, P("ep")))  # noqa: E731
xs, idss, ws = put(x), put(ids), put(w)
round_trip = jax.jit(jax.shard_map(lambda x, i, w: ep_comm.combine(*ep_comm.dispatch(x, i, w, cfg)),
                                   mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def call(k):
    t0 = time.monotonic()
    try:
        jax.block_until_ready(round_trip(xs, idss, ws))
    except Exception as e:  # the diagnostic the survivors must get
        msg = " ".join(str(e).split())
        if "Traceback" in msg and "ep_comm barrier:" in msg:  # a host callback's error: its line
            msg = msg[msg.rindex("ep_comm barrier:"):]
        msg = msg[:600]
        print(f"DIAG {time.monotonic() - t0:.1f} rank {rank}: call {k}: {type(e).__name__}: {msg}",
              flush=True)
        os._exit(2)


if victim and args.fault == "exit_before_bootstrap":
    os._exit(3)
call(1)
if victim and args.fault == "raise_between":
    raise RuntimeError("fault injected: the victim raised between two exchanges")
if victim and args.fault == "one_call_fewer":
    time.sleep(3600)
if victim and args.fault == "exit_in_metadata":
    time.sleep(1.0)
    os._exit(3)
call(2)
print(f"OK rank {rank}", flush=True)
sys.stdout.flush()
MPI.COMM_WORLD.Barrier()  # every rank has printed; exit without JAX's atexit barrier
MPI.Finalize()
os._exit(0)
