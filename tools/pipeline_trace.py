"""Kernel timeline of the chunked MoE layer on one GPU: one rank of DeepSeek-V3 at EP8 (4096
tokens, top-8 of 32 local experts, H=7168, I=2048, bf16), its exchanges forced through the
transport (``EP_COMM_LOCAL_EXCHANGE=1``) in ``C`` chunks (env ``C``, default 4). Writes
``$OUT/compiled_C{C}.txt`` (the compiled module) and ``$OUT/kernels_C{C}.txt`` (start and duration
in us, stream, kernel) of one traced call (docs/bench/h200x1_overlap). Needs tokamax (installed as
scripts/gpu_check.sh's ``layer`` step does)."""

import os

os.environ["EP_COMM_LOCAL_EXCHANGE"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ep_comm  # noqa: E402
from ep_comm.benchmarks.timing import trace_kernels  # noqa: E402


def main():
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    T, H, I, E, K, C = 4096, 7168, 2048, 32, 8, int(os.environ.get("C", "4"))
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    x = (rng.standard_normal((T, H)) * 0.5).astype(jnp.bfloat16)
    wi = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(jnp.bfloat16)
    wo = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(jnp.bfloat16)
    args = tuple(jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w, wi, wo))
    cfg = ep_comm.EPConfig("ep", num_ranks=1, num_experts=E, topk=K, tokens_per_rank=T,
                           num_chunks=C)
    f = jax.jit(jax.shard_map(lambda *a: ep_comm.moe_layer(*a[:3], cfg, w_in=a[3], w_out=a[4]),
                              mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with open(f"{out}/compiled_C{C}.txt", "w") as fh:
        fh.write(f.lower(*args).compile().as_text())
    for _ in range(3):
        jax.block_until_ready(f(*args))
    folder = f"/tmp/pipeline_trace_C{C}"
    with jax.profiler.trace(folder):
        jax.block_until_ready(f(*args))
    kernels = sorted(trace_kernels(folder), key=lambda k: k["ts"])
    t0 = kernels[0]["ts"]
    with open(f"{out}/kernels_C{C}.txt", "w") as fh:
        for k in kernels:
            fh.write(f"{k['ts'] - t0:>10.1f} {k['dur']:>8.1f} {k['stream'][:22]:<24} "
                     f"{k['name'][:70]}\n")
    print("kernels", len(kernels))


if __name__ == "__main__":
    main()
