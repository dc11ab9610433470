"""A small MoE transformer trained with expert parallelism through ep_comm (plain JAX + optax).

Every device of a 1-D mesh ``("ep",)`` holds a slice of the batch (data parallel) and
``num_experts / num_devices`` experts (expert parallel). Each MoE layer routes its tokens with a
top-k softmax router, sends them to the experts' devices with ``ep_comm.dispatch``, runs the local
experts as grouped matmuls (``jax.lax.ragged_dot`` over ``handle.group_sizes``) and brings the
results back with ``ep_comm.combine``: dropless, whatever the routing.

The task is synthetic next-token prediction: each sequence follows a fixed random permutation of the
vocabulary, ``tok[i+1] = perm[tok[i]]``, which the model learns in a few hundred steps.

Run (8 CPU devices, no GPU needed)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/moe_transformer.py

At step 0 the script checks that the expert-parallel model gives the same logits as the same
parameters run densely on one device (every token through its top-k experts, no communication).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import ep_comm

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2
    num_experts: int = 16
    topk: int = 2


def init_params(cfg: ModelConfig, key):
    ks = iter(jax.random.split(key, 4 + 8 * cfg.layers))
    normal = lambda shape, scale: scale * jax.random.normal(next(ks), shape, jnp.float32)
    params = {
        "embed": normal((cfg.vocab, cfg.dim), 0.5),
        "pos": normal((cfg.seq, cfg.dim), 0.1),
        "out": normal((cfg.dim, cfg.vocab), cfg.dim ** -0.5),
        "layers": [],
    }
    for _ in range(cfg.layers):
        params["layers"].append({
            "qkv": normal((cfg.dim, 3 * cfg.dim), cfg.dim ** -0.5),
            "proj": normal((cfg.dim, cfg.dim), cfg.dim ** -0.5),
            "router": normal((cfg.dim, cfg.num_experts), cfg.dim ** -0.5),
            "w_in": normal((cfg.num_experts, cfg.dim, cfg.ffn), cfg.dim ** -0.5),
            "w_out": normal((cfg.num_experts, cfg.ffn, cfg.dim), cfg.ffn ** -0.5),
        })
    return params


def param_specs(params):
    """Experts sharded over "ep" (their leading axis), everything else replicated."""
    spec = lambda path, _: P("ep") if path[-1].key in ("w_in", "w_out") else P()
    return jax.tree_util.tree_map_with_path(spec, params)


def layer_norm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


def attention(p, x, cfg: ModelConfig):
    b, s, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(b, s, cfg.heads, d // cfg.heads)
    q, k, v = map(split, (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // cfg.heads)
    att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, s, d)
    return out @ p["proj"]


def route(p, x, cfg: ModelConfig):
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    w, ids = jax.lax.top_k(probs, cfg.topk)
    return ids.astype(jnp.int32), w / w.sum(-1, keepdims=True)


def moe_expert_parallel(p, x, cfg: ModelConfig, ep: ep_comm.EPConfig):
    """MoE FFN inside shard_map: x is this device's (tokens, dim); p["w_*"] its local experts."""
    ids, w = route(p, x, cfg)
    expert_x, handle = ep_comm.dispatch(x, ids, w, ep)
    h = jax.nn.gelu(jax.lax.ragged_dot(expert_x, p["w_in"], handle.group_sizes))
    expert_y = jax.lax.ragged_dot(h, p["w_out"], handle.group_sizes)
    return ep_comm.combine(expert_y, handle)


def moe_dense(p, x, cfg: ModelConfig):
    """The same layer on one device: every token through its top-k experts, no communication."""
    ids, w = route(p, x, cfg)
    y = 0.0
    for k in range(cfg.topk):
        h = jax.nn.gelu(jnp.einsum("td,tdf->tf", x, p["w_in"][ids[:, k]]))
        y = y + w[:, k:k + 1] * jnp.einsum("tf,tfd->td", h, p["w_out"][ids[:, k]])
    return y


def forward(params, tokens, cfg: ModelConfig, moe):
    x = params["embed"][tokens] + params["pos"]
    b, s, d = x.shape
    for p in params["layers"]:
        x = x + attention(p, layer_norm(x), cfg)
        x = x + moe(p, layer_norm(x).reshape(b * s, d)).reshape(b, s, d)
    return layer_norm(x) @ params["out"]


def cross_entropy(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


class Trainer:
    """Builds the expert-parallel train step over all devices on a ("ep",) mesh."""

    def __init__(self, cfg: ModelConfig, batch: int, seed: int = 0, lr: float = 3e-3):
        self.cfg, self.batch = cfg, batch
        self.mesh = jax.make_mesh((jax.device_count(),), ("ep",),
                                  axis_types=(jax.sharding.AxisType.Auto,))
        n = self.mesh.shape["ep"]
        if batch % n:
            raise ValueError(f"batch={batch} must be divisible by the {n} devices")
        self.ep = ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=cfg.num_experts,
                                   topk=cfg.topk, tokens_per_rank=batch // n * cfg.seq)
        self.perm = np.random.default_rng(seed).permutation(cfg.vocab)
        self.data_rng = np.random.default_rng(seed + 1)
        host_params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(seed)))
        self.specs = param_specs(host_params)
        self.params = jax.tree.map(
            lambda a, s: ep_comm.distributed.global_array(a, NamedSharding(self.mesh, s)),
            host_params, self.specs)
        self.host_params = host_params
        self.opt = optax.adam(lr)
        self.opt_state = jax.jit(self.opt.init)(self.params)

        moe = functools.partial(moe_expert_parallel, cfg=cfg, ep=self.ep)

        def local_logits(params, tokens):
            return forward(params, tokens, cfg, moe)

        self.logits = jax.jit(jax.shard_map(local_logits, mesh=self.mesh,
                                            in_specs=(self.specs, P("ep")), out_specs=P("ep")))

        def loss_fn(params, tokens):
            return cross_entropy(self.logits(params, tokens), tokens)

        def step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step_fn = jax.jit(step)

    def sample(self):
        cfg = self.cfg
        toks = np.empty((self.batch, cfg.seq), np.int32)
        toks[:, 0] = self.data_rng.integers(0, cfg.vocab, self.batch)
        for i in range(1, cfg.seq):
            toks[:, i] = self.perm[toks[:, i - 1]]
        return toks

    def put_tokens(self, toks):
        return ep_comm.distributed.global_array(toks, NamedSharding(self.mesh, P("ep")))

    def check_against_dense(self, toks):
        """Max |EP logits - dense single-device logits| with the current (initial) parameters.

        Both run with full float32 matmuls: with TF32 (the GPU default) the router's near-ties can
        pick different experts in the two programs, which says nothing about ep_comm."""
        dense_fn = jax.jit(functools.partial(forward, cfg=self.cfg,
                                             moe=functools.partial(moe_dense, cfg=self.cfg)))
        dev = jax.local_devices()[0]
        with jax.default_matmul_precision("highest"):
            ep = ep_comm.distributed.to_host(self.logits(self.params, self.put_tokens(toks)))
            dense = np.asarray(dense_fn(jax.device_put(self.host_params, dev),
                                        jax.device_put(toks, dev)))
        return float(np.abs(ep - dense).max()), float(np.abs(dense).max())

    def train(self, steps: int, log_every: int = 20, log=print):
        losses = []
        for i in range(steps):
            self.params, self.opt_state, loss = self.step_fn(self.params, self.opt_state,
                                                             self.put_tokens(self.sample()))
            losses.append(float(loss))
            if log and (i % log_every == 0 or i == steps - 1):
                log(f"step {i:4d}  loss {losses[-1]:.4f}")
        return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None,
                    help="CPU devices per process (default: what XLA_FLAGS gives)")
    args = ap.parse_args(argv)
    ep_comm.distributed.initialize(local_device_count=args.devices)
    cfg = ModelConfig()
    trainer = Trainer(cfg, args.batch, seed=args.seed)
    n = trainer.mesh.shape["ep"]
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    say(f"MoE transformer: {cfg.layers} layers, {cfg.num_experts} experts top-{cfg.topk}, "
        f"expert parallel over {n} {jax.default_backend()} devices "
        f"({cfg.num_experts // n} experts and {trainer.ep.tokens_per_rank} tokens per device)")
    err, scale = trainer.check_against_dense(trainer.sample())
    say(f"step 0: expert-parallel vs dense single-device logits: max |diff| = {err:.2e} "
        f"(logits up to {scale:.2f})")
    if err > 1e-4 * max(1.0, scale):
        raise SystemExit(f"expert-parallel model disagrees with the dense model: {err}")
    t0 = time.perf_counter()
    losses = trainer.train(args.steps, log=say)
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps "
        f"({time.perf_counter() - t0:.1f} s); chance level is {np.log(cfg.vocab):.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit("training did not reduce the loss by half")
    return losses


if __name__ == "__main__":
    main()
