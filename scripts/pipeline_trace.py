"""Kernel timeline of the chunked MoE layer on one GPU (one rank, its exchanges forced through
the transport with EP_COMM_LOCAL_EXCHANGE=1): writes $OUT/compiled_C{C}.txt (the compiled module)
and $OUT/kernels_C{C}.txt (start us, duration us, stream, kernel) for C=$C chunks
(docs/bench/h200x1_overlap). Needs tokamax (see scripts/gpu_check.sh layer step)."""
import json, os, sys
os.environ["EP_COMM_LOCAL_EXCHANGE"] = "1"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import ep_comm
from collectives.timing import trace_kernels
out = os.environ.get("OUT", "out")
T, H, I, E, K, C = 4096, 7168, 2048, 32, 8, int(os.environ.get("C", "4"))
mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
rng = np.random.default_rng(3)
ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
w = rng.random((T, K)).astype(np.float32)
x = (rng.standard_normal((T, H)) * 0.5).astype(jnp.bfloat16)
wi = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(jnp.bfloat16)
wo = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(jnp.bfloat16)
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
args = tuple(map(put, (x, ids, w, wi, wo)))
cfg = ep_comm.EPConfig("ep", num_ranks=1, num_experts=E, topk=K, tokens_per_rank=T, num_chunks=C)
f = jax.jit(jax.shard_map(lambda *a: ep_comm.moe_layer(*a[:3], cfg, w_in=a[3], w_out=a[4]), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
open(f"{out}/compiled_C{C}.txt", "w").write(f.lower(*args).compile().as_text())
for _ in range(3): jax.block_until_ready(f(*args))
d = f"/tmp/probe_C{C}"
with jax.profiler.trace(d):
    jax.block_until_ready(f(*args))
ks = trace_kernels(d)
t0 = min(k["ts"] for k in ks)
rows = [(round(k["ts"] - t0, 1), round(k["dur"], 1), k["stream"][:22], k["name"][:70]) for k in sorted(ks, key=lambda k: k["ts"])]
with open(f"{out}/kernels_C{C}.txt", "w") as fh:
    for r in rows: fh.write(f"{r[0]:>10} {r[1]:>8} {r[2]:<24} {r[3]}\n")
print("kernels", len(rows))
