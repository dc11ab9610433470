"""The chunked pipeline's overlap (``python -m ep_comm.benchmarks.layer --parts overlap``): the
layer at each chunk count against the experts alone, whether the compiled schedule is the
pipeline's, and with a profile how much of the exchange ran under an expert GEMM."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm import pipeline
from ep_comm.benchmarks.gemm_sweep import draw_ids
from ep_comm.benchmarks.timing import hardware, is_gemm_kernel, median_us, pipelined_us, traced_kernels


def overlap_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, chunk_counts,
                   profile=None, with_grad=True, shared_inter=0, chunk_by=("tokens",)):
    """The chunked pipeline (``EPConfig.num_chunks``) against the experts alone.

    ``experts alone``: the SwiGLU grouped GEMMs over the whole dispatched buffer, nothing else
    (the ceiling the layer approaches when its exchanges hide under them and its other passes
    are small). Per chunk count: the layer's forward time and its ratio to the experts alone --
    each call waited for (``time_us``), and issued ``iters`` times back to back and waited for
    once (``pipe_us``, :func:`ep_comm.benchmarks.timing.pipelined_us`: as in a model's step, where the
    host enqueues ahead of the device, so the host's launch latency does not count) --
    ``#wrong`` against the one-chunk layer, whether the compiled schedule is the pipeline's
    (:func:`ep_comm.pipeline.check_schedule`), and with ``profile`` the exchange kernels' time
    and the part of it that ran while an expert GEMM kernel ran, from a profiler trace. On one
    device the layer exchanges nothing (its route is local): ``EP_COMM_LOCAL_EXCHANGE=1`` is set
    here so that one rank runs its exchanges through the transport (a self-exchange), as it
    would with peers. ``shared_inter``: a shared SwiGLU expert of that width (0: none), in the
    layer and in the experts alone. ``chunk_by``: the ``EPConfig.chunk_by`` values to run each
    chunk count with (a count the mode does not allow is left out)."""
    os.environ["EP_COMM_LOCAL_EXCHANGE"] = "1"
    mesh = jax.make_mesh((jax.device_count(),), ("ep",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape["ep"]
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    rng = np.random.default_rng(3)
    ids = draw_ids(rng, n * T, E, K)
    w = rng.random((n * T, K)).astype(np.float32)
    x = (rng.standard_normal((n * T, H)) * 0.5).astype(dtype)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(dtype)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(dtype)
    put = lambda a: ep_comm.distributed.global_array(a, NamedSharding(mesh, P("ep")))
    Is = shared_inter
    shared = ((rng.standard_normal((n, H, 2 * Is)) / np.sqrt(H)).astype(dtype),
              (rng.standard_normal((n, Is, H)) / np.sqrt(Is)).astype(dtype)) if Is else ()
    args = tuple(map(put, (x, ids, w, w_in, w_out) + shared))  # shared: one copy per rank
    smap = lambda f, out=P("ep"): jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"),
                                                        out_specs=out))
    sw = lambda s: dict(shared_w_in=s[0][0], shared_w_out=s[1][0]) if s else {}  # noqa: E731
    base = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T)
    ex, handle = smap(functools.partial(ep_comm.dispatch, config=base))(*args[:3])
    gs = handle.group_sizes
    def experts_alone(e, g, wi, wo, x, *s):
        y = ep_comm.swiglu_experts(e, g, wi, wo, zero_past_groups=False)  # as the layer
        if s:  # and the shared expert over the tokens
            return y, ep_comm.layer.shared_swiglu(x, s[0][0], s[1][0])
        return y
    alone = smap(experts_alone)
    alone_args = (ex, gs, args[3], args[4], args[0], *args[5:])
    t_alone = median_us(alone, alone_args, warmup, iters)
    p_alone = pipelined_us(alone, alone_args, warmup, iters)
    del ex, handle, alone_args
    results = [dict(chunks="experts alone", time_us=t_alone, x_experts=1.0, pipe_us=p_alone,
                    pipe_x_experts=1.0)]
    print(f"  experts alone: {t_alone:.1f} us, back to back {p_alone:.1f} us", flush=True)
    ref = None
    runs = []
    for by in chunk_by:
        for C in chunk_counts:
            if (by, C) in runs or (C == 1 and by != chunk_by[0]):
                continue  # one chunk is the same layer whatever it would cut
            try:
                dataclasses.replace(base, num_chunks=C, chunk_by=by)
            except ValueError as e:
                print(f"  chunk_by={by} num_chunks={C}: left out ({e})", flush=True)
                continue
            runs.append((by, C))
    for by, C in runs:
        cfg = dataclasses.replace(base, num_chunks=C, chunk_by=by)
        f = lambda x, ids, w, wi, wo, *s, cfg=cfg: ep_comm.moe_layer(x, ids, w, cfg, w_in=wi,
                                                                     w_out=wo, **sw(s))
        fwd = smap(f)
        chunks = pipeline.resolve_chunks(cfg, H, jnp.dtype(dtype), 6.0 * H * I,
                                         3.0 * (E // n) * H * I * jnp.dtype(dtype).itemsize)
        y = np.asarray(ep_comm.distributed.to_host(fwd(*args)), np.float64)
        if ref is None:
            ref = y
        eps = float(jnp.finfo(dtype).eps)
        wrong = int(np.sum(np.abs(y - ref) > 4 * eps * (1 + np.abs(ref))))
        t = median_us(fwd, args, warmup, iters)
        t_pipe = pipelined_us(fwd, args, warmup, iters)
        order = pipeline.schedule_order(fwd.lower(*args).compile().as_text())
        label = f"{C} ({chunks})" if C == "auto" else str(C)
        rep = dict(chunks=label if by == "tokens" else f"{label} experts", num_chunks=chunks,
                   chunk_by=by,
                   expert_rows=pipeline.chunk_config(cfg, chunks).expert_rows,
                   time_us=t, x_experts=t / t_alone, pipe_us=t_pipe,
                   pipe_x_experts=t_pipe / p_alone, wrong_vs_1=wrong,
                   schedule=_schedule_verdict(order, chunks),
                   order=pipeline.order_summary(order))
        if profile:
            rep.update(_overlap_in_trace(os.path.join(profile, f"chunks{chunks}_{by}"), fwd,
                                         args))
        if with_grad and C in (1, 4):
            loss = lambda *a, f=f: jnp.sum(jax.shard_map(f, mesh=mesh, in_specs=P("ep"),
                                                         out_specs=P("ep"))(*a).astype(
                                                             jnp.float32) ** 2)
            bwd = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4) + tuple(range(5, len(args)))))
            rep["fwd_bwd_us"] = median_us(bwd, args, warmup, iters)
        print(f"  num_chunks={rep['chunks']} ({rep['expert_rows']} expert rows per chunk): "
              f"{t:.1f} us, {t / t_alone:.3f}x experts alone (back to back {t_pipe:.1f} us, "
              f"{t_pipe / p_alone:.3f}x), "
              f"#wrong {wrong}, schedule {rep['schedule']}, overlapped "
              f"{rep.get('overlapped_fraction', float('nan')):.3f}"
              + (f", fwd+bwd {rep['fwd_bwd_us']:.1f} us" if "fwd_bwd_us" in rep else ""),
              flush=True)
        results.append(rep)
    return dict(kind="overlap", config=dict(tokens_per_rank=T, hidden=H, intermediate=I,
                                            experts=E, topk=K, dtype=jnp.dtype(dtype).name,
                                            shared_intermediate=Is,
                                            backend=ep_comm.EPConfig.backend),
                ranks=n, hardware=hardware(), warmup=warmup, iters=iters, results=results)

def _schedule_verdict(order, chunks):
    problems = [] if chunks == 1 else pipeline.check_schedule(order, chunks)
    verdict = "pipeline" if not problems else "; ".join(problems[:2])
    if jax.default_backend() == "cpu":  # no concurrency there, and no barriers when it schedules
        verdict = f"XLA:CPU, barriers removed before scheduling: {verdict}"
    return verdict

_EXCHANGE_KERNELS = ("self_copy", "nccl", "pack_kernel", "publish_kernel")

def _overlap_in_trace(folder, fn, args):
    """Exchange kernel time in one call's trace, and the part of it spent while an expert GEMM
    kernel ran (on another stream)."""
    kernels = traced_kernels(folder, fn, args)
    if kernels is None:
        return {"trace_error": f"no trace under {folder}"}
    comm = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels
                  if any(s in k["name"] for s in _EXCHANGE_KERNELS))
    gemm = []  # the union of GEMM kernel intervals
    for a, b in sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels if is_gemm_kernel(k)):
        if gemm and a <= gemm[-1][1]:
            gemm[-1][1] = max(gemm[-1][1], b)
        else:
            gemm.append([a, b])
    both = sum(max(0.0, min(c1, g1) - max(c0, g0)) for c0, c1 in comm for g0, g1 in gemm)
    total = sum(b - a for a, b in comm)
    return dict(exchange_kernel_us=total / 3, overlapped_us=both / 3,
                overlapped_fraction=both / total if total else float("nan"),
                gemm_kernel_us=sum(b - a for a, b in gemm) / 3,
                exchange_streams=sorted({k["stream"] for k in kernels
                                         if any(s in k["name"] for s in _EXCHANGE_KERNELS)}))
