"""Every GPU kernel of one dispatch and one combine (standalone jitted calls, one rank), with its
time per call from a JAX profiler trace, and each program's compiled HLO (to map XLA's fusions to
the ops they came from). For finding what a phase spends its kernel time on.

    python scripts/kernel_list.py [--tokens 4096] [--wire-formats none,e4m3] [--backend nccl]
                                  [--out DIR]

Config: H=7168, top-8 of 256 experts, bf16, uniform routing (ep_comm.bench's).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ep_comm
from ep_comm.collectives.timing import pipelined_us, trace_kernels
from ep_comm.bench import make_routing


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--wire-formats", default="none")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default="/tmp/kernel_list")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    T, H, K, E = args.tokens, 7168, 8, 256
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids = jnp.asarray(make_routing(rng, "uniform", T, K, E))
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"),  # noqa: E731
                                           out_specs=P("ep")))
    for wf in args.wire_formats.split(","):
        wf = None if wf == "none" else wf
        cfg = ep_comm.EPConfig("ep", num_ranks=1, num_experts=E, topk=K, tokens_per_rank=T,
                               backend=args.backend, wire_format=wf)
        disp = smap(functools.partial(ep_comm.dispatch, config=cfg))
        ex, h = disp(x, ids, w)
        for name, fn, fargs in (("dispatch", disp, (x, ids, w)),
                                ("combine", smap(ep_comm.combine), (ex, h))):
            tag = f"{name}_{wf}_T{T}"
            with open(os.path.join(args.out, f"{tag}.hlo.txt"), "w") as f:
                f.write(fn.lower(*fargs).compile().as_text())
            folder = os.path.join(args.out, f"trace_{tag}")
            jax.block_until_ready(fn(*fargs))
            shutil.rmtree(folder, ignore_errors=True)
            calls = 5
            with jax.profiler.trace(folder):
                for _ in range(calls):
                    jax.block_until_ready(fn(*fargs))
            kernels = trace_kernels(folder) or []
            by = collections.OrderedDict()
            for k in kernels:
                us, c = by.get(k["name"], (0.0, 0))
                by[k["name"]] = (us + k["dur"] / calls, c + 1)
            total = sum(k["dur"] for k in kernels) / calls
            print(f"== {tag}: {total:.1f} us of kernels in {len(kernels) / calls:.0f} launches, "
                  f"{pipelined_us(fn, fargs, 2, 20):.1f} us pipelined", flush=True)
            for kname, (us, c) in by.items():
                print(f"  {us:8.2f} us x{c / calls:.0f}  {kname[:100]}")


if __name__ == "__main__":
    main()
