"""Benchmark of the ragged exchange itself, nccl-tests style: ``python -m ep_comm.benchmarks.exchange``.

Every rank holds ``--rows`` rows of ``--hidden`` elements and sends ``rows / n`` to every rank
(itself included) with ``ragged_all_to_all``. Side by side in one run, for every transport that runs
here: ``ep_comm/<backend>``; on GPUs also ``device copy`` (one ``cudaMemcpyAsync`` of the same
bytes: the ceiling on one GPU) and ``ep_comm/nccl host path`` (``EP_COMM_NCCL_SELF=1``: the
metadata round trip through the host and NCCL's own self send/recv, i.e. what every call costs once
there are peers). Columns: median time, ``algbw`` = bytes a rank sends / time, ``busbw = algbw *
(n - 1) / n``, ``#wrong`` elements against numpy, ``x copy`` = time / device copy time.

``--overlap`` adds the overlap check: a matmul alone, the exchange alone, and both in one program
(independent of each other); with the exchange on its own stream the two together take about the
longer of the two, not their sum. ``--profile DIR`` writes a JAX profiler trace of that program and
prints, from it, the GPU kernels of each stream and how long the exchange's kernels ran while a
matmul kernel was running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_comm import collectives
from ep_comm.collectives import bootstrap, native
from ep_comm.benchmarks.timing import emit, hardware, median_us, trace_kernels
from ep_comm.topology.processes import global_array, initialize, to_host

AXIS = "ep"


def _exchange(backend):
    """The transport's ragged all-to-all over the bench's axis (the engine's own entry: the inputs
    here are well-formed, so ep_comm.ragged_all_to_all's validation has nothing to add)."""
    _, transport = collectives.resolve_transport(backend)
    return lambda *z: transport(*z, axis_name=AXIS)


def device_copy(x, into):
    """``x`` copied by one ``cudaMemcpyAsync`` into a fresh buffer shaped like ``into`` (same shape
    and dtype): the benchmark's ceiling for moving its bytes. Not aliased to ``into``: outside a
    loop carry XLA would first copy a non-donated ``into`` (a second pass the ceiling would
    count)."""
    bootstrap.register_targets("nccl")
    return jax.ffi.ffi_call("ep_comm_device_copy",
                            jax.ShapeDtypeStruct(into.shape, into.dtype))(x, into)


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def uniform_plan(n: int, rows: int):
    """Per-rank index arrays (n, n): rank s sends rows/n rows to each rank d."""
    per = rows // n
    io = np.tile(np.arange(n) * per, (n, 1))
    ss = np.full((n, n), per)
    oo = np.tile((np.arange(n) * per)[:, None], (1, n))
    return [a.astype(np.int32) for a in (io, ss, oo, ss.copy())]


def run(rows: int, hidden: int, dtype: str, warmup: int, iters: int, overlap: bool,
        profile: str | None, inner: int = 10):
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape[AXIS]
    rows -= rows % n
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n * rows, hidden)).astype(dt)
    spec = NamedSharding(mesh, P(AXIS))
    put = lambda a: global_array(a, spec)
    plan = uniform_plan(n, rows)
    want = x.reshape(n, n, rows // n, hidden).swapaxes(0, 1).reshape(n * rows, hidden)
    args = [put(x), put(np.zeros_like(x))] + [put(a.reshape(-1)) for a in plan]
    # check_vma=False: the device-copy FFI call's result carries no varying-axis type.
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                           check_vma=False))
    nbytes = rows * hidden * dt.itemsize
    gpu = jax.default_backend() in ("cuda", "gpu")
    results = []

    def looped(op):
        """``inner`` ops in one program, each writing into the buffer the previous one wrote
        (the loop carry, updated in place: no op needs a fresh or copied output buffer)."""
        def f(a, b, *rest):
            return jax.lax.fori_loop(0, inner, lambda _, out: op(a, out, *rest), b)
        return smap(f)

    def measure(impl, op, fargs, expect=want):
        out = smap(op)(*fargs)
        wrong = int(np.sum(to_host(out) != expect))
        t = median_us(looped(op), fargs, warmup, iters) / inner
        results.append(dict(impl=impl, time_us=t, bytes=nbytes, wrong=wrong))

    if gpu:  # a copy is no exchange: it is checked against its input
        measure("device copy", lambda a, b, *_: device_copy(a, b), args[:2], x)
    rows_ = []
    avail = collectives.available()
    for backend in ("nccl", "xla", "portable", "mpi"):
        if avail[backend] is not None or (backend == "mpi" and jax.local_device_count() != 1):
            continue
        measure(f"ep_comm/{backend}", _exchange(backend), args)
        rows_.append(backend)
        if backend == "nccl" and n == 1:
            # the engine reads EP_COMM_NCCL_SELF when it creates a communicator: new ones here,
            # and new ones again after
            with _env("EP_COMM_NCCL_SELF", "1"):
                collectives.finalize()
                measure("ep_comm/nccl host path", _exchange("nccl"), args)
            collectives.finalize()
    copy_t = next((r["time_us"] for r in results if r["impl"] == "device copy"), None)
    for r in results:
        r["algbw_GBps"] = r["bytes"] / (r["time_us"] * 1e3)
        r["busbw_GBps"] = r["algbw_GBps"] * (n - 1) / n
        r["x_copy"] = r["time_us"] / copy_t if copy_t else None

    report = dict(ranks=n, rows=rows, hidden=hidden, dtype=dtype, hardware=hardware(),
                  warmup=warmup, iters=iters, inner=inner, results=results)
    backend = "nccl" if "nccl" in rows_ else (rows_[0] if rows_ else None)
    if overlap and backend:
        report["overlap"] = _overlap(smap, put, args, backend, hidden, dt, n, warmup, iters,
                                     profile)
    return report


def _overlap(smap, put, args, backend, hidden, dt, n, warmup, iters, profile):
    """Time a matmul, the exchange, and both (independent) in one program."""
    m = 4096
    a = put(np.random.default_rng(1).standard_normal((n * m, hidden)).astype(dt))
    b = jnp.asarray(np.random.default_rng(2).standard_normal((hidden, hidden)).astype(dt))

    def mm(a):
        for _ in range(4):
            a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dt)
        return a

    def both(a, *z):  # start; matmul; done -- pinned in that order by optimization barriers
        if backend in native.TRANSPORTS:
            result, ws, keep, params = native.exchange_start(backend, *z, axis_name=AXIS)
            done = lambda p: native.exchange_done(*p, params)  # noqa: E731
        else:  # the whole exchange happens at "start"
            result, ws, keep = _exchange(backend)(*z), None, ()
            done = lambda p: p[0]  # noqa: E731
        a, pending = jax.lax.optimization_barrier((a, (result, ws, keep)))
        y = mm(a)
        y, pending = jax.lax.optimization_barrier((y, pending))
        return y, done(pending)

    f_mm = smap(mm)
    f_ex = smap(_exchange(backend))
    f_both = jax.jit(jax.shard_map(both, mesh=args[0].sharding.mesh, in_specs=P(AXIS),
                                   out_specs=(P(AXIS), P(AXIS))))
    t_mm = median_us(f_mm, (a,), warmup, iters)
    t_ex = median_us(f_ex, args, warmup, iters)
    t_both = median_us(f_both, (a, *args), warmup, iters)
    out = dict(backend=backend, matmul_us=t_mm, exchange_us=t_ex, both_us=t_both,
               hidden_us=t_mm + t_ex - t_both)
    if profile:
        os.makedirs(profile, exist_ok=True)
        with jax.profiler.trace(profile):
            for _ in range(3):
                jax.block_until_ready(f_both(a, *args))
        out["trace"] = _trace_summary(profile)
    return out


def _trace_summary(folder):
    """GPU kernels per stream in the trace, and the time exchange kernels overlapped a matmul."""
    kernels = trace_kernels(folder)
    if kernels is None:
        return {"error": f"no *.trace.json.gz under {folder}"}
    is_comm = lambda k: any(s in k["name"] for s in ("self_copy", "nccl", "pack_kernel",
                                                      "publish_kernel"))
    is_mm = lambda k: any(s in k["name"].lower() for s in ("gemm", "nvjet", "cutlass", "matmul",
                                                            "sm90"))
    comm = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if is_comm(k)]
    mms = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if is_mm(k)]
    both = sum(max(0.0, min(c1, m1) - max(c0, m0)) for c0, c1 in comm for m0, m1 in mms)
    streams = {}
    for k in kernels:
        streams.setdefault(k["stream"], set()).add(k["name"][:60])
    return dict(file=kernels[0]["file"] if kernels else "",
                exchange_kernel_us=sum(b - a for a, b in comm),
                matmul_kernel_us=sum(b - a for a, b in mms), overlapped_us=both,
                streams={s: sorted(v)[:6] for s, v in streams.items()})


def table(rep) -> str:
    lines = [f"# ragged exchange: {rep['ranks']} rank(s), {rep['rows']} rows x {rep['hidden']} "
             f"{rep['dtype']} per rank, rows/n to every rank (self included)",
             f"# {rep['hardware']}",
             f"# per op: median of {rep['iters']} programs (after {rep['warmup']} warm-up) of "
             f"{rep['inner']} back-to-back ops each, divided by {rep['inner']}",
             f"{'impl':<26}{'time(us)':>11}{'algbw':>9}{'busbw':>9}{'#wrong':>8}{'x copy':>8}"]
    for r in rep["results"]:
        xc = f"{r['x_copy']:>8.2f}" if r["x_copy"] else f"{'-':>8}"
        lines.append(f"{r['impl']:<26}{r['time_us']:>11.1f}{r['algbw_GBps']:>9.1f}"
                     f"{r['busbw_GBps']:>9.1f}{r['wrong']:>8d}{xc}")
    if "overlap" in rep:
        o = rep["overlap"]
        lines.append(f"# overlap ({o['backend']}): matmul {o['matmul_us']:.1f} us, exchange "
                     f"{o['exchange_us']:.1f} us, both in one program {o['both_us']:.1f} us "
                     f"(hidden: {o['hidden_us']:.1f} us)")
        if "trace" in o:
            lines.append(f"# trace: {json.dumps(o['trace'])}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="ragged exchange benchmark (nccl-tests style)")
    ap.add_argument("--rows", default="4096", help="rows per rank, comma-separated sizes")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--inner", type=int, default=10, help="ops per timed program")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--profile", default=None, help="write a profiler trace here (with --overlap)")
    ap.add_argument("--devices", type=int, default=None, help="CPU devices per process")
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the cost model's link (alpha, beta) to the timed sizes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    initialize(local_device_count=args.devices)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    reports = emit((run(rows, args.hidden, dtype, args.warmup, args.iters, args.overlap,
                        args.profile, args.inner) for rows in map(int, args.rows.split(","))),
                   table, None if args.calibrate else args.json)
    if args.calibrate:
        fit = calibration(reports)
        if jax.process_index() == 0:
            print(f"# calibration ({fit['impl']}, link class {fit['link']}): alpha "
                  f"{fit['alpha_us']:.2f} us, beta {fit['beta_GBps']:.1f} GB/s from "
                  f"{len(fit['samples'])} sizes; use topology.CostModel.calibrate(samples)")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(reports=reports, calibration=fit), f, indent=1)
    return reports


def calibration(reports, impl: str | None = None) -> dict:
    """Fit one link class of :class:`ep_comm.topology.CostModel` to the exchange timed at several sizes.

    The class is ``self`` on one rank, else the link inside the node when every rank is on one
    node (``ep_comm.topology.current()``); a run that spans nodes mixes classes and is refused. ``impl``:
    which row of the reports (default: the first ``ep_comm/`` transport)."""
    from ep_comm import topology
    n = reports[0]["ranks"]
    if n == 1:
        link = "self"
    else:
        topo = topology.current()
        if topo.num_nodes != 1:
            raise ValueError("calibration: this run spans several nodes, so its exchange mixes "
                             "link classes; calibrate 'network' from a run with one rank per node")
        link = topo.intra_node_link()
    impl = impl or next(r["impl"] for r in reports[0]["results"] if r["impl"].startswith("ep_comm/"))
    samples = []
    for rep in reports:
        row = next((r for r in rep["results"] if r["impl"] == impl), None)
        if row is None:
            raise ValueError(f"calibration: no {impl!r} result in the report of {rep['rows']} rows")
        # bytes a rank sends over the link class (all of it on one rank; (n-1)/n off-rank)
        sent = row["bytes"] * (1 if n == 1 else (n - 1) / n)
        samples.append((link, sent, row["time_us"] * 1e-6))
    fitted = topology.CostModel.calibrate(samples).link(link)
    return dict(impl=impl, link=link, samples=samples, alpha_us=fitted.alpha * 1e6,
                beta_GBps=fitted.beta / 1e9)


if __name__ == "__main__":
    main()
