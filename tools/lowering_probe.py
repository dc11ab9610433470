"""Where the time of dispatch and combine goes off CUDA: the building blocks of their XLA
lowerings next to plain JAX, at one rank: ``python tools/lowering_probe.py [T H K E I]
[--blocks] [--ops]`` (``--blocks``: also sorts, scatters and counts of ``T * K`` keys alone;
``--ops``: instead, the device ops of plain JAX's permute, dispatch and combine from a JAX profiler
trace, heaviest first: TPU or CPU)."""

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

from ep_comm import collectives
import ep_comm
from ep_comm.collectives import row_kernels as rk
from ep_comm.benchmarks.timing import hardware, median_us, pipelined_us
from ep_comm.benchmarks import plain
from ep_comm.benchmarks.reference import dense_experts

SHAPE = [a for a in sys.argv[1:] if not a.startswith('-')] or [4096, 2048, 8, 32, 1024]
T, H, K, E, I = (int(a) for a in SHAPE)
dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
mesh = jax.make_mesh((1,), ("ep",))
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
rng = np.random.default_rng(0)
x = put(jnp.asarray(rng.standard_normal((T, H)), dtype))
ids = put(jnp.asarray(np.argsort(rng.random((T, E)), 1)[:, :K].astype(np.int32)))
w = put(jnp.asarray(rng.random((T, K)), jnp.float32))
M = T * K
print(hardware(), f"T={T} H={H} K={K} E={E} I={I} {jnp.dtype(dtype).name}", flush=True)
print("available:", collectives.available(), flush=True)
rows = []


def time(name, fn, *args):
    try:
        t = median_us(fn, args, 3, 20)
        tp = pipelined_us(fn, args, 1, 20 if 'fwd+bwd' not in name else 3)
    except Exception as e:  # noqa: BLE001
        print(f"{name:<44} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    rows.append((name, t, tp))
    print(f"{name:<44}{t:>10.1f} us{tp:>10.1f} us pipelined", flush=True)
    return t


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


if "--ops" in sys.argv:  # the device ops of plain JAX's permute, dispatch and combine instead
    ops("plain permute", smap(plain.permute), (x, ids))
    disp = smap(functools.partial(ep_comm.dispatch, config=cfg))
    ops("dispatch", disp, (x, ids, w))
    ops("combine", smap(ep_comm.combine), disp(x, ids, w))
    sys.exit()

# ceilings and plain JAX
time("copy: repeat x K rows", smap(lambda x: jnp.repeat(x, K, axis=0)), x)


time("plain permute (argsort + gather)", smap(plain.permute), x, ids)
time("plain permute + unpermute", smap(plain.round_trip), x, ids, w)
for mode, ctx in (("reference", rk.reference_only), ("fast", rk.xla_only)):
    with ctx():
        d = smap(functools.partial(ep_comm.dispatch, config=cfg))
        c = smap(ep_comm.combine)
        rt = smap(lambda x, i, w: ep_comm.combine(*ep_comm.dispatch(x, i, w, cfg)))
        time(f"ep_comm dispatch ({mode})", d, x, ids, w)
        ex, h = d(x, ids, w)
        time(f"ep_comm combine ({mode})", c, ex, h)
        time(f"ep_comm round trip ({mode})", rt, x, ids, w)

# building blocks: a gather of M rows, its index modes
src = put(jnp.asarray(rng.permutation(M) // K, jnp.int32))
time("row gather, fill mode (jnp.take's default)", smap(lambda x, s: jnp.take(x, s, axis=0)),
     x, src)
time("row gather, clip mode", smap(lambda x, s: jnp.take(x, s, axis=0, mode="clip")), x, src)
if "--blocks" in sys.argv:
    key = put(jnp.asarray(rng.integers(0, E + 1, M), jnp.int32))
    time("sort (key, iota) stable", smap(lambda k: jax.lax.sort(
        (k, jnp.arange(M, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]), key)
    perm = put(jnp.asarray(rng.permutation(M), jnp.int32))
    time("inverse by scatter", smap(lambda o: jnp.zeros((M,), jnp.int32).at[o].set(
        jnp.arange(M, dtype=jnp.int32), unique_indices=True)), perm)
    time("inverse by sort", smap(lambda o: jax.lax.sort((o, jnp.arange(M, dtype=jnp.int32)),
                                                        num_keys=1)[1]), perm)
    time("counts by bincount", smap(lambda k: jnp.bincount(k, length=E + 1)), key)

# the layer: plain argsort + ragged_dot against moe_layer, both with lax.ragged_dot
wi = put(jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), dtype))
wo = put(jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), dtype))


def plain_layer(x, ids, w, wi, wo):
    return plain.plain_layer(x, ids, w, wi, wo)


def layer(x, ids, w, wi, wo):
    return ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo, implementation="xla")


def dense(x, ids, w, wi, wo):
    return dense_experts(jnp.repeat(x, K, axis=0).reshape(E, M // E, H), wi, wo).reshape(M, H)[:T]


args = (x, ids, w, wi, wo)
for name, f in (("dense einsums", dense), ("plain layer", plain_layer), ("moe_layer", layer)):
    time(f"{name} forward", smap(f), *args)
    g = jax.jit(jax.grad(lambda x, w, wi, wo, ids, f=f: jnp.sum(jax.shard_map(
        f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, ids, w, wi, wo).astype(
            jnp.float32) ** 2), argnums=(0, 1, 2, 3)))
    time(f"{name} fwd+bwd", g, x, w, wi, wo, ids)
    with rk.reference_only():
        if name == "moe_layer":
            time(f"{name} forward (reference lowerings)", smap(f), *args)
print("\n".join(f"{n:<44}{t:>10.1f}{tp:>10.1f}" for n, t, tp in rows))
