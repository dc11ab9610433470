"""Benchmark dispatch + combine, nccl-tests style: ``python -m ep_comm.benchmarks.dispatch``.

Compares, side by side in one run and on the same routing:

- ``ep_comm/<backend>``: dropless dispatch/combine for every transport available here;
- ``capacity cf=1.0`` / ``cf=1.25``: the classic capacity-based exchange (GShard / Switch style: a
  fixed ``ceil(cf * T * topk / E)`` slots per expert and source rank, a dense ``lax.all_to_all`` of
  ``(E, capacity, H)``, overflowing tokens dropped);
- ``lax.all_to_all``: a dense all-to-all of each rank's ``T`` token rows, no routing at all (a
  ceiling for moving that many bytes; its payload is ``T * H`` elements);
- ``plain JAX``: each rank's own (token, expert) pairs permuted by an argsort and a gather,
  unpermuted by a gather and a weighted sum, and both (:mod:`ep_comm.benchmarks.plain`): no exchange,
  the local work a user's own JAX code does at one rank. With ``--round-trip``, ep_comm's
  dispatch then combine in one program too (``round trip``); the table ends with each ep_comm
  phase's time over plain JAX's (pipelined where measured: ``pipe``);
- ``plain JAX EP`` (more than one rank): the same dropless exchange written in plain JAX
  (:func:`ep_comm.benchmarks.plain.ep_permute` / ``ep_unpermute``: per-peer slots of ``T`` rows through
  ``lax.all_to_all``, an argsort by local expert, ``expert_rows`` rows out as ep_comm's config
  gives them), timed per phase; the table ends with ep_comm's phases over it too, also timed in
  turn with it (:func:`ep_comm.benchmarks.timing.interleaved_us`: drift over the run, large on a
  2-core machine running 8 devices, lands on both alike).

For each: ``time`` = median over ``--iters`` calls after ``--warmup``, each waited for; ``pipe`` =
time per call of ``--iters`` calls issued back to back and waited for once (median of 5 such loops:
nccl-tests' loop, without a host round trip per call); ``algbw`` = the bottleneck rank's
payload bytes (tokens it must send, self included, times ``H`` times the element size) / time and
``busbw = algbw * (n - 1) / n`` (nccl-tests' all-to-all convention); ``#wrong`` output elements
against a float64 reference of the round trip with identity experts; ``dropped`` (token, expert)
pairs; ``wire`` bytes each rank actually puts on the wire (the portable transport pads every
per-peer slot to a static size; ``pad`` is wire / payload); ``buffers`` = receive-side memory per
rank. Results go to stdout and, with ``--json``, to a file.

Ceilings and overheads (GPU): ``copy`` is the time over one ``cudaMemcpyAsync`` of the phase's
compulsory bytes, timed in the same run, both pipelined (dispatch reads ``T * H`` elements and writes one row per
received (token, expert) pair, combine the reverse; the busiest rank's count); with ``--profile DIR``
``kern`` is the GPU kernel time per call summed from a JAX profiler trace and ``wall/kern`` the
pipelined time over it (what is not kernel time: launch gaps, host work, waits); for dispatch
``prog`` is its time inside a jitted program of 20 dispatches (:func:`in_program`: a model step's
view, without the per-call jit dispatch and handle outputs a standalone call pays on the host),
each program waited for (its launch and wait round trip shared by its 20 dispatches), ``prog/kern``
that time over the kernel time per dispatch in the same program's trace, and ``progpipe`` the
same program issued back to back and waited for once (``pipe``'s loop: a training or decode loop's
view, where the host enqueues the next step while the device runs this one). With
``--wire-formats``, ``q`` rows time dispatch with ``return_quantized=True`` (FP8 values and
scales for an FP8 grouped GEMM, no dequantize).

Plans: ``--topology 2x4 --plans flat,hierarchical`` runs both exchange plans on a (simulated)
machine; ``net`` is the busiest rank's network bytes as dispatch counted them
(``EPHandle.link_rows``) and ``model`` what :class:`ep_comm.topology.CostModel` predicts for the same
routing, so the byte saving and the model sit next to the measured times. On one host the
"network" is simulated: the times show the cost of the extra stage, not the saving.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_comm import collectives
import ep_comm
from ep_comm import topology
from ep_comm.collectives import portable
from ep_comm.benchmarks.timing import (emit, hardware, interleaved_us, median_us, pipelined_us,
                               trace_kernels)
from ep_comm.benchmarks import plain


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    tokens_per_rank: int
    hidden: int
    topk: int
    num_experts: int
    dtype: str
    routing: str


def make_routing(rng, kind: str, n_tokens: int, topk: int, num_experts: int) -> np.ndarray:
    """Distinct top-k ids per token. ``uniform``: every expert equally likely; ``skewed``: expert
    popularity falls off as ``1 / (e + 1)^0.8`` (a router that has not learned to balance)."""
    logits = rng.gumbel(size=(n_tokens, num_experts))
    if kind == "skewed":
        logits = logits - 0.8 * np.log1p(np.arange(num_experts))[None, :]
    elif kind != "uniform":
        raise ValueError(f"bench: routing must be 'uniform' or 'skewed', got {kind!r}")
    return np.argsort(-logits, axis=1)[:, :topk].astype(np.int32)


# ---- the classic capacity-based exchange (the baseline) -------------------------------------------

def capacity_slots(cf: float, tokens: int, topk: int, num_experts: int) -> int:
    return max(1, math.ceil(cf * tokens * topk / num_experts))


def capacity_round_trip(x, ids, w, *, axis_name: str, num_experts: int, cap: int):
    """Dispatch into ``(E, cap, H)`` slots, ``all_to_all``, identity experts, ``all_to_all`` back,
    weighted sum. Returns ``(y, dropped pairs on this rank)``."""
    T, K = ids.shape
    onehot = jax.nn.one_hot(ids.reshape(-1), num_experts, dtype=jnp.int32)  # (T*K, E)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # slot within its expert
    keep = pos < cap
    flat_slot = jnp.where(keep, ids.reshape(-1) * cap + pos, num_experts * cap)
    buf = jnp.zeros((num_experts * cap, x.shape[1]), x.dtype).at[flat_slot].set(
        jnp.repeat(x, K, axis=0), mode="drop")
    buf = buf.reshape(num_experts, cap, -1)
    recv = lax.all_to_all(buf, axis_name, 0, 0, tiled=True)  # (E, cap, H): [src, local expert]
    expert_out = recv  # identity experts
    back = lax.all_to_all(expert_out, axis_name, 0, 0, tiled=True).reshape(num_experts * cap, -1)
    got = jnp.take(back, jnp.minimum(flat_slot, num_experts * cap - 1), axis=0)
    got = jnp.where(keep[:, None], got.astype(jnp.float32), 0.0).reshape(T, K, -1)
    y = jnp.sum(got * w[:, :, None], axis=1).astype(x.dtype)
    return y, jnp.sum(~keep, dtype=jnp.int32)[None]


def _rows_differing(expert_x, reference, n: int) -> int:
    """Elements of the grouped rows of ``expert_x`` (every rank's block stacked) that differ from
    ep_comm's dispatch (``reference``: its ``expert_x`` and ``group_sizes``); 0 with no
    reference."""
    if reference is None:
        return 0
    ref_x, sizes = reference
    rows = expert_x.shape[0] // n
    used = sizes.reshape(n, -1).sum(axis=1)
    return int(sum(np.sum(expert_x[r * rows:r * rows + u] != ref_x[r * rows:r * rows + u])
                   for r, u in enumerate(used)))


def _portable_wire_rows(cfg, plan: str, N: int) -> tuple[int, int]:
    """Rows each rank puts on the wire per phase with the portable transport (padded slots)."""
    T, K, n = cfg.tokens_per_rank, cfg.topk, cfg.num_ranks
    if plan == "flat":
        rows = portable.wire_rows(cfg.send_rows, cfg.recv_token_rows, n, T)
        return rows, rows
    G = n // N
    s1 = portable.wire_rows(T * min(K, N), N * T, N, T)
    s2 = portable.wire_rows(N * T * min(K, G), cfg.recv_token_rows, G, N * T)
    s2_back = portable.wire_rows(cfg.recv_token_rows, N * T * min(K, G), G, N * T)
    s1_back = portable.wire_rows(N * T, T * min(K, N), N, T)
    return s1 + s2, s2_back + s1_back


def kernel_us(fn, args, folder, calls: int = 5, top: int = 5) -> tuple[float, list]:
    """GPU kernel time per call of ``fn`` (every stream, summed) from a JAX profiler trace of
    ``calls`` calls, and the ``top`` largest kernels as ``(name, us per call, launches per
    call)``."""
    jax.block_until_ready(fn(*args))
    shutil.rmtree(folder, ignore_errors=True)
    with jax.profiler.trace(folder):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    kernels = trace_kernels(folder) or []
    by = {}
    for k in kernels:
        us, count = by.get(k["name"], (0.0, 0))
        by[k["name"]] = (us + k["dur"] / calls, count + 1)
    top = sorted(((name[:70], us, count / calls) for name, (us, count) in by.items()),
                 key=lambda t: -t[1])[:top]
    return sum(k["dur"] for k in kernels) / calls, top


def in_program(cfg, mesh, calls: int):
    """``calls`` dispatches in one jitted program (as in a model step: no per-call jit dispatch,
    no handle crossing the program's boundary), each call's expert ids bounded by a value the
    previous call computed (an identity bound, so XLA cannot hoist any of the work out of the loop).
    Its time over ``calls`` is a dispatch's time inside a program."""
    E = cfg.num_experts

    def body(x, ids, w):
        bound = jnp.max(ids) * 0 + E
        for _ in range(calls):  # straight-line (a loop would add a host round trip per trip)
            ex, h = ep_comm.dispatch(x, jnp.minimum(ids, bound), w, cfg)
            bound = jnp.maximum(jnp.sum(h.group_sizes), E) + (ex[0, 0] == 1e30).astype(jnp.int32)
        return bound[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _copy_ceiling_us(nbytes: int, warmup: int, iters: int) -> float | None:
    """Pipelined time (:func:`ep_comm.benchmarks.timing.pipelined_us`) of one device copy of ``nbytes``
    bytes read and written in all (GPU with the engine built), else None."""
    if jax.default_backend() != "gpu" or collectives.available().get("nccl") is not None:
        return None
    from ep_comm.benchmarks.exchange import device_copy
    half = max(1, nbytes // 2 // 16)
    dev = jax.devices()[0]
    src = jax.device_put(jnp.ones((half, 16), jnp.uint8), dev)
    dst = jax.device_put(jnp.zeros((half, 16), jnp.uint8), dev)
    return pipelined_us(jax.jit(device_copy), (src, dst), warmup, iters)


def run(bc: BenchConfig, warmup: int = 3, iters: int = 20, seed: int = 0,
        capacity_factors=(1.0, 1.25), backends=None, topo=None, plans=("flat",),
        cost_model=None, wire_formats=(None,), devices=None, profile=None,
        round_trip: bool = False, recv_capacity: int | None = None):
    devices = devices or jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    n = mesh.shape["ep"]
    T, H, K, E = bc.tokens_per_rank, bc.hidden, bc.topk, bc.num_experts
    dtype = jnp.dtype(bc.dtype)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n * T, H)).astype(dtype)
    ids = make_routing(rng, bc.routing, n * T, K, E)
    w = rng.random((n * T, K)).astype(np.float32)
    ref = (w.sum(1, keepdims=True) * x.astype(np.float64))
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7 * (1 + min(K, n))
    rows = NamedSharding(mesh, P("ep"))
    put = lambda a: ep_comm.distributed.global_array(a, rows)
    xs, idss, ws = put(x), put(ids), put(w)
    itemsize = dtype.itemsize
    L = E // n

    # Payload: tokens each rank must send (one row per destination rank), self included.
    dest = ids // L
    sends = np.array([[np.sum((dest[s * T:(s + 1) * T] == d).any(1)) for d in range(n)]
                      for s in range(n)])
    payload = int(max(sends.sum(1).max(), sends.sum(0).max())) * H * itemsize
    # compulsory bytes of either phase on the busiest rank: its T token rows and the expert rows
    # of the (token, expert) pairs it receives
    sorted_ids = np.sort(ids, axis=1)
    distinct = np.concatenate([sorted_ids[:, :1] >= 0,
                               sorted_ids[:, 1:] != sorted_ids[:, :-1]], 1)
    pairs = np.bincount((sorted_ids // L)[distinct], minlength=n)
    compulsory = int((T + pairs.max()) * H * itemsize)
    copy_us = _copy_ceiling_us(compulsory, warmup, iters)

    def wrong(y, tolerance=None):
        y = ep_comm.distributed.to_host(y).astype(np.float64)
        return int(np.sum(np.abs(y - ref) > (tolerance or tol) * (1 + np.abs(ref))))

    results = []
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    avail = collectives.available()
    usable = [b for b in ("nccl", "portable", "xla", "mpi") if avail[b] is None
              and (b != "mpi" or jax.local_device_count() == 1)]
    topo = topo or topology.simulated(1, n)
    model = cost_model or topology.CostModel()
    net = topology.LINK_CLASSES.index("network")
    host_floor = reference_dispatch = None
    timed = []  # (result row, fn, args) of ep_comm's unquantized phases, for the A/B against peers
    for backend, plan, wire_format in ((b, p, f) for b in backends or usable for p in plans
                                       for f in wire_formats):
        row_d, row_c = topology.row_bytes(H, dtype, K, wire_format=wire_format)
        cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T,
                               backend=backend, plan=plan, topology=topo,
                               wire_format=wire_format, recv_capacity=recv_capacity)
        disp = smap(functools.partial(ep_comm.dispatch, config=cfg))
        comb = smap(ep_comm.combine)
        ex, h = disp(xs, idss, ws)
        y = comb(ex, h)
        if reference_dispatch is None and wire_format is None:  # (plain JAX EP's #wrong)
            reference_dispatch = (ep_comm.distributed.to_host(ex),
                                  ep_comm.distributed.to_host(h.group_sizes))
        if host_floor is None:  # a call returning as many arrays as dispatch, no device work
            outputs = len(jax.tree.leaves((ex, h)))
            host_floor = (outputs, pipelined_us(
                jax.jit(lambda a: tuple(a + i for i in range(outputs))),
                (jnp.zeros((8,), jnp.float32),), warmup, iters))
        phases = [("dispatch", disp, (xs, idss, ws)), ("combine", comb, (ex, h))]
        if round_trip and wire_format is None:
            phases.append(("round trip", smap(lambda x, i, w, cfg=cfg: ep_comm.combine(
                *ep_comm.dispatch(x, i, w, cfg))), (xs, idss, ws)))
        if wire_format is not None:
            disp_q = smap(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg, return_quantized=True))
            phases.append(("dispatch q", disp_q, (xs, idss, ws)))
        # bytes per rank and link class, as dispatch counted them: (n, phase, class)
        sent = ep_comm.distributed.to_host(h.link_rows).reshape(n, 2, -1).astype(np.float64)
        sent = sent * np.array([row_d, row_c])[None, :, None]
        if backend == "portable":  # padded slots
            rd, rc = _portable_wire_rows(cfg, plan, topo.num_nodes)
            wire, wire_c = rd * row_d, rc * row_c
        else:  # exact: every byte but the copies to oneself
            off_rank = sent[:, :, 1:].sum(axis=2).max(axis=0)
            wire, wire_c = off_rank
        predicted = model.predict(topology.count_traffic(
            ids.reshape(n, T, K), num_experts=E, topology=topo, hidden=H, dtype=dtype,
            plan=plan, wire_format=wire_format))
        # FP8 on the wire: each element within 2**-3 of its value (ep_comm.wire's bound)
        fp8_tol = None if wire_format is None else max(tol, 2.0 ** -3)
        common = dict(impl=f"ep_comm/{backend}" + (f" {wire_format}" if wire_format else ""),
                      plan=plan, wrong=wrong(y, fp8_tol), wire_format=wire_format,
                      dropped=int(ep_comm.distributed.to_host(h.num_dropped).sum()),
                      buffers=cfg.buffer_bytes(H, dtype, plan, topo.num_nodes)["total"])
        for phase, fn, fargs in phases:
            i = int(phase == "combine")
            # (the round trip's own output; dispatch and combine: the pair's, above)
            checked = dict(wrong=wrong(fn(*fargs))) if phase == "round trip" else {}
            t = median_us(fn, fargs, warmup, iters)
            piped = pipelined_us(fn, fargs, 1, iters)
            extra = dict(pipelined_us=piped)
            if copy_us:
                extra.update(copy_us=copy_us, x_copy=piped / copy_us)
            trace_dir = f"{profile}/{backend}_{plan}_{wire_format}_{phase.replace(' ', '_')}"
            kern = kernel_us(fn, fargs, trace_dir) if profile else (0.0, [])
            if kern[0] > 0:  # GPU kernels in the trace (none on CPU)
                extra.update(kernel_us=kern[0], wall_over_kernel=piped / kern[0],
                             top_kernels=kern[1])
            # (bf16 only: with a wire format XLA would quantize the loop-invariant x once)
            if profile and phase == "dispatch" and wire_format is None:
                calls = 20
                prog = in_program(cfg, mesh, calls)
                extra.update(in_program_us=median_us(prog, fargs, 2, iters) / calls,
                             in_program_pipelined_us=pipelined_us(prog, fargs, 2, iters) / calls)
                prog_kern, prog_top = kernel_us(prog, fargs, trace_dir + "_in_program", calls=1,
                                                top=12)
                if prog_kern > 0:  # (per dispatch: the program holds ``calls``)
                    extra.update(in_program_kernel_us=prog_kern / calls,
                                 in_program_over_kernel=extra["in_program_us"] * calls / prog_kern,
                                 in_program_top_kernels=[(k, us / calls, c / calls)
                                                         for k, us, c in prog_top])
            if wire_format is None:
                timed.append((len(results), fn, fargs))
            results.append(dict(phase=phase, time_us=t, wire=(wire, wire_c)[i],
                                network_bytes_max=float(sent[:, i, net].max()),
                                network_bytes_total=float(sent[:, i, net].sum()),
                                predicted_us=(predicted["dispatch"] + predicted["combine"]
                                              if phase == "round trip"
                                              else predicted[phase.split()[0]]) * 1e6,
                                compulsory_bytes=compulsory, **extra, **{**common, **checked}))
    for cf in capacity_factors:
        cap = capacity_slots(cf, T, K, E)
        fn = smap(functools.partial(capacity_round_trip, axis_name="ep", num_experts=E, cap=cap))
        y, dropped = fn(xs, idss, ws)
        t = median_us(fn, (xs, idss, ws), warmup, iters)
        results.append(dict(impl=f"capacity cf={cf}", plan="-", phase="round trip", time_us=t,
                            wire=2 * E * cap * H * itemsize, wrong=wrong(y),
                            dropped=int(ep_comm.distributed.to_host(dropped).sum()),
                            buffers=2 * E * cap * H * itemsize))
    # plain JAX at each rank: its own pairs, no exchange (payload and wire: the pairs' rows)
    local = T * K * H * itemsize
    perm = smap(plain.permute)
    x_sorted, order = perm(xs, idss)
    for phase, fn, fargs in (
            ("permute", perm, (xs, idss)),
            ("unpermute", smap(plain.unpermute), (x_sorted, order, ws)),
            ("round trip", smap(plain.round_trip), (xs, idss, ws))):
        y = fn(*fargs)
        results.append(dict(impl="plain JAX", plan="-", phase=phase,
                            time_us=median_us(fn, fargs, warmup, iters),
                            pipelined_us=pipelined_us(fn, fargs, 1, iters),
                            wrong=wrong(y) if phase == "round trip" else 0, dropped=0,
                            wire=0, buffers=local, payload=local))
    if n > 1:  # plain JAX across ranks: the same job with padded lax.all_to_all slots
        rows_out = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T,
                                    recv_capacity=recv_capacity).expert_rows
        kw = dict(axis_name="ep", num_experts=E, rows=rows_out)
        ep_perm = smap(functools.partial(plain.ep_permute, **kw))
        ep_unperm = smap(functools.partial(plain.ep_unpermute, axis_name="ep"))
        ep_x, _, ep_state = ep_perm(xs, idss, ws)
        phases = [("dispatch", ep_perm, (xs, idss, ws)), ("combine", ep_unperm, (ep_x, ep_state))]
        if round_trip:
            phases.append(("round trip", smap(functools.partial(plain.ep_round_trip, **kw)),
                           (xs, idss, ws)))
        for phase, fn, fargs in phases:
            if phase == "dispatch":  # the same rows as ep_comm's, group by group
                wrong_rows = _rows_differing(ep_comm.distributed.to_host(ep_x),
                                             reference_dispatch, n)
            else:
                wrong_rows = wrong(fn(*fargs))
            results.append(dict(impl="plain JAX EP", plan="-", phase=phase,
                                time_us=median_us(fn, fargs, warmup, iters),
                                pipelined_us=pipelined_us(fn, fargs, 1, iters),
                                wrong=wrong_rows, dropped=0,
                                wire=n * T * (H * itemsize + 8 * K) * (2 if phase == "round trip"
                                                                      else 1),
                                buffers=(n * T + rows_out) * H * itemsize))
            for row, ep_fn, ep_args in timed:  # ep_comm's same phase against it, in turn
                if results[row]["phase"] == phase:
                    ours, theirs = interleaved_us([(ep_fn, ep_args), (fn, fargs)], 1, iters)
                    results[row]["vs_plain_ep_interleaved"] = ours / theirs
    if T % n == 0:  # the ceiling: a dense all-to-all of each rank's T token rows, no routing
        fn = smap(lambda x: lax.all_to_all(x, "ep", 0, 0, tiled=True))
        t = median_us(fn, (xs,), warmup, iters)
        results.append(dict(impl="lax.all_to_all", plan="-", phase="T rows", time_us=t, wrong=0,
                            dropped=0,
                            wire=T * H * itemsize, buffers=T * H * itemsize,
                            payload=T * H * itemsize))
    for r in results:
        moves = 2 if r["phase"] == "round trip" else 1
        r.setdefault("payload", payload * moves)
        r["algbw_GBps"] = r["payload"] / (r["time_us"] * 1e3)
        r["busbw_GBps"] = r["algbw_GBps"] * (n - 1) / n
        r["pad"] = r["wire"] / r["payload"]
    return dict(config=dataclasses.asdict(bc), ranks=n, hardware=hardware(), warmup=warmup,
                copy_ceiling_us=copy_us, compulsory_bytes=compulsory,
                host_floor=dict(outputs=host_floor[0], pipelined_us=host_floor[1])
                if host_floor else None,
                iters=iters, topology=f"{topo.num_nodes}x{topo.gpus_per_node} ({topo.source})",
                cost_model=dataclasses.asdict(model), results=results)


def table(report) -> str:
    c = report["config"]
    head = (f"# ep_comm bench: {report['ranks']} ranks, {c['tokens_per_rank']} tokens/rank, hidden "
            f"{c['hidden']}, top-{c['topk']} of {c['num_experts']} experts, {c['dtype']}, "
            f"{c['routing']} routing\n# {report['hardware']}\n"
            f"# median of {report['iters']} after {report['warmup']} warm-up; payload = bottleneck "
            f"rank's token bytes; wire = bytes each rank sends; buffers = memory per rank\n"
            f"# topology {report['topology']}; net = network bytes of the busiest rank (counted "
            f"by dispatch); model = the cost model's prediction for this routing (us)\n")
    if report.get("host_floor"):
        f = report["host_floor"]
        head += (f"# host floor: a jitted call with dispatch's {f['outputs']} outputs and no device "
                 f"work takes {f['pipelined_us']:.1f} us pipelined here\n")
    cols = f"{'impl':<23}{'plan':<13}{'phase':<11}{'time(us)':>11}{'algbw':>8}{'busbw':>8}" \
           f"{'#wrong':>9}{'dropped':>8}{'payload':>11}{'wire':>11}{'pad':>6}{'buffers':>11}" \
           f"{'net':>11}{'model':>9}{'pipe(us)':>10}{'copy':>7}{'kern(us)':>10}{'wall/kern':>10}" \
           f"{'prog(us)':>10}{'prog/kern':>10}{'progpipe':>10}"
    lines = [head + cols]
    for r in report["results"]:
        net = f"{r['network_bytes_max'] / 2**20:>9.2f}MB" if "network_bytes_max" in r else \
            f"{'-':>11}"
        pred = f"{r['predicted_us']:>9.1f}" if "predicted_us" in r else f"{'-':>9}"
        over = (f"{r['pipelined_us']:>10.1f}" if "pipelined_us" in r else f"{'-':>10}") + (
            f"{r['x_copy']:>6.2f}x" if "x_copy" in r else f"{'-':>7}") + (
            f"{r['kernel_us']:>10.1f}{r['wall_over_kernel']:>9.2f}x" if "kernel_us" in r
            else f"{'-':>10}{'-':>10}") + (
            f"{r['in_program_us']:>10.1f}" if "in_program_us" in r else f"{'-':>10}") + (
            f"{r['in_program_over_kernel']:>9.2f}x" if "in_program_over_kernel" in r
            else f"{'-':>10}") + (
            f"{r['in_program_pipelined_us']:>10.1f}" if "in_program_pipelined_us" in r
            else f"{'-':>10}")
        lines.append(f"{r['impl']:<23}{r['plan']:<13}{r['phase']:<11}{r['time_us']:>11.1f}"
                     f"{r['algbw_GBps']:>8.2f}{r['busbw_GBps']:>8.2f}{r['wrong']:>9d}"
                     f"{r['dropped']:>8d}{r['payload'] / 2**20:>9.2f}MB"
                     f"{r['wire'] / 2**20:>9.2f}MB{r['pad']:>6.2f}{r['buffers'] / 2**20:>9.2f}MB"
                     f"{net}{pred}{over}")
    by = {(r["impl"], r["plan"], r["phase"]): r for r in report["results"]}
    for (impl, plan, phase), r in by.items():
        f = by.get((impl, "flat", phase))
        if plan == "hierarchical" and f is not None:
            ratio = (f["network_bytes_max"] / r["network_bytes_max"]
                     if r["network_bytes_max"] else float("nan"))
            lines.append(f"# {impl} {phase}: hierarchical/flat time "
                         f"{r['time_us'] / f['time_us']:.2f}x (model {r['predicted_us'] / f['predicted_us']:.2f}x), network bytes "
                         f"of the busiest rank {ratio:.2f}x fewer")
        fmt = r.get("wire_format")
        base = by.get((impl.rsplit(" ", 1)[0], plan, "dispatch")) if fmt else None
        if base is not None and phase.startswith("dispatch"):
            what = "FP8 values and scales out" if phase == "dispatch q" else "dequantized"
            key = "pipelined_us" if "pipelined_us" in r else "time_us"
            lines.append(f"# {impl} {plan} dispatch (quantize included, {what}): "
                         f"{r[key] / base[key]:.2f}x the time ({key}), "
                         f"{r['buffers'] / base['buffers']:.2f}x the buffers and "
                         f"{_row_ratio(report, fmt):.3f}x the bytes per token row of the "
                         f"unquantized wire")
    peers = (("plain JAX", {"dispatch": "permute", "combine": "unpermute",
                            "round trip": "round trip"}, ""),
             ("plain JAX EP", {p: p for p in ("dispatch", "combine", "round trip")},
              " (the same exchange in plain JAX)"))
    for name, peer, what in peers:
        plain = {r["phase"]: r for r in report["results"] if r["impl"] == name}
        for (impl, plan, phase), r in by.items():
            p = plain.get(peer.get(phase, ""))
            if impl.startswith("ep_comm/") and p is not None:
                key = "pipelined_us" if "pipelined_us" in r and "pipelined_us" in p else "time_us"
                ab = ("" if name != "plain JAX EP" or "vs_plain_ep_interleaved" not in r else
                      f"; {r['vs_plain_ep_interleaved']:.2f}x timed in turn")
                lines.append(f"# {impl} {plan} {phase}: {r[key] / p[key]:.2f}x {name}'s "
                             f"{peer[phase]}{what} ({key}; {r['time_us'] / p['time_us']:.2f}x by "
                             f"time{ab})")
    return "\n".join(lines)


def _row_ratio(report, fmt) -> float:
    c = report["config"]
    return (topology.token_bytes(c["hidden"], c["dtype"], fmt)
            / topology.token_bytes(c["hidden"], c["dtype"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description="ep_comm dispatch/combine benchmark (nccl-tests style)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts (default: 32 per rank, as DeepSeek-V3 on 8 GPUs)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--devices", type=int, default=None, help="CPU devices per process")
    ap.add_argument("--topology", default=None,
                    help="NxG (simulated) or a saved topology; default: EP_COMM_TOPOLOGY or the "
                         "machine")
    ap.add_argument("--plans", default=None,
                    help="comma-separated: flat,hierarchical (default: both on several nodes)")
    ap.add_argument("--backends", default=None, help="default: every usable transport")
    ap.add_argument("--wire-formats", default="none",
                    help="dispatch's wire formats to time, comma-separated: none, e4m3, mxfp8")
    ap.add_argument("--profile", default=None,
                    help="folder for JAX profiler traces: adds GPU kernel time per call and "
                         "wall/kernel columns")
    ap.add_argument("--capacity-factors", default="1.0,1.25",
                    help="the capacity-based exchange's factors, comma-separated ('none': no "
                         "capacity rows)")
    ap.add_argument("--recv-capacity", type=int, default=None,
                    help="EPConfig.recv_capacity: expert rows per rank (default: the worst "
                         "case, n * T * min(topk, experts per rank); pairs past it are dropped "
                         "and counted)")
    ap.add_argument("--round-trip", action="store_true",
                    help="also time ep_comm's dispatch then combine in one program")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    ep_comm.distributed.initialize(local_device_count=args.devices)
    n = jax.device_count()
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    topo = topology.parse(args.topology) if args.topology else topology.current()
    if topo.num_ranks != n:
        if topo.num_nodes != 1:
            raise SystemExit(f"bench: the topology has {topo.num_ranks} devices, the run {n}")
        topo = topology.simulated(1, n)
    plans = (args.plans.split(",") if args.plans
             else ["flat", "hierarchical"] if topo.num_nodes > 1 else ["flat"])
    backends = args.backends.split(",") if args.backends else None
    wires = tuple(None if f == "none" else f for f in args.wire_formats.split(","))
    for f in wires:
        if f not in topology.WIRE_FORMATS:
            ap.error(f"--wire-formats: each must be none, e4m3 or mxfp8, got {f!r}")
    return emit((run(BenchConfig(args.tokens, args.hidden, args.topk, args.experts or 32 * n,
                                 dtype, routing), args.warmup, args.iters, backends=backends,
                     topo=topo, plans=plans, wire_formats=wires, profile=args.profile,
                     round_trip=args.round_trip, recv_capacity=args.recv_capacity,
                     capacity_factors=() if args.capacity_factors == "none" else tuple(
                         float(f) for f in args.capacity_factors.split(",")))
                 for routing in args.routing.split(",")), table, args.json)


if __name__ == "__main__":
    main()
