"""The device ops of one jitted call, from a JAX profiler trace, heaviest first (TPU or CPU):
``python scripts/tpu_profile_ops.py [T H K E]``; profiles dispatch, combine and plain JAX's
permutation at one rank."""

import collections
import functools
import glob
import gzip
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm import baselines

T, H, K, E = (int(a) for a in (sys.argv[1:] or [4096, 2048, 8, 32]))
dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
mesh = jax.make_mesh((1,), ("ep",))
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
rng = np.random.default_rng(0)
x = put(jnp.asarray(rng.standard_normal((T, H)), dtype))
ids = put(jnp.asarray(np.argsort(rng.random((T, E)), 1)[:, :K].astype(np.int32)))
w = put(jnp.asarray(rng.random((T, K)), jnp.float32))
smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))  # noqa
cfg = ep_comm.EPConfig("ep", num_ranks=1, num_experts=E, topk=K, tokens_per_rank=T)


def ops(name, fn, args, calls=5):
    jax.block_until_ready(fn(*args))
    folder = f"/tmp/prof_{name.replace(' ', '_')}"
    shutil.rmtree(folder, ignore_errors=True)
    with jax.profiler.trace(folder):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        print(name, "no trace")
        return
    with gzip.open(files[0]) as f:
        events = json.load(f).get("traceEvents", [])
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    by = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X":
            where = f"{procs.get(e['pid'], '?')[:18]}/{threads.get((e['pid'], e['tid']), '?')[:16]}"
            by[(where, e["name"][:60])] += e["dur"] / calls
    device = {k: v for k, v in by.items() if not k[0].startswith("/host")}
    print(f"== {name}: per call, us; device ops total {sum(device.values()):.1f}")
    for (where, op), us in sorted((device or by).items(), key=lambda t: -t[1])[:28]:
        print(f"{us:>9.1f}  {where:<36} {op}")


ops("plain permute", smap(baselines.permute), (x, ids))
ops("dispatch", smap(functools.partial(ep_comm.dispatch, config=cfg)), (x, ids, w))
ex, h = smap(functools.partial(ep_comm.dispatch, config=cfg))(x, ids, w)
ops("combine", smap(ep_comm.combine), (ex, h))
