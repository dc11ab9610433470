"""A dispatch's time inside a jitted program of 20 dispatches (``ep_comm.benchmarks.dispatch.in_program``), in a
fresh process: three medians each of the program waited for and of programs issued back to back,
and the program's kernels per dispatch from a profiler trace.

    python tools/in_program.py [--tokens 128] [--repeats 3] [--iters 10]

One rank, H=7168, top-8 of 256 experts, bf16, uniform routing (ep_comm.benchmarks.dispatch's config). XLA flags
(``XLA_FLAGS``) apply as usual, so the same program can be timed with and without command buffers.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm.benchmarks.timing import median_us, pipelined_us
from ep_comm.benchmarks.dispatch import in_program, kernel_us, make_routing

CALLS = 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    T, H, K, E = args.tokens, 7168, 8, 256
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
    fargs = (put(jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)),
             put(jnp.asarray(make_routing(rng, "uniform", T, K, E))),
             put(jnp.asarray(rng.random((T, K)), jnp.float32)))
    cfg = ep_comm.EPConfig("ep", num_ranks=1, num_experts=E, topk=K, tokens_per_rank=T,
                           backend=args.backend)
    prog = in_program(cfg, mesh, CALLS)
    us = [median_us(prog, fargs, 2, args.iters) / CALLS for _ in range(args.repeats)]
    piped = [pipelined_us(prog, fargs, 2, args.iters) / CALLS for _ in range(args.repeats)]
    kern, top = kernel_us(prog, fargs, "/tmp/ep_in_program_trace", calls=1, top=10)
    print(f"T={T}: us per dispatch in a program of {CALLS}: each program waited for "
          f"{', '.join(f'{u:.1f}' for u in us)}; programs back to back "
          f"{', '.join(f'{u:.1f}' for u in piped)} ({args.repeats} medians of {args.iters}); "
          f"kernels {kern / CALLS:.1f} us")
    for name, u, c in top:
        print(f"  {u / CALLS:7.2f} us x{c / CALLS:.2f}  {name}")


if __name__ == "__main__":
    main()
