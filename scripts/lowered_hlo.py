"""Print the StableHLO of dispatch + combine (forward and gradients, flat and hierarchical plans)
lowered for CUDA with backend="nccl", on any machine (CPU included): a refactor that must not change
what runs on GPUs diffs this text before and after.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/lowered_hlo.py > a.txt

Communicators are not created (no GPU needed): their keys are the deterministic hash of the device
groups, as at run time. Per-process counters in attribute values (op ids) are normalised away.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_comm import collectives
import ep_comm
from ep_comm import topology
from ep_comm.collectives import bootstrap

# Lowering only: the nccl transport counts as available on this (CPU) backend, and a communicator
# is its key, without creating anything.
_reason = collectives._reason
collectives._reason = lambda name, platform: None if name == "nccl" else _reason(name, platform)
bootstrap.communicator = bootstrap.comm_key


def lowered(plan: str, grad: bool) -> str:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=4, tokens_per_rank=16,
                           backend="nccl", plan=plan,
                           topology=topology.simulated(2, n // 2) if n % 2 == 0 else None)

    def moe(x, ids, w):
        ex, h = ep_comm.dispatch(x, ids, w, cfg)
        return ep_comm.combine(ex * 2.0, h)

    def f(x, ids, w):
        if grad:
            return jax.grad(lambda x, w: jnp.sum(moe(x, ids, w) ** 2), argnums=(0, 1))(x, w)
        return moe(x, ids, w)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    shard = NamedSharding(mesh, P("ep"))
    args = [jax.ShapeDtypeStruct(s, d, sharding=shard) for s, d in
            (((n * 16, 8), jnp.bfloat16), ((n * 16, 4), jnp.int32), ((n * 16, 4), jnp.float32))]
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.sub(r"op_id = \d+", "op_id = N", text)


if __name__ == "__main__":
    for plan in ("flat", "hierarchical"):
        for grad in (False, True):
            print(f"// ==== plan={plan} grad={grad}")
            print(lowered(plan, grad))
