#!/usr/bin/env python3
# Usage (tokamax installed, e.g. from .whl-tpu/): JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
#   python scripts/tokamax_tpu_interpret.py
"""moe_layer / grouped_matmul with tokamax's Mosaic TPU kernel run in Pallas interpret mode on
CPU (device kind faked as a v5e): checks values and gradients against ragged_dot under shard_map."""
import functools
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jax._src.pallas.mosaic import tpu_info
tpu_info.get_device_kind = lambda: "TPU v5 lite"
tpu_info.get_num_device_cores = lambda: 1
from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as pmt
pmt.PallasMosaicTpuRaggedDot.supported_on = lambda self, d: True
from ep_comm import gemm
import ep_comm
gemm._tokamax_kernel.cache_clear()  # (kernels built before the stand-in below)
gemm._tokamax_op = lambda: ((pmt, functools.partial(pmt.PallasMosaicTpuRaggedDot, interpret=True)), None)

n = jax.device_count()
mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
T, H, I, E, K = 64, 128, 128, 4 * n, 2
rng = np.random.default_rng(0)
ids = np.argsort(rng.random((n * T, E)), 1)[:, :K].astype(np.int32)
w = rng.random((n * T, K)).astype(np.float32)
x = (rng.standard_normal((n * T, H)) * .5).astype(jnp.bfloat16)
wi = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(jnp.bfloat16)
wo = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(jnp.bfloat16)
sh = jax.NamedSharding(mesh, P("ep"))
args = [jax.device_put(a, sh) for a in (x, ids, w, wi, wo)]
cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=E, topk=K, tokens_per_rank=T)
def run(impl):
    def f(x, ids, w, wi, wo):
        return ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo, implementation=impl)
    sm = jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    y = jax.jit(sm)(*args)
    loss = lambda x, w, wi, wo, ids: jnp.sum(sm(x, ids, w, wi, wo).astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(args[0], args[2], args[3], args[4], args[1])
    return [np.asarray(jnp.asarray(v, jnp.float32)) for v in (y, *g)]
ref, got = run("xla"), run("tokamax")
for name, r, o in zip(("y", "dx", "dw", "dwi", "dwo"), ref, got):
    err = np.abs(r - o).max() / (np.abs(r).max() + 1e-30)
    print(f"{name}: max rel err {err:.2e}")
    assert err < 3e-2, name
print("tokamax TPU kernel (interpret) matches ragged_dot under shard_map")
