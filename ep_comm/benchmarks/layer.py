"""Benchmark the whole MoE layer and its grouped GEMMs: ``python -m ep_comm.benchmarks.layer``.

One run, side by side, on one routing (uniform top-k over ``--experts``):

- ``gemm``: every pass (forward, dlhs, drhs) of the two expert GEMMs (up: ``H -> 2I``, down:
  ``I -> H``) with each candidate kernel -- ``lax.ragged_dot`` (``xla``; skipped on GPU past
  ``--xla-max-gib`` of its dense mask), tokamax with its heuristics and with the tile configs in
  ``--tokamax-configs`` -- against the dense ceiling: a batched einsum of the same FLOPs with
  every group the same size. ``--tune`` then runs the layer with the fastest tokamax config of
  each pass (what :data:`ep_comm.gemm.TOKAMAX_CONFIGS` should hold).
- ``layer``: ``moe_layer`` (dispatch, SwiGLU experts, combine) forward and forward+backward with
  the chosen grouped GEMM, with ``lax.ragged_dot`` (forward, where it fits), and the dense ceiling
  (the same expert FLOPs as batched einsums, no routing); TFLOP/s, ratio to the ceiling, memory
  per rank (XLA's buffer assignment), dispatch and combine timed alone on the same routing, and
  with ``--profile DIR`` the GPU kernel time split into
  GEMM kernels and the rest (dispatch, combine, activation) from a profiler trace (the first
  implementation's forward and fwd+bwd, the plain layer's forward). At one rank
  also the plain JAX layer (:func:`ep_comm.benchmarks.plain.plain_layer`: argsort, gather, the same
  grouped GEMM, gather back and weighted sum; autodiff's backward), forward and forward+backward,
  and the table ends with ``moe_layer``'s time over it.

``moe_layer`` runs with ``EPConfig(invalid_ids=--invalid-ids)``, default ``"ignore"``: the drawn
ids are in range, the plain layer checks none, and the run-time check's host callback costs a
call host time of its own (``tools/ids_check_probe.py`` times it).

Times are medians of ``--iters`` after ``--warmup``; ``#wrong`` counts outputs off a float64
reference by more than the dtype's tolerance (layer: rank 0's first 64 tokens). JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm.benchmarks import plain
from ep_comm.benchmarks.gemm_sweep import (CANDIDATES, config_label, fastest_by_shape,
                                           gemm_sweep, layer_inputs, routed_sizes, wrong_count)
from ep_comm.benchmarks.overlap import overlap_report
from ep_comm.benchmarks.reference import dense_experts, layer_reference
from ep_comm.benchmarks.timing import emit, gib, hardware, median_us, profile_split, temp_bytes
from ep_comm import gemm as gm
from ep_comm.fused import FUSED, fused_moe


# --implementation's extra row: the fused path keeping u (the up projection's output) for the
# backward instead of recomputing it (ep_comm.fused), to measure the two against each other
# (FUSED, "cutlass-fused", is moe_layer's own name for the fused path); and the fused path with
# its forward kernels loading w's tiles by TMA (tile config 2), against cp.async (config 0)
KEEP_U = "cutlass-keep-u"
FUSED_TMA = "cutlass-fused-tma"
FUSED_ROWS = {KEEP_U: (dict(keep_u=True), "u kept"),
              FUSED_TMA: (dict(forward_config=2), "w by TMA")}


def layer_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, implementation,
                 xla_max_gib, profile, with_xla=True, invalid_ids="ignore"):
    """moe_layer forward and forward+backward, next to the dense ceiling of the same FLOPs: yields
    the report with ``partial=True`` after each measured row (``emit`` saves it, so a run cut by
    a time limit keeps those rows), then the whole report."""
    mesh = jax.make_mesh((jax.device_count(),), ("ep",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape["ep"]
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    L = E // n
    rng = np.random.default_rng(1)
    ids, w, x, w_in, w_out = layer_inputs(rng, n * T, H, I, E, K)
    rows = NamedSharding(mesh, P("ep"))
    put = lambda a: ep_comm.distributed.global_array(a, rows)
    xs, idss, ws, wis, wos = (put(x.astype(dtype)), put(ids), put(w),
                              put(w_in.astype(dtype)), put(w_out.astype(dtype)))
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T,
                           invalid_ids=invalid_ids)
    pairs = T * K  # (token, expert) rows per rank, balanced
    fwd_flops = 2.0 * pairs * (H * 2 * I + I * H)

    def program(impl):
        def f(x, ids, w, wi, wo):
            if impl in FUSED_ROWS:
                return fused_moe(x, ids, w, cfg, wi, wo, **FUSED_ROWS[impl][0])[0]
            return ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo, implementation=impl)
        fwd = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

        def loss(x, w, wi, wo, ids):
            y = jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, ids, w, wi, wo)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return fwd, bwd

    # dense ceiling: T*K rows per rank in L equal groups through both GEMMs (and their grads)
    m_g = pairs // L
    xd = put(np.asarray(rng.standard_normal((n * L, m_g, H)) * 0.5, dtype))

    dense = dense_experts
    dense_fwd = jax.jit(jax.shard_map(dense, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    dense_bwd = jax.jit(jax.grad(lambda xg, wi, wo: jnp.sum(jax.shard_map(
        dense, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(xg, wi, wo).astype(
            jnp.float32) ** 2), argnums=(0, 1, 2)))
    t_dense_f = median_us(dense_fwd, (xd, wis, wos), warmup, iters)
    t_dense_b = median_us(dense_bwd, (xd, wis, wos), warmup, iters)
    print(f"  dense ceiling: forward {t_dense_f:.1f} us, fwd+bwd {t_dense_b:.1f} us", flush=True)

    check = min(T, 64)  # rank 0's first tokens: a float64 reference on the host
    ref = layer_reference(x[:check], ids[:check], w[:check], w_in, w_out, dtype)
    results = [dict(impl="dense einsum (ceiling)", pass_="forward", time_us=t_dense_f,
                    tflops=fwd_flops / t_dense_f / 1e6, x_dense=1.0),
               dict(impl="dense einsum (ceiling)", pass_="fwd+bwd", time_us=t_dense_b,
                    tflops=3 * fwd_flops / t_dense_b / 1e6, x_dense=1.0)]
    report = dict(kind="layer", config=dict(tokens_per_rank=T, hidden=H, intermediate=I,
                                            experts=E, topk=K, dtype=jnp.dtype(dtype).name,
                                            invalid_ids=cfg.ids_check),
                  ranks=n, hardware=hardware(), warmup=warmup, iters=iters, results=results,
                  tokamax_configs=dict(gm.TOKAMAX_CONFIGS),
                  cutlass_configs=dict(gm.grouped_gemm.DEFAULT_CONFIGS),
                  cutlass_shape_configs={f"{p},{k},{n_}": c for (p, k, n_), c in
                                         gm.grouped_gemm.SHAPE_CONFIGS.items()})
    partial = lambda: dict(report, partial=True)  # noqa: E731 (the rows so far, for emit)
    # the layer's exchange halves alone (the same config and routing): where its time goes
    disp = jax.jit(jax.shard_map(functools.partial(ep_comm.dispatch, config=cfg), mesh=mesh,
                                 in_specs=P("ep"), out_specs=P("ep")))
    comb = jax.jit(jax.shard_map(ep_comm.combine, mesh=mesh, in_specs=P("ep"),
                                 out_specs=P("ep")))
    ex, handle = disp(xs, idss, ws)
    for name, fn, args in (("dispatch alone", disp, (xs, idss, ws)),
                           ("combine alone", comb, (ex, handle))):
        t = median_us(fn, args, warmup, iters)
        print(f"  {name}: {t:.1f} us, {t / t_dense_f:.2f}x the dense forward", flush=True)
        results.append(dict(impl=name, pass_="forward", time_us=t, tflops=0.0,
                            x_dense=t / t_dense_f))
    del ex, handle
    yield partial()
    gpu = jax.default_backend() == "gpu"
    variants = [(impl, True) for impl in implementation.split(",")]  # e.g. "cutlass,tokamax"
    gemm_of = lambda impl: gm.resolve_implementation(  # noqa: E731
        "cutlass" if impl in (FUSED, *FUSED_ROWS) else impl, dtype)
    if with_xla and all(gemm_of(impl) != "xla" for impl, _ in variants):
        mask_gib = L * cfg.expert_rows * H * jnp.dtype(dtype).itemsize / 2**30
        variants.append(("xla", not gpu or mask_gib <= xla_max_gib))
    for impl, fits in variants:
        trace_dir = profile if impl == variants[0][0] else None  # (the first one's traces)
        # plain JAX, the same GEMM kernel (n == 1: every expert here)
        if n == 1 and fits and impl not in (FUSED, *FUSED_ROWS):
            kind = gm.resolve_implementation(impl, dtype)
            gemm = (jax.lax.ragged_dot if kind == "xla" else functools.partial(
                ep_comm.grouped_matmul, implementation=kind))
            results += _plain_layer(mesh, gemm, kind, (xs, idss, ws, wis, wos), t_dense_f,
                                    t_dense_b, fwd_flops, ref, check, dtype, H, warmup, iters,
                                    trace_dir)
            yield partial()
        label = (f"moe_layer {FUSED}, {FUSED_ROWS[impl][1]}" if impl in FUSED_ROWS
                 else f"moe_layer {FUSED}" if impl == FUSED
                 else f"moe_layer grouped_matmul={impl}")
        if impl == "auto":
            label += f" ({gm.resolve_implementation('auto', dtype)})"
        if not fits:
            results.append(dict(impl=label, pass_="forward", skipped="dense mask too large"))
            continue
        fwd, bwd = program(impl)
        y = fwd(xs, idss, ws, wis, wos)
        wrong = wrong_count(ep_comm.distributed.to_host(y)[:check], ref, dtype, H)
        t_f = median_us(fwd, (xs, idss, ws, wis, wos), warmup, iters)
        temp = temp_bytes(fwd, (xs, idss, ws, wis, wos))
        print(f"  {label} forward: {t_f:.1f} us, {t_f / t_dense_f:.2f}x dense "
              f"({t_dense_f:.1f} us), #wrong {wrong}, temp {gib(temp)}", flush=True)
        results.append(_x_plain(results, dict(
            impl=label, gemm=gemm_of(impl), pass_="forward", time_us=t_f,
            tflops=fwd_flops / t_f / 1e6, x_dense=t_f / t_dense_f, wrong=wrong,
            temp_bytes=temp)))
        if trace_dir:
            results[-1]["trace"] = profile_split(os.path.join(trace_dir, f"{impl}_forward"), fwd,
                                                  (xs, idss, ws, wis, wos), label + " forward")
        yield partial()
        if gpu and impl == "xla":
            continue  # its drhs is a dense masked product over every group: forward shows enough
        t_b = median_us(bwd, (xs, ws, wis, wos, idss), warmup, iters)
        temp = temp_bytes(bwd, (xs, ws, wis, wos, idss))
        rep = _x_plain(results, dict(impl=label, gemm=gemm_of(impl), pass_="fwd+bwd",
                                     time_us=t_b, tflops=3 * fwd_flops / t_b / 1e6,
                                     x_dense=t_b / t_dense_b, temp_bytes=temp))
        if trace_dir:
            rep["trace"] = profile_split(os.path.join(trace_dir, f"{impl}_fwd_bwd"), bwd,
                                          (xs, ws, wis, wos, idss), label + " fwd+bwd")
        print(f"  {label} fwd+bwd: {t_b:.1f} us, {t_b / t_dense_b:.2f}x dense, temp {gib(temp)}",
              flush=True)
        results.append(rep)
        yield partial()
    yield report


def _x_plain(results, row):
    """``row`` with ``x_plain``: its time over the plain JAX layer's on the same grouped GEMM
    (``row["gemm"]``) and pass, where ``results`` holds that row (same run)."""
    plain = [r["time_us"] for r in results
             if r.get("plain") == row["gemm"] and r["pass_"] == row["pass_"]]
    return dict(row, x_plain=row["time_us"] / plain[0]) if plain else row


def _plain_layer(mesh, gemm, kind, args, t_dense_f, t_dense_b, flops, ref, check, dtype, H,
                 warmup, iters, profile=None):
    """The plain JAX layer's rows (forward, fwd+bwd) with the grouped GEMM ``gemm``; with
    ``profile`` (a folder), the forward's GPU kernel time split as :func:`profile_split` does."""
    smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    f = lambda x, ids, w, wi, wo: plain.plain_layer(x, ids, w, wi, wo, gemm)  # noqa: E731
    fwd = jax.jit(smap(f))
    bwd = jax.jit(jax.grad(lambda x, w, wi, wo, ids: jnp.sum(smap(f)(x, ids, w, wi, wo).astype(
        jnp.float32) ** 2), argnums=(0, 1, 2, 3)))
    x, ids, w, wi, wo = args
    label = f"plain JAX layer ({kind})"
    wrong = wrong_count(ep_comm.distributed.to_host(fwd(*args))[:check], ref, dtype, H)
    t_f = median_us(fwd, args, warmup, iters)
    t_b = median_us(bwd, (x, w, wi, wo, ids), warmup, iters)
    temp_f, temp_b = temp_bytes(fwd, args), temp_bytes(bwd, (x, w, wi, wo, ids))
    print(f"  {label}: forward {t_f:.1f} us (temp {gib(temp_f)}), fwd+bwd {t_b:.1f} us "
          f"(temp {gib(temp_b)})", flush=True)
    forward = dict(impl=label, plain=kind, pass_="forward", time_us=t_f,
                   tflops=flops / t_f / 1e6, x_dense=t_f / t_dense_f, wrong=wrong,
                   temp_bytes=temp_f)
    if profile:
        forward["trace"] = profile_split(os.path.join(profile, "plain_forward"), fwd, args,
                                          label + " forward")
    return [forward,
            dict(impl=label, plain=kind, pass_="fwd+bwd", time_us=t_b,
                 tflops=3 * flops / t_b / 1e6, x_dense=t_b / t_dense_b, temp_bytes=temp_b)]


def rounds_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, factor: float):
    """The layer at the worst-case capacity (one round) against rounds of ``factor`` times the
    balanced rows per rank, for uniform, Zipf-0.8 and one-hot-expert routing."""
    from ep_comm.benchmarks.dispatch import make_routing

    mesh = jax.make_mesh((jax.device_count(),), ("ep",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape["ep"]
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((n * T, H)) * 0.5).astype(dtype)
    w = rng.random((n * T, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(dtype)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(dtype)
    put = lambda a: ep_comm.distributed.global_array(a, NamedSharding(mesh, P("ep")))
    balanced = T * K
    capacity = max(1, int(factor * balanced))
    results = []
    for routing in ("uniform", "zipf-0.8", "one hot expert"):
        if routing == "one hot expert":  # every token's first choice is expert 0
            ids = make_routing(rng, "uniform", n * T, K, E)
            hot = ids == 0
            ids[hot] = ids[:, :1].repeat(K, 1)[hot]
            ids[:, 0] = 0
        else:
            ids = make_routing(rng, "uniform" if routing == "uniform" else "skewed", n * T, K, E)
        args = tuple(map(put, (x, ids, w, w_in, w_out)))
        outs = {}
        for cap in (None, capacity):
            cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T,
                                   recv_capacity=cap, capacity_factor=None)  # None: worst case

            def f(x, ids, w, wi, wo, cfg=cfg):
                out = ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo, return_handle=True)
                return out.y, out.rounds
            fwd = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
            y, rounds = fwd(*args)
            t = median_us(fwd, args, warmup, iters)
            outs[cap] = ep_comm.distributed.to_host(y).astype(np.float64)
            results.append(dict(routing=routing, capacity=cfg.expert_rows,
                                x_balanced=cfg.expert_rows / balanced,
                                rounds=int(ep_comm.distributed.to_host(rounds).max()),
                                time_us=t, temp_bytes=temp_bytes(fwd, args),
                                max_load=int(_max_load(ids, n, E)), dropped=0))
        ref = outs[None]
        eps = float(jnp.finfo(dtype).eps)
        results[-1]["wrong_vs_one_round"] = int(np.sum(
            np.abs(outs[capacity] - ref) > 8 * eps * (1 + np.abs(ref))))
        results[-1]["x_one_round_time"] = results[-1]["time_us"] / results[-2]["time_us"]
    return dict(kind="rounds", config=dict(tokens_per_rank=T, hidden=H, intermediate=I,
                                           experts=E, topk=K, dtype=jnp.dtype(dtype).name,
                                           factor=factor),
                ranks=n, hardware=hardware(), warmup=warmup, iters=iters, results=results)


def _max_load(ids, n, E):
    L = E // n
    distinct = np.sort(ids, axis=1)
    distinct = np.where(np.diff(distinct, axis=1, prepend=-2) != 0, distinct, -1)
    ranks = np.where(distinct >= 0, distinct // L, n)
    return np.bincount(ranks.reshape(-1), minlength=n + 1)[:n].max()


def _cutlass_configs(ap, text):
    """``--cutlass-configs``' ``pass=config`` pairs as a dict (``ap.error`` on a bad one)."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in gm.PASSES or not value.isdigit() \
                or int(value) not in gm.grouped_gemm.CONFIGS:
            ap.error(f"--cutlass-configs: each item must be pass=config with pass one of "
                     f"{gm.PASSES} and config one of {gm.grouped_gemm.CONFIGS}, got {item!r}")
        out[name] = int(value)
    return out


def table(rep) -> str:
    head = f"# {rep['hardware']}\n# median of {rep['iters']} after {rep['warmup']} warm-up\n"
    if rep["kind"] == "rounds":
        c = rep["config"]
        lines = [head + f"# moe_layer in rounds: {rep['ranks']} rank(s), {c['tokens_per_rank']} "
                 f"tokens/rank, top-{c['topk']} of {c['experts']}, H={c['hidden']}, I="
                 f"{c['intermediate']}, {c['dtype']}; capacity = expert rows per rank per round "
                 f"(x balanced = / T*topk); max load = most pairs one rank must serve",
                 f"{'routing':<16}{'capacity':>9}{'x bal':>7}{'max load':>9}{'rounds':>7}"
                 f"{'time(us)':>11}{'x 1 round':>10}{'temp':>11}{'dropped':>8}{'#wrong':>8}"]
        for r in rep["results"]:
            temp = f"{r['temp_bytes'] / 2**20:>9.2f}MB" if r.get("temp_bytes") is not None \
                else f"{'-':>11}"
            ratio = f"{r['x_one_round_time']:>10.2f}" if "x_one_round_time" in r else f"{'-':>10}"
            wrong = f" {r['wrong_vs_one_round']:>7d}" if "wrong_vs_one_round" in r else f"{'-':>8}"
            lines.append(f"{r['routing']:<16}{r['capacity']:>9d}{r['x_balanced']:>7.2f}"
                         f"{r['max_load']:>9d}{r['rounds']:>7d}{r['time_us']:>11.1f}{ratio}"
                         f"{temp}{r['dropped']:>8d}{wrong}")
        return "\n".join(lines)
    if rep["kind"] == "overlap":
        c = rep["config"]
        lines = [head + f"# moe_layer as a pipeline of num_chunks chunks: {rep['ranks']} rank(s), "
                 f"{c['tokens_per_rank']} tokens/rank, top-{c['topk']} of {c['experts']}, H="
                 f"{c['hidden']}, I={c['intermediate']}, shared expert I="
                 f"{c.get('shared_intermediate', 0)}, {c['dtype']}; x experts = time / the "
                 f"experts' GEMMs alone; pipe = calls issued back to back (host ahead of the "
                 f"device); overlap = exchange kernel time while a GEMM kernel ran / exchange "
                 f"kernel time (trace)",
                 f"{'num_chunks':<12}{'time(us)':>10}{'x experts':>10}{'pipe(us)':>10}"
                 f"{'x experts':>10}{'fwd+bwd':>10}{'exch(us)':>10}{'overlap':>9}{'#wrong':>8}"
                 f"  schedule"]
        for r in rep["results"]:
            fb = f"{r['fwd_bwd_us']:>10.1f}" if "fwd_bwd_us" in r else f"{'-':>10}"
            ex = (f"{r['exchange_kernel_us']:>10.1f}{r['overlapped_fraction']:>9.3f}"
                  if "exchange_kernel_us" in r else f"{'-':>10}{'-':>9}")
            wrong = f"{r['wrong_vs_1']:>8d}" if "wrong_vs_1" in r else f"{'-':>8}"
            pipe = (f"{r['pipe_us']:>10.1f}{r['pipe_x_experts']:>10.3f}" if "pipe_us" in r
                    else f"{'-':>10}{'-':>10}")
            lines.append(f"{r['chunks']:<12}{r['time_us']:>10.1f}{r['x_experts']:>10.3f}{pipe}"
                         f"{fb}{ex}{wrong}  {r.get('schedule', '')}")
        return "\n".join(lines)
    if rep["kind"] == "gemm":
        c = rep["config"]
        groups = ("equal groups" if c.get("group_sizes", "equal") == "equal" else
                  f"groups of the layer's routing ({min(c['sizes'])}-{max(c['sizes'])} rows)")
        lines = [head + f"# grouped GEMM passes: {c['rows']} rows in {c['groups']} {groups}, "
                 f"H={c['hidden']}, I={c['intermediate']} (up: H->2I, down: I->H), {c['dtype']}",
                 f"{'gemm':<6}{'pass':<9}{'impl':<34}{'time(us)':>10}{'TFLOP/s':>9}"
                 f"{'x dense':>9}{'#wrong':>8}"]
        for r in rep["results"]:
            if "skipped" in r:
                lines.append(f"{r['gemm']:<6}{r['pass_']:<9}{r['impl']:<34}  skipped: "
                             f"{r['skipped']}")
                continue
            lines.append(f"{r['gemm']:<6}{r['pass_']:<9}{r['impl']:<34}{r['time_us']:>10.1f}"
                         f"{r['tflops']:>9.1f}{r['x_dense']:>9.2f} {r['wrong']:>7d}")
        lines.append(f"# fastest tokamax config per pass: "
                     f"{ {p: config_label(c) for p, c in rep['best'].items()} }; CUTLASS: "
                     f"{rep.get('best_cutlass', {})}; CUTLASS per (pass, K, N) of the weight "
                     f"(SHAPE_CONFIGS): {rep.get('best_cutlass_by_shape', {})}")
        return "\n".join(lines)
    c = rep["config"]
    lines = [head + f"# moe_layer: {rep['ranks']} rank(s), {c['tokens_per_rank']} tokens/rank, "
             f"top-{c['topk']} of {c['experts']} experts, H={c['hidden']}, SwiGLU I="
             f"{c['intermediate']}, {c['dtype']}; ceiling = the same expert FLOPs as dense "
             f"batched einsums; tokamax configs {rep['tokamax_configs']}; CUTLASS configs "
             f"{rep.get('cutlass_configs')}, per (pass, K, N) {rep.get('cutlass_shape_configs')}",
             f"{'impl':<44}{'pass':<9}{'time(us)':>11}{'TFLOP/s':>9}{'x dense':>9}{'#wrong':>8}"
             f"{'temp':>11}"]
    for r in rep["results"]:
        if "skipped" in r:
            lines.append(f"{r['impl']:<44}{r['pass_']:<9}  skipped: {r['skipped']}")
            continue
        temp = f"{r['temp_bytes'] / 2**30:>9.2f}GB" if r.get("temp_bytes") is not None \
            else f"{'-':>11}"
        wrong = f" {r['wrong']:>7d}" if "wrong" in r else f"{'-':>8}"
        lines.append(f"{r['impl']:<44}{r['pass_']:<9}{r['time_us']:>11.1f}{r['tflops']:>9.1f}"
                     f"{r['x_dense']:>9.2f}{wrong}{temp}")
        if "trace" in r:
            lines.append(f"#   trace: {json.dumps(r['trace'])}")
    for r in rep["results"]:
        if "x_plain" in r:
            lines.append(f"# {r['impl']} {r['pass_']}: {r['x_plain']:.2f}x the plain JAX layer "
                         f"with the same grouped GEMM ({r['gemm']})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="MoE layer and grouped GEMM benchmark")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=32, help="SwiGLU width I per expert")
    ap.add_argument("--experts", type=int, default=None, help="default: 4 per rank")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--parts", default="gemm,layer",
                    help="comma-separated, run in this order: gemm, layer, rounds, overlap")
    ap.add_argument("--chunks", default="1,2,4,8,auto",
                    help="overlap: the num_chunks values to run (comma-separated)")
    ap.add_argument("--chunk-by", default="tokens",
                    help="overlap: comma-separated EPConfig.chunk_by values (tokens, experts)")
    ap.add_argument("--shared-intermediate", type=int, default=0,
                    help="overlap: a shared SwiGLU expert of this width (0: none)")
    ap.add_argument("--rounds-factor", type=float, default=2.0,
                    help="rounds: capacity per round in balanced rows (T * topk) per rank")
    ap.add_argument("--tune", action="store_true",
                    help="run the layer with the fastest tokamax configs per pass and CUTLASS "
                         "configs per pass and weight shape of the GEMM part (with --groups "
                         "routed: picked on the layer's own routed groups)")
    ap.add_argument("--groups", default="equal", choices=("equal", "routed"),
                    help="the GEMM part's group sizes: equal, or those the layer part's routing "
                         "gives rank 0's experts")
    ap.add_argument("--cutlass-configs", default=None,
                    help="the CUTLASS tile config per pass, e.g. forward=0,dlhs=0,drhs=2 "
                         "(default: collectives.grouped_gemm.DEFAULT_CONFIGS)")
    ap.add_argument("--implementation", default="auto",
                    help="grouped_matmul's, for the layer: comma-separated, e.g. "
                         f"cutlass,{FUSED},tokamax; {KEEP_U}: the fused path keeping u for the "
                         f"backward; {FUSED_TMA}: the fused path with w's tiles by TMA")
    ap.add_argument("--xla-max-gib", type=float, default=40.0,
                    help="skip lax.ragged_dot on GPU when its dense mask exceeds this")
    ap.add_argument("--no-tile-sweep", action="store_true",
                    help="the GEMM part without its tokamax tile configs (defaults only)")
    ap.add_argument("--no-xla", action="store_true",
                    help="leave lax.ragged_dot out of the layer comparison")
    ap.add_argument("--invalid-ids", default="ignore", choices=("ignore", "warn", "raise"),
                    help="moe_layer's EPConfig.invalid_ids (default ignore: the ids are drawn "
                         "in range and the plain layer checks none; tools/ids_check_probe.py "
                         "times the check)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default=None,
                    help="trace the layer's forward and fwd+bwd (the first implementation's) and "
                         "the plain layer's forward into this folder")
    ap.add_argument("--devices", type=int, default=None, help="CPU devices per process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cutlass_configs is not None:  # (checked before any device is set up)
        gm.grouped_gemm.DEFAULT_CONFIGS.update(_cutlass_configs(ap, args.cutlass_configs))
    ep_comm.distributed.initialize(local_device_count=args.devices)
    n = jax.device_count()
    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    E = args.experts or 4 * n
    parts = args.parts.split(",")

    def gemm_part():
        sizes = None
        if args.groups == "routed":
            sizes = routed_sizes(n, args.tokens, E, args.topk)
            rows = int(sizes.sum())
        else:
            rows = args.tokens * args.topk  # the (token, expert) rows one rank gets, balanced
        res, best, best_cutlass = gemm_sweep(rows, args.hidden, args.intermediate, E // n,
                                             dtype, args.warmup, args.iters,
                                             {} if args.no_tile_sweep else CANDIDATES,
                                             log=lambda s: print(s, flush=True), sizes=sizes)
        by_shape = fastest_by_shape(res, "ep_comm cutlass")
        if args.tune:  # (CUTLASS: per pass and weight shape, as SHAPE_CONFIGS holds them)
            gm.TOKAMAX_CONFIGS.update(best)
            gm.grouped_gemm.SHAPE_CONFIGS.update(by_shape)
        yield dict(kind="gemm", config=dict(rows=rows, groups=E // n, hidden=args.hidden,
                                            intermediate=args.intermediate,
                                            dtype=dtype.name, group_sizes=args.groups,
                                            sizes=None if sizes is None else sizes.tolist()),
                   hardware=hardware(), warmup=args.warmup, iters=args.iters, results=res,
                   best=best, best_cutlass=best_cutlass,
                   best_cutlass_by_shape={f"{p},{k},{n_}": c for (p, k, n_), c in
                                          by_shape.items()})

    def rounds_part():
        yield rounds_report(args.tokens, args.hidden, args.intermediate, E, args.topk, dtype,
                            args.warmup, args.iters, args.rounds_factor)

    def overlap_part():
        yield overlap_report(args.tokens, args.hidden, args.intermediate, E, args.topk,
                             dtype, args.warmup, args.iters,
                             [c if c == "auto" else int(c) for c in args.chunks.split(",")],
                             args.profile, shared_inter=args.shared_intermediate,
                             chunk_by=tuple(args.chunk_by.split(",")))

    def layer_part():
        yield from layer_report(args.tokens, args.hidden, args.intermediate, E, args.topk,
                                dtype, args.warmup, args.iters, args.implementation,
                                args.xla_max_gib, args.profile, with_xla=not args.no_xla,
                                invalid_ids=args.invalid_ids)

    part_fns = dict(gemm=gemm_part, rounds=rounds_part, overlap=overlap_part, layer=layer_part)
    unknown = [p for p in parts if p not in part_fns]
    if unknown:
        ap.error(f"--parts: each must be one of {sorted(part_fns)}, got {unknown}")

    def reports():  # in the order --parts names them (a time limit cuts the last)
        for p in parts:
            yield from part_fns[p]()

    return emit(reports(), table, args.json)


if __name__ == "__main__":
    main()
