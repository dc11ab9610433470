"""The grouped GEMM sweep: every pass (forward, dlhs, drhs) of the layer's two expert GEMMs (up:
``H -> 2I``, down: ``I -> H``) with each candidate kernel and tile config, against the dense
einsum of the same FLOPs (``python -m ep_comm.benchmarks.layer --parts gemm``); and the routing
the layer benchmark draws, whose group sizes the sweep can take (``--groups routed``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm import gemm as gm
from ep_comm.benchmarks.timing import median_us


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


def config_label(cfg):
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
            raise ValueError(f"gemm_sweep: the GEMM sweep needs rows={rows} divisible by "
                             f"groups={groups}")
        sizes = np.full((groups,), rows // groups)
    sizes = np.asarray(sizes, np.int64)
    if sizes.shape != (groups,) or sizes.sum() != rows or (sizes < 0).any():
        raise ValueError(f"gemm_sweep: sizes must be {groups} group sizes >= 0 adding up to "
                         f"rows={rows}, got {sizes.tolist()}")
    rng = np.random.default_rng(0)
    gs = jnp.asarray(sizes, jnp.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    gpu = jax.default_backend() == "gpu"
    impls = [("xla", None)]
    if gm.tokamax_available() and jnp.dtype(dtype).itemsize == 2:
        impls += [("tokamax", None), ("tokamax", "heuristics")]
    if gm.grouped_gemm.unavailable_reason() is None and jnp.dtype(dtype).itemsize == 2:
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
                label = (f"{impl} {config_label(cfg)}" if impl == "tokamax" else
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
                                    wrong=wrong_count(out, ref, dtype, k), config=cfg,
                                    weight=[k, n]))
                if log:
                    log(f"  {name} {pass_name} {label}: {t:.1f} us, {t / t_dense:.2f}x dense")
    return results, fastest(results, "tokamax"), fastest(results, "ep_comm cutlass")


def fastest(results, impl):
    """Per pass, the config of ``impl`` (a label prefix) fastest over both GEMMs, among those
    right in both (a ``None`` config, the defaults in use, is not a candidate)."""
    best = {}
    for pass_name in gm.PASSES:
        totals = {}
        for r in results:
            if r["pass_"] == pass_name and r["impl"].startswith(impl) and "time_us" in r \
                    and r["wrong"] == 0 and r["config"] is not None:
                key = config_label(r["config"]) if isinstance(r["config"], dict) else r["config"]
                totals.setdefault(key, [r["config"], 0.0, 0])
                totals[key][1] += r["time_us"]
                totals[key][2] += 1
        full = [v for v in totals.values() if v[2] == 2]
        if full:
            best[pass_name] = min(full, key=lambda v: v[1])[0]
    return best


def fastest_by_shape(results, impl) -> dict[tuple[str, int, int], Any]:
    """Per pass and per GEMM, the config of ``impl`` (a label prefix) fastest among those right,
    keyed ``(pass, K, N)`` by the GEMM's weight ``(K, N)``, as
    ``ep_comm.collectives.grouped_gemm.SHAPE_CONFIGS`` is."""
    best = {}
    for r in results:
        if r["impl"].startswith(impl) and "time_us" in r and r["wrong"] == 0 \
                and r.get("config") is not None and "weight" in r:
            key = (r["pass_"], *r["weight"])
            if key not in best or r["time_us"] < best[key][1]:
                best[key] = (r["config"], r["time_us"])
    return {key: config for key, (config, _) in best.items()}


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


def draw_ids(rng, tokens, experts, topk):
    """Uniform top-``topk`` routing: each token's distinct experts, drawn from ``rng``."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int32)


def layer_inputs(rng, tokens, hidden, inter, experts, topk):
    """The layer benchmark's draws from ``rng`` (``default_rng(1)``), in this order: ``ids``
    ``(tokens, topk)`` (:func:`draw_ids`), router weights ``w``, ``x`` ``(tokens, H)``, ``w_in``
    ``(E, H, 2I)`` and ``w_out`` ``(E, I, H)``, float32 numpy; ``tokens`` are all ranks'."""
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    ids = draw_ids(rng, T, E, K)
    w = rng.random((T, K)).astype(np.float32)
    x = (rng.standard_normal((T, H)) * 0.5).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    return ids, w, x, w_in, w_out


def routed_sizes(ranks, tokens, experts, topk):
    """The group sizes rank 0's experts get under the layer part's routing (the same draw)."""
    ids = draw_ids(np.random.default_rng(1), ranks * tokens, experts, topk)
    return np.bincount(ids.reshape(-1), minlength=experts)[: experts // ranks]


def wrong_count(out, ref, dtype, k):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    eps = float(jnp.finfo(dtype).eps)
    tol = 4 * eps * np.sqrt(k) * (np.abs(ref).max() + 1e-30) + (eps * np.abs(ref))
    return int(np.sum(np.abs(out - ref) > tol))
