"""Lifecycle and determinism of the engine, under ``mpirun`` (CPU, the mpi transport), or on GPUs
with ``--backend nccl`` (one process per GPU; one GPU runs without ``mpirun``):

- ``--cycles`` (default 200) of bootstrap -> dispatch + combine -> ``ep_comm.collectives.finalize()``:
  open file descriptors, threads and resident memory of each process, sampled after every cycle;
  reports the first and last values and the growth per cycle (least squares over the second half,
  after the caches have warmed up); with ``--backend nccl`` also the GPU's used memory
  (``cudaMemGetInfo``: NCCL's buffers live outside JAX's pool), against its value before the
  first bootstrap;
- determinism: the same dispatch + combine 20 times, bitwise, and the portable transport against
  the mpi one.

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EP_COMM_CPU_DEVICES=1 \\
      mpirun -n 2 python tests/lifecycle.py [--cycles 200] [--json out.json]
    python tests/lifecycle.py --backend nccl --cycles 50    # one GPU

Each cycle runs dispatch + combine and one ``ep_comm.ragged_all_to_all`` (at one rank dispatch
moves nothing between ranks, so the exchange is what bootstraps a communicator there).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_comm import collectives
import ep_comm


def gpu_used_mb():
    """Used memory of this process's GPU (all allocations, JAX's pool included), or None."""
    try:
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
    except Exception:  # noqa: BLE001  (no cupy or no GPU: not measured)
        return None
    return (total - free) / 2 ** 20


def sample(gpu: bool):
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    out = dict(fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
               rss_mb=rss)
    if gpu:
        out["gpu_used_mb"] = gpu_used_mb()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="mpi", choices=("mpi", "nccl"))
    args = ap.parse_args()
    gpu = args.backend == "nccl"
    ep_comm.distributed.initialize(local_device_count=1)
    n, T, H, K = jax.device_count(), 32, 64, 2
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    ids = rng.integers(-1, 4 * n, (n * T, K)).astype(np.int32)
    w = rng.random((n * T, K)).astype(np.float32)
    put = lambda a: ep_comm.distributed.global_array(a, NamedSharding(mesh, P("ep")))  # noqa
    xs, idss, ws = put(x), put(ids), put(w)

    def round_trip(backend):
        cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=K, tokens_per_rank=T,
                               backend=backend)

        def f(x, i, w):
            y = ep_comm.combine(*ep_comm.dispatch(x, i, w, cfg))
            # rank r sends row block d (T // n rows) to rank d: a plain all-to-all of x
            per = T // n
            me = jax.lax.axis_index("ep")
            starts = jnp.arange(n, dtype=jnp.int32) * per
            sizes = jnp.full((n,), per, jnp.int32)
            moved = ep_comm.ragged_all_to_all(x, jnp.zeros_like(x), starts, sizes,
                                              jnp.full((n,), me * per, jnp.int32), sizes,
                                              axis_name="ep", backend=backend)
            return jnp.concatenate([y, moved], axis=1)

        prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        return ep_comm.distributed.to_host(prog(xs, idss, ws))

    before = sample(gpu)
    samples, t0 = [], time.monotonic()
    for _ in range(args.cycles):
        round_trip(args.backend)
        collectives.finalize()  # destroys the communicators; the next cycle bootstraps again
        samples.append(sample(gpu))
    secs = time.monotonic() - t0
    half = samples[len(samples) // 2:]
    growth = {k: float(np.polyfit(np.arange(len(half)), [s[k] for s in half], 1)[0])
              for k in samples[0] if len(half) > 1 and all(s[k] is not None for s in half)}
    runs = [round_trip(args.backend) for _ in range(20)]
    same = all(np.array_equal(r, runs[0]) for r in runs)
    portable = round_trip("portable")
    across = bool(np.array_equal(portable, runs[0]))
    report = dict(backend=args.backend, ranks=n, cycles=args.cycles, seconds=round(secs, 1),
                  before=before, first=samples[0], last=samples[-1], growth_per_cycle=growth,
                  deterministic_20_runs=bool(same), portable_equals=across)
    if jax.process_index() == 0:
        print(json.dumps(report, indent=1), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()  # exit without JAX's atexit barrier, MPI finalized
    MPI.Finalize()
    os._exit(0 if same and across else 1)


if __name__ == "__main__":
    main()
