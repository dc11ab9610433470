"""Benchmark the whole MoE layer and its grouped GEMMs: ``python -m ep_comm.layer_bench``.

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
  also the plain JAX layer (:func:`ep_comm.baselines.moe_layer`: argsort, gather, the same
  grouped GEMM, gather back and weighted sum; autodiff's backward), forward and forward+backward,
  and the table ends with ``moe_layer``'s time over it.

Times are medians of ``--iters`` after ``--warmup``; ``#wrong`` counts outputs off a float64
reference by more than the dtype's tolerance (layer: rank 0's first 64 tokens). JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm.collectives.timing import emit, hardware, median_us, pipelined_us, trace_kernels
from ep_comm import baselines
from ep_comm import gemm as gm
from ep_comm import pipeline
from ep_comm.fused import FUSED, fused_moe

# tile configs tried per pass (tokamax Mosaic GPU, Hopper); grid_minor_dim 0 = M, 1 = N. The
# weight-gradient kernel (drhs) runs a plain (M/bm, N/bn, groups) grid: persistence and grid order
# do not apply to it, tile shape and stages do.
def _cfg(m, n, k, stages, **kw):
    return dict(block_m=m, block_n=n, block_k=k, num_stages=stages, split_k=1,
                persistent=kw.pop("persistent", False), **kw)


CANDIDATES = {
    "forward": [_cfg(128, 128, 64, 4), _cfg(128, 128, 64, 4, persistent=True),
                _cfg(128, 128, 64, 4, grid_minor_dim=0, grid_tile_width=8),
                _cfg(128, 256, 64, 3, grid_minor_dim=0, grid_tile_width=8),
                _cfg(128, 128, 64, 4, grid_minor_dim=0, grid_tile_width=16)],
    "drhs": [_cfg(128, 128, 64, 4), _cfg(128, 256, 64, 3), _cfg(128, 128, 128, 3),
             _cfg(64, 256, 64, 4), _cfg(128, 64, 128, 4)],
}
CANDIDATES["dlhs"] = CANDIDATES["forward"]


def _label(cfg):
    if cfg is None:
        return "ep_comm default"
    if cfg == "heuristics":
        return "heuristics"
    s = f"m{cfg['block_m']}n{cfg['block_n']}k{cfg['block_k']}s{cfg['num_stages']}"
    s += "p" if cfg.get("persistent") else ""
    if "grid_tile_width" in cfg:
        s += f"t{cfg['grid_tile_width']}{'MN'[cfg.get('grid_minor_dim', 1)]}"
    return s


def gemm_sweep(rows, hidden, inter, groups, dtype, warmup, iters, candidates, log=None,
               sizes=None):
    """Every pass of the up and down GEMMs with each candidate (``{pass: [tokamax config]}``);
    returns (results, best tokamax configs, best CUTLASS configs). ``sizes``: the groups' rows
    (``rows`` in all), e.g. a routing's (:func:`routed_sizes`); default equal groups. The dense
    ceiling is equal groups either way: the same FLOPs without the raggedness."""
    if sizes is None:
        if rows % groups:
            raise ValueError(f"layer_bench: the GEMM sweep needs rows={rows} divisible by "
                             f"groups={groups}")
        sizes = np.full((groups,), rows // groups)
    sizes = np.asarray(sizes, np.int64)
    if sizes.shape != (groups,) or sizes.sum() != rows or (sizes < 0).any():
        raise ValueError(f"layer_bench: sizes must be {groups} group sizes >= 0 adding up to "
                         f"rows={rows}, got {sizes.tolist()}")
    rng = np.random.default_rng(0)
    gs = jnp.asarray(sizes, jnp.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    gpu = jax.default_backend() == "gpu"
    impls = [("xla", None)]
    if gm.tokamax_available() and jnp.dtype(dtype).itemsize == 2:
        impls += [("tokamax", None), ("tokamax", "heuristics")]
    if gm.grouped_gemm.available() is None and jnp.dtype(dtype).itemsize == 2:
        impls += [("cutlass", c) for c in gm.grouped_gemm.CONFIGS]
    results = []
    for name, k, n in (("up", hidden, 2 * inter), ("down", inter, hidden)):
        a = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        b = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), dtype)
        dy = jnp.asarray(rng.standard_normal((rows, n)), dtype)
        flops = 2.0 * rows * k * n
        # dense ceiling: equal groups as one batched einsum (the same FLOPs, no raggedness)
        m_g = rows // groups
        ab = a[: m_g * groups].reshape(groups, m_g, k)
        dense = {
            "forward": (jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b)), (ab, b)),
            "dlhs": (jax.jit(lambda d, b: jnp.einsum("gmn,gkn->gmk", d, b)),
                     (dy[: m_g * groups].reshape(groups, m_g, n), b)),
            "drhs": (jax.jit(lambda a, d: jnp.einsum("gmk,gmn->gkn", a, d)),
                     (ab, dy[: m_g * groups].reshape(groups, m_g, n))),
        }
        for pass_name in gm.PASSES:
            fn, args = dense[pass_name]
            t_dense = median_us(fn, args, warmup, iters)
            results.append(dict(gemm=name, pass_=pass_name, impl="dense einsum", time_us=t_dense,
                                tflops=flops / t_dense / 1e6, x_dense=1.0, wrong=0))
            if pass_name == "drhs":
                operands = (a, dy)
            else:
                # dlhs takes w as the forward did (a kernel needing it transposed pays for that)
                operands = (a, b) if pass_name == "forward" else (dy, b)

            # reference: each group's product in float32 on the device
            def ref_fn(pass_name=pass_name, operands=operands):
                return np.asarray(_grouped_reference(pass_name, starts)(*operands))
            ref = None
            for impl, cfg in impls + [("tokamax", c) for c in candidates.get(pass_name, [])
                                      if len(impls) > 1 and gpu]:  # (Mosaic GPU configs)
                label = (f"{impl} {_label(cfg)}" if impl == "tokamax" else
                         f"ep_comm cutlass config {cfg}" if impl == "cutlass" else
                         "lax.ragged_dot")
                if impl == "xla" and gpu and len(impls) > 1:
                    results.append(dict(gemm=name, pass_=pass_name, impl=label, skipped=(
                        "on GPU a dense masked product over every group (the layer's forward "
                        "row shows it)")))
                    continue
                f = jax.jit(functools.partial(gm.pass_kernel(pass_name, impl, cfg),
                                              out_dtype=jnp.dtype(dtype)))
                try:
                    out = f(*operands, gs)
                    t = median_us(f, (*operands, gs), warmup, iters)
                except Exception as e:  # a tile config this GPU cannot run: report, go on
                    results.append(dict(gemm=name, pass_=pass_name, impl=label,
                                        skipped=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                ref = ref_fn() if ref is None else ref
                results.append(dict(gemm=name, pass_=pass_name, impl=label, time_us=t,
                                    tflops=flops / t / 1e6, x_dense=t / t_dense,
                                    wrong=_wrong(out, ref, dtype, k), config=cfg))
                if log:
                    log(f"  {name} {pass_name} {label}: {t:.1f} us, {t / t_dense:.2f}x dense")
    return results, _fastest(results, "tokamax"), _fastest(results, "ep_comm cutlass")


def _fastest(results, impl):
    """Per pass, the config of ``impl`` (a label prefix) fastest over both GEMMs, among those
    right in both (a ``None`` config, the defaults in use, is not a candidate)."""
    best = {}
    for pass_name in gm.PASSES:
        totals = {}
        for r in results:
            if r["pass_"] == pass_name and r["impl"].startswith(impl) and "time_us" in r \
                    and r["wrong"] == 0 and r["config"] is not None:
                key = _label(r["config"]) if isinstance(r["config"], dict) else r["config"]
                totals.setdefault(key, [r["config"], 0.0, 0])
                totals[key][1] += r["time_us"]
                totals[key][2] += 1
        full = [v for v in totals.values() if v[2] == 2]
        if full:
            best[pass_name] = min(full, key=lambda v: v[1])[0]
    return best


def _grouped_reference(pass_name, starts):
    """One pass over the groups ``[starts[g], starts[g + 1])`` in float32 at the highest
    precision, group by group (static slices): forward/dlhs give the groups' rows, drhs each
    group's ``a_g^T dy_g`` (zeros for an empty group)."""
    def f(p, q):
        p, q = p.astype(jnp.float32), q.astype(jnp.float32)
        with jax.default_matmul_precision("highest"):
            parts = []
            for g in range(len(starts) - 1):
                lo, hi = int(starts[g]), int(starts[g + 1])
                if pass_name == "drhs":
                    parts.append(p[lo:hi].T @ q[lo:hi])
                elif pass_name == "forward":
                    parts.append(p[lo:hi] @ q[g])
                else:
                    parts.append(p[lo:hi] @ q[g].T)
            return jnp.stack(parts) if pass_name == "drhs" else jnp.concatenate(parts)
    return jax.jit(f)


def _draw_ids(rng, tokens, experts, topk):
    """Uniform top-``topk`` routing: each token's distinct experts, drawn from ``rng``."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int32)


def routed_sizes(ranks, tokens, experts, topk):
    """The group sizes rank 0's experts get under the layer part's routing (the same draw)."""
    ids = _draw_ids(np.random.default_rng(1), ranks * tokens, experts, topk)
    return np.bincount(ids.reshape(-1), minlength=experts)[: experts // ranks]


def _wrong(out, ref, dtype, k):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    eps = float(jnp.finfo(dtype).eps)
    tol = 4 * eps * np.sqrt(k) * (np.abs(ref).max() + 1e-30) + (eps * np.abs(ref))
    return int(np.sum(np.abs(out - ref) > tol))


# --implementation's extra row: the fused path keeping u (the up projection's output) for the
# backward instead of recomputing it (ep_comm.fused), to measure the two against each other
# (FUSED, "cutlass-fused", is moe_layer's own name for the fused path); and the fused path with
# its forward kernels loading w's tiles by TMA (tile config 2), against cp.async (config 0)
KEEP_U = "cutlass-keep-u"
FUSED_TMA = "cutlass-fused-tma"
FUSED_ROWS = {KEEP_U: (dict(keep_u=True), "u kept"),
              FUSED_TMA: (dict(forward_config=2), "w by TMA")}


def layer_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, implementation,
                 xla_max_gib, profile, with_xla=True):
    """moe_layer forward and forward+backward, next to the dense ceiling of the same FLOPs: yields
    the report with ``partial=True`` after each measured row (``emit`` saves it, so a run cut by
    a time limit keeps those rows), then the whole report."""
    mesh = jax.make_mesh((jax.device_count(),), ("ep",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape["ep"]
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    L = E // n
    rng = np.random.default_rng(1)
    ids = _draw_ids(rng, n * T, E, K)
    w = rng.random((n * T, K)).astype(np.float32)
    x = (rng.standard_normal((n * T, H)) * 0.5).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    rows = NamedSharding(mesh, P("ep"))
    put = lambda a: ep_comm.distributed.global_array(a, rows)
    xs, idss, ws, wis, wos = (put(x.astype(dtype)), put(ids), put(w),
                              put(w_in.astype(dtype)), put(w_out.astype(dtype)))
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T)
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

    def dense(xg, wi, wo):
        u = jnp.einsum("gmh,ghf->gmf", xg, wi)
        a = ep_comm.layer.swiglu(u.reshape(-1, 2 * I), I).reshape(u.shape[0], m_g, I)
        return jnp.einsum("gmf,gfh->gmh", a, wo)
    dense_fwd = jax.jit(jax.shard_map(dense, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    dense_bwd = jax.jit(jax.grad(lambda xg, wi, wo: jnp.sum(jax.shard_map(
        dense, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(xg, wi, wo).astype(
            jnp.float32) ** 2), argnums=(0, 1, 2)))
    t_dense_f = median_us(dense_fwd, (xd, wis, wos), warmup, iters)
    t_dense_b = median_us(dense_bwd, (xd, wis, wos), warmup, iters)
    print(f"  dense ceiling: forward {t_dense_f:.1f} us, fwd+bwd {t_dense_b:.1f} us", flush=True)

    check = min(T, 64)  # rank 0's first tokens: a float64 reference on the host
    ref = _layer_reference(x[:check], ids[:check], w[:check], w_in, w_out, dtype)
    results = [dict(impl="dense einsum (ceiling)", pass_="forward", time_us=t_dense_f,
                    tflops=fwd_flops / t_dense_f / 1e6, x_dense=1.0),
               dict(impl="dense einsum (ceiling)", pass_="fwd+bwd", time_us=t_dense_b,
                    tflops=3 * fwd_flops / t_dense_b / 1e6, x_dense=1.0)]
    report = dict(kind="layer", config=dict(tokens_per_rank=T, hidden=H, intermediate=I,
                                            experts=E, topk=K, dtype=jnp.dtype(dtype).name),
                  ranks=n, hardware=hardware(), warmup=warmup, iters=iters, results=results,
                  tokamax_configs=dict(gm.TOKAMAX_CONFIGS),
                  cutlass_configs=dict(gm.grouped_gemm.DEFAULT_CONFIGS))
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
    gemm_of = lambda impl: gm.resolve(  # noqa: E731
        "cutlass" if impl in (FUSED, *FUSED_ROWS) else impl, dtype)
    if with_xla and all(gemm_of(impl) != "xla" for impl, _ in variants):
        mask_gib = L * cfg.expert_rows * H * jnp.dtype(dtype).itemsize / 2**30
        variants.append(("xla", not gpu or mask_gib <= xla_max_gib))
    for impl, fits in variants:
        trace_dir = profile if impl == variants[0][0] else None  # (the first one's traces)
        # plain JAX, the same GEMM kernel (n == 1: every expert here)
        if n == 1 and fits and impl not in (FUSED, *FUSED_ROWS):
            kind = gm.resolve(impl, dtype)
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
            label += f" ({gm.resolve('auto', dtype)})"
        if not fits:
            results.append(dict(impl=label, pass_="forward", skipped="dense mask too large"))
            continue
        fwd, bwd = program(impl)
        y = fwd(xs, idss, ws, wis, wos)
        wrong = _wrong(ep_comm.distributed.to_host(y)[:check], ref, dtype, H)
        t_f = median_us(fwd, (xs, idss, ws, wis, wos), warmup, iters)
        temp = _temp_bytes(fwd, (xs, idss, ws, wis, wos))
        print(f"  {label} forward: {t_f:.1f} us, {t_f / t_dense_f:.2f}x dense "
              f"({t_dense_f:.1f} us), #wrong {wrong}, temp {_gib(temp)}", flush=True)
        results.append(dict(impl=label, gemm=gemm_of(impl), pass_="forward",
                            time_us=t_f,
                            tflops=fwd_flops / t_f / 1e6, x_dense=t_f / t_dense_f, wrong=wrong,
                            temp_bytes=temp))
        if trace_dir:
            results[-1]["trace"] = _profile_split(os.path.join(trace_dir, f"{impl}_forward"), fwd,
                                                  (xs, idss, ws, wis, wos), label + " forward")
        yield partial()
        if gpu and impl == "xla":
            continue  # its drhs is a dense masked product over every group: forward shows enough
        t_b = median_us(bwd, (xs, ws, wis, wos, idss), warmup, iters)
        temp = _temp_bytes(bwd, (xs, ws, wis, wos, idss))
        rep = dict(impl=label, gemm=gemm_of(impl), pass_="fwd+bwd", time_us=t_b,
                   tflops=3 * fwd_flops / t_b / 1e6, x_dense=t_b / t_dense_b, temp_bytes=temp)
        if trace_dir:
            rep["trace"] = _profile_split(os.path.join(trace_dir, f"{impl}_fwd_bwd"), bwd,
                                          (xs, ws, wis, wos, idss), label + " fwd+bwd")
        print(f"  {label} fwd+bwd: {t_b:.1f} us, {t_b / t_dense_b:.2f}x dense, temp {_gib(temp)}",
              flush=True)
        results.append(rep)
        yield partial()
    yield report


def _plain_layer(mesh, gemm, kind, args, t_dense_f, t_dense_b, flops, ref, check, dtype, H,
                 warmup, iters, profile=None):
    """The plain JAX layer's rows (forward, fwd+bwd) with the grouped GEMM ``gemm``; with
    ``profile`` (a folder), the forward's GPU kernel time split as :func:`_profile_split` does."""
    smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    f = lambda x, ids, w, wi, wo: baselines.moe_layer(x, ids, w, wi, wo, gemm)  # noqa: E731
    fwd = jax.jit(smap(f))
    bwd = jax.jit(jax.grad(lambda x, w, wi, wo, ids: jnp.sum(smap(f)(x, ids, w, wi, wo).astype(
        jnp.float32) ** 2), argnums=(0, 1, 2, 3)))
    x, ids, w, wi, wo = args
    label = f"plain JAX layer ({kind})"
    wrong = _wrong(ep_comm.distributed.to_host(fwd(*args))[:check], ref, dtype, H)
    t_f = median_us(fwd, args, warmup, iters)
    t_b = median_us(bwd, (x, w, wi, wo, ids), warmup, iters)
    temp_f, temp_b = _temp_bytes(fwd, args), _temp_bytes(bwd, (x, w, wi, wo, ids))
    print(f"  {label}: forward {t_f:.1f} us (temp {_gib(temp_f)}), fwd+bwd {t_b:.1f} us "
          f"(temp {_gib(temp_b)})", flush=True)
    forward = dict(impl=label, plain=kind, pass_="forward", time_us=t_f,
                   tflops=flops / t_f / 1e6, x_dense=t_f / t_dense_f, wrong=wrong,
                   temp_bytes=temp_f)
    if profile:
        forward["trace"] = _profile_split(os.path.join(profile, "plain_forward"), fwd, args,
                                          label + " forward")
    return [forward,
            dict(impl=label, plain=kind, pass_="fwd+bwd", time_us=t_b,
                 tflops=3 * flops / t_b / 1e6, x_dense=t_b / t_dense_b, temp_bytes=temp_b)]


def _temp_bytes(fn, args):
    """The compiled program's temporary memory (XLA's memory analysis), or None where the backend
    gives none."""
    mem = fn.lower(*args).compile().memory_analysis()
    return getattr(mem, "temp_size_in_bytes", None)


def _gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def rounds_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, factor: float):
    """The layer at the worst-case capacity (one round) against rounds of ``factor`` times the
    balanced rows per rank, for uniform, Zipf-0.8 and one-hot-expert routing."""
    from ep_comm.bench import make_routing

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
                                time_us=t, temp_bytes=_temp_bytes(fwd, args),
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


def overlap_report(tokens, hidden, inter, experts, topk, dtype, warmup, iters, chunk_counts,
                   profile=None, with_grad=True, shared_inter=0, chunk_by=("tokens",)):
    """The chunked pipeline (``EPConfig.num_chunks``) against the experts alone.

    ``experts alone``: the SwiGLU grouped GEMMs over the whole dispatched buffer, nothing else
    (the ceiling the layer approaches when its exchanges hide under them and its other passes
    are small). Per chunk count: the layer's forward time and its ratio to the experts alone --
    each call waited for (``time_us``), and issued ``iters`` times back to back and waited for
    once (``pipe_us``, :func:`ep_comm.collectives.timing.pipelined_us`: as in a model's step, where the
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
    ids = _draw_ids(rng, n * T, E, K)
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
    kernels = _traced(folder, fn, args)
    if kernels is None:
        return {"trace_error": f"no trace under {folder}"}
    comm = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels
                  if any(s in k["name"] for s in _EXCHANGE_KERNELS))
    gemm = []  # the union of GEMM kernel intervals
    for a, b in sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels if _is_gemm(k)):
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


def _is_gemm(k):
    return any(s in k["name"].lower() for s in (
        "ragged", "gemm", "nvjet", "cutlass", "matmul", "sm90", "wgmma", "dot"))


def _max_load(ids, n, E):
    L = E // n
    distinct = np.sort(ids, axis=1)
    distinct = np.where(np.diff(distinct, axis=1, prepend=-2) != 0, distinct, -1)
    ranks = np.where(distinct >= 0, distinct // L, n)
    return np.bincount(ranks.reshape(-1), minlength=n + 1)[:n].max()


def _layer_reference(x, ids, w, w_in, w_out, dtype):
    """Rank 0's output in float64 from the dtype-rounded inputs."""
    r = lambda a: np.asarray(jnp.asarray(a, dtype), np.float64)
    x, w_in, w_out = r(x), r(w_in), r(w_out)
    I = w_out.shape[1]
    y = np.zeros_like(x)
    for k in range(ids.shape[1]):
        u = np.einsum("th,thf->tf", x, w_in[ids[:, k]])
        a = u[:, :I] / (1 + np.exp(-u[:, :I])) * u[:, I:]
        y += w[:, k:k + 1] * np.einsum("tf,tfh->th", a, w_out[ids[:, k]])
    return y


def _traced(folder, fn, args):
    """The GPU kernels of 3 calls of ``fn`` (after one untraced call), from a profiler trace
    written under ``folder``; ``None`` when no trace was written."""
    os.makedirs(folder, exist_ok=True)
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(folder):
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    return trace_kernels(folder)


def _profile_split(folder, fn, args, label):
    """GPU kernel time of one call from a profiler trace: GEMM kernels vs the rest (the eight
    longest others by name), printed under ``label``."""
    kernels = _traced(folder, fn, args)
    if kernels is None:
        print(f"  {label}: no trace under {folder}", flush=True)
        return {"error": f"no trace under {folder}"}
    total = sum(k["dur"] for k in kernels) / 3
    gemm = sum(k["dur"] for k in kernels if _is_gemm(k)) / 3
    top = {}
    for k in kernels:
        if not _is_gemm(k):
            top[k["name"][:50]] = top.get(k["name"][:50], 0) + k["dur"] / 3
    top = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    print(f"  {label}: GPU kernels {total:.0f} us, GEMMs {gemm:.0f} us, the rest "
          f"{total - gemm:.0f} us: " + ", ".join(f"{k} {v:.0f}" for k, v in top), flush=True)
    return dict(kernel_us=total, gemm_us=gemm, other_us=total - gemm,
                top_other={k: round(v, 1) for k, v in top})


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
                     f"{ {p: _label(c) for p, c in rep['best'].items()} }; CUTLASS: "
                     f"{rep.get('best_cutlass', {})}")
        return "\n".join(lines)
    c = rep["config"]
    lines = [head + f"# moe_layer: {rep['ranks']} rank(s), {c['tokens_per_rank']} tokens/rank, "
             f"top-{c['topk']} of {c['experts']} experts, H={c['hidden']}, SwiGLU I="
             f"{c['intermediate']}, {c['dtype']}; ceiling = the same expert FLOPs as dense "
             f"batched einsums; tokamax configs {rep['tokamax_configs']}; CUTLASS configs "
             f"{rep.get('cutlass_configs')}",
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
    plain = {(r["plain"], r["pass_"]): r["time_us"] for r in rep["results"] if "plain" in r}
    for r in rep["results"]:
        p = plain.get((r.get("gemm"), r["pass_"]))
        if p:
            lines.append(f"# {r['impl']} {r['pass_']}: {r['time_us'] / p:.2f}x the plain JAX layer "
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
                    help="run the layer with the fastest tokamax and CUTLASS configs per pass of "
                         "the GEMM part")
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
        if args.tune:
            gm.TOKAMAX_CONFIGS.update(best)
            gm.grouped_gemm.DEFAULT_CONFIGS.update(best_cutlass)
        yield dict(kind="gemm", config=dict(rows=rows, groups=E // n, hidden=args.hidden,
                                            intermediate=args.intermediate,
                                            dtype=dtype.name, group_sizes=args.groups,
                                            sizes=None if sizes is None else sizes.tolist()),
                   hardware=hardware(), warmup=args.warmup, iters=args.iters, results=res,
                   best=best, best_cutlass=best_cutlass)

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
                                args.xla_max_gib, args.profile, with_xla=not args.no_xla)

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
