"""The MoE layer on megablox on one TPU chip: a tiling sweep per GEMM pass, then the layer against
the plain JAX layer MaxText runs (argsort + gather + megablox ``gmm`` at MaxText's default tiling
(512, 1024, 1024) + SwiGLU + unpermute) and the dense einsums of the same FLOPs, in one run.

    python tools/tpu_megablox.py --hidden 2048 --intermediate 1024 --json out/megablox_H2048.json

Per shape (T tokens, top-K of E experts on one rank, bf16):

1. correctness on the chip: ``grouped_matmul(implementation="megablox")`` against
   ``lax.ragged_dot`` (values and both gradients) on the layer's routed group sizes;
2. the sweep: each pass of each of the layer's two GEMMs (forward, ``dlhs``, ``drhs``) at every
   tiling of the candidates that fits the VMEM estimate, median of ``--iters`` after a warm-up;
   the fastest per pass goes into ``ep_comm.gemm.MEGABLOX_TILINGS`` for step 3 and the JSON;
3. the layer, forward and forward+backward: dense einsums (the ceiling), the plain layer on
   megablox at MaxText's tiling and at the tuned one, ``moe_layer`` on megablox (tuned), with
   ``invalid_ids="ignore"`` (the ids come from ``lax.top_k``: none can be out of range, and
   like the plain layer it checks none) and with the default run-time check of the ids. Every
   row: us, TFLOP/s (the layer's 6 T K H I FLOPs forward, 3x that forward+backward) and x dense;
   and ``moe_layer`` with ``implementation="megablox-swiglu"`` (the up projection's forward as
   one kernel with SwiGLU in its epilogue, at the fastest tiling of a sweep of that kernel alone
   against megablox's forward + XLA's SwiGLU, before the layer rows);
4. with ``--profile DIR``: each layer's forward and forward+backward traced (3 calls), its device
   time split into the GEMMs and the rest, the rest's longest ops by name.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ep_comm
from ep_comm.benchmarks.gemm_sweep import draw_ids
from ep_comm.benchmarks.timing import layer_shape_arguments, median_us, profile_split, save_json
from ep_comm import gemm
from ep_comm.benchmarks.plain import plain_layer
from ep_comm.benchmarks.reference import dense_experts
from ep_comm.swiglu_gmm import SWIGLU_KERNEL

MAXTEXT = (512, 1024, 1024)
CANDIDATES = [(tm, tk, tn) for tm in (256, 512, 1024) for tk in (512, 1024, 2048)
              for tn in (512, 1024, 2048)]
VMEM_BYTES = 16 << 20  # v5e's default scoped VMEM


def vmem(tiling, b=2):
    """Double-buffered lhs, rhs and out tiles plus the float32 accumulator."""
    tm, tk, tn = tiling
    return 2 * b * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn


def timeit(fn, *args, iters):
    """Seconds: the median of ``iters`` runs after two (the first compiles)."""
    return median_us(fn, args, warmup=2, iters=iters) * 1e-6


def routed(rng, T, K, E):
    ids = draw_ids(rng, T, E, K)
    w = rng.dirichlet(np.ones(K), T).astype(np.float32)
    return ids, w, np.bincount(ids.reshape(-1), minlength=E).astype(np.int32)


def check(rng, sizes, H, N):
    """megablox against ragged_dot on the chip: max relative errors of out, dx, dw."""
    M = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), H, N)) / np.sqrt(H), jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    gs = jnp.asarray(sizes)

    def run(f):  # (the arrays as arguments: closed over, they would be 2.6 GB of constants)
        def values_and_grads(x, w, gs, cot):
            out, vjp = jax.vjp(lambda x, w: f(x, w, gs), x, w)
            return (out, *vjp(cot))
        return jax.jit(values_and_grads)(x, w, gs, cot)
    got = run(functools.partial(ep_comm.grouped_matmul, implementation="megablox"))
    want = run(jax.lax.ragged_dot)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    return {name: float(np.abs(f32(g) - f32(r)).max() / np.abs(f32(r)).max())
            for name, g, r in zip(("out", "dx", "dw"), got, want)}


def sweep(rng, sizes, M, K, N, iters, budget_s):
    """Per pass of the GEMM (M, K) x (G, K, N): {tiling: seconds} and the best."""
    G = len(sizes)
    gs = jnp.asarray(sizes)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    operands = {"forward": (x, w), "dlhs": (dy, w), "drhs": (x, dy)}
    dims = {"forward": (K, N), "dlhs": (N, K), "drhs": (K, N)}
    out, t_end = {}, time.perf_counter() + budget_s
    for p in gemm.PASSES:
        a, b = operands[p]
        k, n = dims[p]
        results = {}
        for tiling in [MAXTEXT] + [c for c in CANDIDATES if c != MAXTEXT]:
            t = gemm.megablox_tiling(p, M, k, n, tiling)
            if t in results or vmem(t) > VMEM_BYTES or (time.perf_counter() > t_end
                                                        and tiling != MAXTEXT):
                continue
            kernel = jax.jit(functools.partial(gemm.pass_kernel(p, "megablox", t),
                                               out_dtype=jnp.bfloat16))
            try:
                results[t] = timeit(kernel, a, b, gs, iters=iters)
            except Exception as e:  # noqa: BLE001 (a tiling Mosaic rejects: VMEM)
                results[t] = None
                print(f"   {p} {t}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        ok = {t: s for t, s in results.items() if s is not None}
        best = min(ok, key=ok.get)
        out[p] = dict(k=k, n=n, best=list(best), best_us=1e6 * ok[best],
                      maxtext_us=1e6 * ok[gemm.megablox_tiling(p, M, k, n, MAXTEXT)],
                      tried={str(t): (None if s is None else 1e6 * s)
                             for t, s in results.items()}, tflops=2 * M * K * N / ok[best] / 1e12)
    return out


def megablox_gmm(tiling=None):
    """megablox's own custom_vjp gmm (ops.gmm: gmm forward, gmm transposed and tgmm backward) at
    one tiling for every pass, as MaxText calls it; ``None``: ep_comm's grouped_matmul (tuned)."""
    if tiling is None:
        return functools.partial(ep_comm.grouped_matmul, implementation="megablox")
    from jax.experimental.pallas.ops.tpu.megablox import gmm as ops_gmm

    def gmm(x, w, gs):
        m, k, n = x.shape[0], x.shape[1], w.shape[2]
        t = (min(tiling[0], m), min(tiling[1], k), min(tiling[2], n))
        return ops_gmm(x, w, gs, jnp.bfloat16, t, None, None, False,
                       jax.default_backend() != "tpu")  # (interpret mode off TPU)
    return gmm


def dense(x, ids, w, w_in, w_out):
    """The same FLOPs as one batched einsum per GEMM (every expert T K / E rows)."""
    E, (T, K) = w_in.shape[0], ids.shape
    xs = jnp.broadcast_to(x[None], (K, T, x.shape[1])).reshape(E, T * K // E, -1)
    return dense_experts(xs, w_in, w_out).reshape(K, T, -1).sum(0).astype(x.dtype)


def layer_rows(rng, T, K, E, H, I, iters, profile=None):
    ids, w, _ = routed(rng, T, K, E)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P()))  # noqa: E731
    x, ids, w, w_in, w_out = map(put, (x, ids, w, w_in, w_out))
    def ours(invalid_ids, implementation="megablox"):
        cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=1, num_experts=E, topk=K,
                               tokens_per_rank=T, invalid_ids=invalid_ids)

        @jax.shard_map(mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        def layer(x, ids, w, w_in, w_out):
            return ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                                     implementation=implementation)
        return layer

    impls = {
        "dense einsums (same FLOPs)": dense,
        "plain layer, megablox (512, 1024, 1024) (MaxText)": functools.partial(
            plain_layer, gemm=megablox_gmm(MAXTEXT)),
        "plain layer, megablox tuned": functools.partial(plain_layer, gemm=megablox_gmm()),
        # ids from lax.top_k need no run-time check (the plain layer has none); the library's
        # default check holds a host callback, which costs a TPU call ~2 ms of host time
        # (tools/ids_check_probe.py)
        "moe_layer, megablox tuned": ours("ignore"),
        "moe_layer, megablox tuned, ids checked": ours(None),
        # the up projection's forward with SwiGLU in the kernel's epilogue (ep_comm.swiglu_gmm)
        "moe_layer, megablox-swiglu": ours("ignore", SWIGLU_KERNEL),
    }
    flops = 6 * T * K * H * I
    rows = []
    with jax.set_mesh(mesh):
        want = np.asarray(jax.jit(functools.partial(plain_layer, gemm=lambda a, b, g:
                                                    jax.lax.ragged_dot(a, b, g)))(
            x, ids, w, w_in, w_out), np.float32)
        for name, f in impls.items():
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                                    argnums=(0, 2, 3, 4)))
            err = None
            if "dense" not in name:
                got = np.asarray(fwd(x, ids, w, w_in, w_out), np.float32)
                err = float(np.abs(got - want).max() / np.abs(want).max())
            t_f = timeit(fwd, x, ids, w, w_in, w_out, iters=iters)
            t_b = timeit(grad, x, ids, w, w_in, w_out, iters=iters)
            rows.append(dict(impl=name, fwd_us=1e6 * t_f, fwd_bwd_us=1e6 * t_b,
                             fwd_tflops=flops / t_f / 1e12, fwd_bwd_tflops=3 * flops / t_b / 1e12,
                             max_rel_err=err))
            print(f"   {name}: fwd {1e6 * t_f:.0f} us, fwd+bwd {1e6 * t_b:.0f} us", flush=True)
            if profile:
                tag = "".join(c if c.isalnum() else "_" for c in name)[:40]
                args = (x, ids, w, w_in, w_out)
                rows[-1]["fwd_split"] = profile_split(os.path.join(profile, tag + "_fwd"), fwd,
                                                      args, f"{name} forward")
                rows[-1]["fwd_bwd_split"] = profile_split(os.path.join(profile, tag + "_bwd"),
                                                          grad, args, f"{name} fwd+bwd")
    d = rows[0]
    ref = next(r for r in rows if "MaxText" in r["impl"])
    for r in rows:
        r["fwd_x_dense"] = r["fwd_us"] / d["fwd_us"]
        r["fwd_bwd_x_dense"] = r["fwd_bwd_us"] / d["fwd_bwd_us"]
        r["fwd_x_maxtext"] = r["fwd_us"] / ref["fwd_us"]
        r["fwd_bwd_x_maxtext"] = r["fwd_bwd_us"] / ref["fwd_bwd_us"]
    return rows


SWIGLU_TILINGS = [(512, 1024, 512), (256, 1024, 512), (512, 512, 512), (256, 2048, 512),
                  (512, 1024, 256), (1024, 512, 512), (256, 1024, 1024)]


def swiglu_sweep(rng, sizes, M, H, I, iters):
    """The up projection's forward alone: megablox's tuned ``gmm`` then SwiGLU in XLA (what
    ``"megablox"`` runs) against the SwiGLU kernel at each tiling of :data:`SWIGLU_TILINGS` (the
    fastest goes into ``swiglu_gmm.TILING`` for the layer rows); the kernel's output checked
    against the unfused one on the groups' rows."""
    from ep_comm import swiglu_gmm

    gs = jnp.asarray(sizes)
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), H, 2 * I)) / np.sqrt(H), jnp.bfloat16)
    unfused = jax.jit(lambda x, w: swiglu_gmm._unfused(x, w, gs, "megablox"))
    want = np.asarray(unfused(x, w), np.float32)
    rows = int(sizes.sum())
    out = {"unfused_us": 1e6 * timeit(unfused, x, w, iters=iters), "kernel": {}}
    print(f"   up forward + SwiGLU, megablox then XLA: {out['unfused_us']:.0f} us", flush=True)
    for tiling in SWIGLU_TILINGS:
        t = swiglu_gmm.swiglu_tiling(M, H, I, tiling)
        if str(t) in out["kernel"]:
            continue
        f = jax.jit(functools.partial(swiglu_gmm.swiglu_gmm, group_sizes=gs, tiling=t))
        try:
            got = np.asarray(f(x, w), np.float32)
            err = float(np.abs(got[:rows] - want[:rows]).max() / np.abs(want[:rows]).max())
            us = 1e6 * timeit(f, x, w, iters=iters)
        except Exception as e:  # noqa: BLE001 (a tiling Mosaic rejects: VMEM)
            out["kernel"][str(t)] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            print(f"   SwiGLU kernel {t}: {out['kernel'][str(t)]['error']}", flush=True)
            continue
        out["kernel"][str(t)] = dict(us=us, rel_err=err, x_unfused=us / out["unfused_us"])
        print(f"   SwiGLU kernel {t}: {us:.0f} us ({us / out['unfused_us']:.2f}x the unfused), "
              f"rel err {err:.1e}", flush=True)
    ok = {k: v for k, v in out["kernel"].items() if "us" in v}
    if ok:
        best = min(ok, key=lambda k: ok[k]["us"])
        out["best"] = best
        swiglu_gmm.TILING = tuple(int(v) for v in best.strip("()").split(","))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    layer_shape_arguments(ap)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep-iters", type=int, default=5)
    ap.add_argument("--sweep-budget", type=float, default=150.0,
                    help="seconds of sweeping per GEMM (MaxText's tiling is always measured)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="the layer with ep_comm.gemm.MEGABLOX_TILINGS as it stands")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None,
                    help="trace each layer into this folder and split its device time")
    args = ap.parse_args(argv)
    T, K, E, H, I = args.tokens, args.topk, args.experts, args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    _, _, sizes = routed(rng, T, K, E)
    M = T * K  # one rank: every pair, grouped by expert
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; T={T}, top-{K} of {E}, "
          f"H={H}, I={I}, bf16; groups {sizes.min()}-{sizes.max()} rows", flush=True)
    report = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  shape=dict(T=T, K=K, E=E, H=H, I=I))
    report["check"] = {"up": check(rng, sizes, H, 2 * I), "down": check(rng, sizes, I, H)}
    print("check (max |megablox - ragged_dot| / max |ragged_dot|):", report["check"], flush=True)
    report["sweep"] = {}
    for name, (k, n) in () if args.no_sweep else (("up", (H, 2 * I)), ("down", (I, H))):
        res = sweep(rng, sizes, M, k, n, args.sweep_iters, args.sweep_budget)
        report["sweep"][name] = res
        for p, r in res.items():
            gemm.MEGABLOX_TILINGS[(p, r["k"], r["n"])] = tuple(r["best"])
            print(f"{name:5s} {p:8s} best {tuple(r['best'])} {r['best_us']:8.0f} us "
                  f"({r['tflops']:.0f} TFLOP/s); MaxText's {r['maxtext_us']:8.0f} us; "
                  f"{len(r['tried'])} tried", flush=True)
    report["tilings"] = {f"{p},{k},{n}": list(t) for (p, k, n), t in
                         gemm.MEGABLOX_TILINGS.items()}
    report["swiglu_kernel"] = swiglu_sweep(rng, sizes, M, H, I, args.iters)
    report["layer"] = layer_rows(rng, T, K, E, H, I, args.iters, args.profile)
    print(f"{'layer':52s} {'fwd us':>9s} {'x dense':>8s} {'x MaxText':>10s} {'fwd+bwd us':>11s} "
          f"{'x dense':>8s} {'x MaxText':>10s} {'rel err':>8s}")
    for r in report["layer"]:
        print(f"{r['impl']:52s} {r['fwd_us']:9.0f} {r['fwd_x_dense']:8.2f} "
              f"{r['fwd_x_maxtext']:10.2f} {r['fwd_bwd_us']:11.0f} {r['fwd_bwd_x_dense']:8.2f} "
              f"{r['fwd_bwd_x_maxtext']:10.2f} "
              f"{'' if r['max_rel_err'] is None else format(r['max_rel_err'], '.1e'):>8s}")
    return save_json(report, args.json)


if __name__ == "__main__":
    main()
