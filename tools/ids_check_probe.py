"""What dispatch's run-time check of ``topk_ids`` costs a step: ``moe_layer`` forward and
forward+backward at one rank with each way of reporting (the device's count is the same in all):

- ``cond + io_callback``: the check as shipped up to 2026-12-07 (``lax.cond`` on the count, a
  host callback with a result in the taken branch);
- ``ignore``: no check (``EPConfig(invalid_ids="ignore")``);
- ``cond + debug.callback``: the same ``lax.cond``, a callback without a result in its branch;
- ``debug.callback``: a callback without a result every step, no ``cond``;
- ``cond only``: the ``lax.cond`` with no callback in it (what the predicate costs).

Each row's wall time (median of ``--iters``, each call waited for) and, with ``--profile``,
its device kernels' total: the gap between the two is what the host adds.

    python tools/ids_check_probe.py --hidden 2048 --intermediate 1024 --gemm megablox
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ep_comm
from ep_comm import dispatch_combine, overflow
from ep_comm.benchmarks.gemm_sweep import draw_ids
from ep_comm.benchmarks.timing import (interleaved_us, layer_shape_arguments, profile_split,
                                       save_json)
from ep_comm.topology._jax_compat import match_vma


def _debug(config, rows, message, mode, conditional):
    host = functools.partial(overflow._host_report, -1, config, message, "warn")
    zero = match_vma(jnp.zeros((), jnp.int32), rows)

    def call(rows):
        jax.debug.callback(lambda r: host(r) and None, rows)
        return zero
    if conditional:
        return jax.lax.cond(jnp.any(rows[:, 0] > 0), call, lambda rows: zero, rows)
    return call(rows)


def _cond_only(config, rows, message, mode):
    zero = match_vma(jnp.zeros((), jnp.int32), rows)
    return jax.lax.cond(jnp.any(rows[:, 0] > 0), lambda r: zero + r[0, 0], lambda r: zero, rows)


VARIANTS = {
    "cond + io_callback": (overflow.report, "warn"),
    "ignore": (overflow.report, "ignore"),
    "cond + debug.callback": (functools.partial(_debug, conditional=True), "warn"),
    "debug.callback": (functools.partial(_debug, conditional=False), "warn"),
    "cond only": (_cond_only, "warn"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    layer_shape_arguments(ap)
    ap.add_argument("--gemm", default="auto", help="moe_layer's implementation")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    T, K, E, H, I = args.tokens, args.topk, args.experts, args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    ids = draw_ids(rng, T, E, K)
    w = rng.dirichlet(np.ones(K), T).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((T, H)), dt)
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), dt)
    w_out = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), dt)
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P()))  # noqa: E731
    a = tuple(map(put, (x, ids, w, w_in, w_out)))
    calls, names = [], []
    for name in args.variants.split(","):
        fn, mode = VARIANTS[name]
        cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=1, num_experts=E, topk=K,
                               tokens_per_rank=T, invalid_ids=mode)

        def layer(x, ids, w, wi, wo, cfg=cfg):
            return ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo,
                                     implementation=args.gemm)
        sm = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        dispatch_combine.report = fn  # traced now, below
        fwd = jax.jit(sm).lower(*a).compile()
        bwd = jax.jit(jax.grad(lambda x, ids, w, wi, wo: jnp.sum(sm(x, ids, w, wi, wo).astype(
            jnp.float32)), argnums=(0, 2, 3, 4))).lower(*a).compile()
        calls += [(fwd, a), (bwd, a)]
        names.append(name)
    dispatch_combine.report = overflow.report
    times = interleaved_us(calls, warmup=2, iters=args.iters)
    rows = []
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; T={T}, top-{K} of {E}, "
          f"H={H}, I={I}, {jnp.dtype(dt).name}, {args.gemm}")
    for i, name in enumerate(names):
        row = dict(variant=name, fwd_us=times[2 * i], fwd_bwd_us=times[2 * i + 1])
        if args.profile:
            tag = "".join(c if c.isalnum() else "_" for c in name)
            for j, part in enumerate(("fwd", "fwd_bwd")):
                fn, aa = calls[2 * i + j]
                split = profile_split(os.path.join(args.profile, f"{tag}_{part}"), fn, aa,
                                      f"{name} {part}")
                row[f"{part}_device_us"] = split.get("kernel_us")
        rows.append(row)
    print(f"{'variant':24s} {'fwd us':>9s} {'fwd+bwd us':>11s} {'fwd dev':>9s} {'bwd dev':>9s}")
    for r in rows:
        dev = lambda k: "" if r.get(k) is None else f"{r[k]:.0f}"  # noqa: E731
        print(f"{r['variant']:24s} {r['fwd_us']:9.0f} {r['fwd_bwd_us']:11.0f} "
              f"{dev('fwd_device_us'):>9s} {dev('fwd_bwd_device_us'):>9s}")
    save_json(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   shape=dict(T=T, K=K, E=E, H=H, I=I), gemm=args.gemm, rows=rows), args.json)


if __name__ == "__main__":
    main()
