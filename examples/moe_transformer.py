"""A small MoE transformer trained with expert parallelism through ep_comm (plain JAX + optax).

Every device of a mesh ``("data", "ep")`` holds a slice of the batch (the batch is split over both
axes) and ``num_experts / ep`` experts (expert parallel over ``"ep"``, the same experts on every
``"data"`` row); the other weights are replicated. ``--mesh data=2,ep=4`` picks the shape; the
default is ``ep`` over every device (``data=1``). Each MoE layer routes its tokens with a
top-k softmax router and runs ``ep_comm.moe_layer``: dispatch to the experts' devices, the local
SwiGLU experts as grouped GEMMs (``ep_comm.grouped_matmul``: tokamax's kernels on Hopper, ``ragged_dot``
on CPU), combine back: dropless, whatever the routing.

The task is synthetic next-token prediction: each sequence follows a fixed random permutation of the
vocabulary, ``tok[i+1] = perm[tok[i]]``, which the model learns in a few hundred steps.

Run (8 CPU devices, no GPU needed)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/moe_transformer.py
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/moe_transformer.py \
        --mesh data=2,ep=4   # data x expert parallel: 4 experts' groups, each twice

At step 0 the script checks that the expert-parallel model gives the same logits as the same
parameters run densely on one device (every token through its top-k experts, no communication).

``--preset deepseek`` (the default on a GPU) is one DeepSeek-V3-shaped MoE layer per device instead:
hidden 7168, 32 experts of SwiGLU width 2048 per device, top-8, 4096 tokens per device, the experts in
bfloat16; it times the training step (the dense check is the tiny preset's: it needs every token's
expert weights gathered, which does not fit at this size)::

    python examples/moe_transformer.py --preset deepseek --steps 20
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
    expert_dtype: str = "float32"  # the dtype the MoE layer computes in (parameters stay float32)


PRESETS = {
    "tiny": {},
    # one DeepSeek-V3 MoE layer as one rank of EP8 holds it (times the device count)
    "deepseek": dict(vocab=64, seq=512, dim=7168, heads=56, ffn=2048, layers=1, num_experts=32,
                     topk=8, expert_dtype="bfloat16"),
}

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
            # SwiGLU: gate in the first ffn columns, up in the last ffn
            "w_in": normal((cfg.num_experts, cfg.dim, 2 * cfg.ffn), cfg.dim ** -0.5),
            "w_out": normal((cfg.num_experts, cfg.ffn, cfg.dim), cfg.ffn ** -0.5),
        })
    return params


def is_expert(path) -> bool:
    """Whether the parameter at ``path`` (a pytree key path) is a routed expert's weight."""
    return path[-1].key in ("w_in", "w_out")


def param_specs(params):
    """Experts sharded over "ep" (their leading axis), everything else replicated (over "data"
    too; the train step sums each gradient over the axes its weight is replicated on)."""
    spec = lambda path, _: P("ep") if is_expert(path) else P()  # noqa: E731
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
    dt = jnp.dtype(cfg.expert_dtype)
    y = ep_comm.moe_layer(x.astype(dt), ids, w, ep, w_in=p["w_in"].astype(dt),
                          w_out=p["w_out"].astype(dt))
    return y.astype(x.dtype)


def moe_dense(p, x, cfg: ModelConfig):
    """The same layer on one device: every token through its top-k experts, no communication."""
    ids, w = route(p, x, cfg)
    y = 0.0
    for k in range(cfg.topk):
        u = jnp.einsum("td,tdf->tf", x, p["w_in"][ids[:, k]])
        h = jax.nn.silu(u[:, :cfg.ffn]) * u[:, cfg.ffn:]
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


ROWS = P(("data", "ep"))  # the batch: split over both axes


def parse_mesh(text: str | None, devices: int) -> dict[str, int]:
    """``"data=2,ep=4"`` -> ``{"data": 2, "ep": 4}`` (default: ``ep`` over every device)."""
    if text is None:
        return {"data": 1, "ep": devices}
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name not in ("data", "ep") or not size.isdigit() or int(size) < 1 or name in sizes:
            raise ValueError(f"--mesh must be data=D,ep=E (positive sizes), got {text!r}")
        sizes[name] = int(size)
    sizes = {"data": sizes.get("data", 1), "ep": sizes.get("ep", devices // sizes.get("data", 1))}
    if sizes["data"] * sizes["ep"] != devices:
        raise ValueError(f"--mesh {text!r}: data x ep = {sizes['data'] * sizes['ep']} must equal "
                         f"the {devices} devices")
    return sizes


class Trainer:
    """Builds the data x expert parallel train step over all devices on a ("data", "ep") mesh."""

    def __init__(self, cfg: ModelConfig, batch: int, seed: int = 0, lr: float = 3e-3,
                 mesh: str | None = None):
        self.cfg, self.batch = cfg, batch
        sizes = parse_mesh(mesh, jax.device_count())
        self.mesh = jax.make_mesh((sizes["data"], sizes["ep"]), ("data", "ep"),
                                  axis_types=(jax.sharding.AxisType.Auto,) * 2)
        n, split = sizes["ep"], sizes["data"] * sizes["ep"]
        if batch % split:
            raise ValueError(f"batch={batch} must be divisible by the {split} devices")
        if cfg.num_experts % n:
            raise ValueError(f"num_experts={cfg.num_experts} must be divisible by ep={n}")
        self.ep = ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=cfg.num_experts,
                                   topk=cfg.topk, tokens_per_rank=batch // split * cfg.seq)
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
                                            in_specs=(self.specs, ROWS), out_specs=ROWS))

        def local_loss_and_grads(params, tokens):
            """One device's share of the loss and the gradients, summed over the devices. Every
            weight is marked varying first, so that JAX inserts no sums of its own: the sums run
            here, chained -- one all-reduce of everything over "data", then one over "ep" of what
            is replicated there (all but the experts) -- so every device runs them in the same
            order (XLA:CPU may start independent all-reduces over different device groups in a
            different order on different devices, which can leave them waiting for each other)."""
            params = jax.tree_util.tree_map_with_path(  # (experts already vary over "ep")
                lambda path, a: jax.lax.pcast(a, ("data",) if is_expert(path) else ("data", "ep"),
                                              to="varying"), params)

            def loss_fn(p):
                return cross_entropy(local_logits(p, tokens), tokens) / split

            loss, grads = jax.value_and_grad(loss_fn)(params)
            loss, grads = jax.lax.psum((loss, grads), "data")
            loss, grads = jax.lax.psum(loss, "ep"), jax.tree_util.tree_map_with_path(
                lambda path, g: g if is_expert(path) else jax.lax.psum(g, "ep"), grads)
            return loss, grads

        grads_fn = jax.shard_map(local_loss_and_grads, mesh=self.mesh,
                                 in_specs=(self.specs, ROWS), out_specs=(P(), self.specs))

        def step(params, opt_state, tokens):
            loss, grads = grads_fn(params, tokens)
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
        return ep_comm.distributed.global_array(toks, NamedSharding(self.mesh, ROWS))

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


def time_steps(cfg: ModelConfig, batch: int, steps: int, seed: int):
    """Train ``steps`` steps of a large preset; report the median step time (after the first,
    which compiles) and that the loss fell."""
    trainer = Trainer(cfg, batch, seed=seed)
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    n = trainer.mesh.shape["ep"]
    say(f"MoE layer x{cfg.layers}: hidden {cfg.dim}, {cfg.num_experts} experts ({cfg.num_experts // n}"
        f" per device) of SwiGLU width {cfg.ffn}, top-{cfg.topk}, {trainer.ep.tokens_per_rank} "
        f"tokens per device, experts in {cfg.expert_dtype}, {n} {jax.default_backend()} devices")
    times, losses = [], []
    for i in range(steps):
        toks = trainer.put_tokens(trainer.sample())
        t0 = time.perf_counter()
        trainer.params, trainer.opt_state, loss = trainer.step_fn(trainer.params,
                                                                  trainer.opt_state, toks)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    if steps > 1:
        say(f"step time: median {np.median(times[1:]) * 1e3:.1f} ms over {steps - 1} steps "
            f"(first, with compilation: {times[0]:.1f} s); loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}")
    if not all(np.isfinite(losses)):
        raise SystemExit(f"non-finite loss: {losses}")
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model size (default: deepseek on a GPU, tiny elsewhere)")
    ap.add_argument("--steps", type=int, default=None, help="default: 300 (tiny), 20 (deepseek)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences, all devices together (default: 32 (tiny); deepseek: 8 per "
                         "device, 4096 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None,
                    help="CPU devices per process (default: what XLA_FLAGS gives)")
    ap.add_argument("--mesh", default=None,
                    help="data=D,ep=E: the batch over both axes, the experts over ep "
                         "(default: ep over every device)")
    for field in dataclasses.fields(ModelConfig):  # e.g. --dim 64 shrinks a preset
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                        default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ep_comm.distributed.initialize(local_device_count=args.devices)
    preset = args.preset or ("deepseek" if jax.default_backend() == "gpu" else "tiny")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
                 if getattr(args, f.name) is not None}
    cfg = ModelConfig(**{**PRESETS[preset], **overrides})
    n_dev = jax.device_count()
    if preset == "deepseek":
        cfg = dataclasses.replace(cfg, num_experts=overrides.get("num_experts",
                                                                 cfg.num_experts * n_dev))
    batch = args.batch or (32 if preset == "tiny" else 8 * n_dev)
    steps = args.steps if args.steps is not None else (300 if preset == "tiny" else 20)
    if preset != "tiny":
        return time_steps(cfg, batch, steps, args.seed)
    trainer = Trainer(cfg, batch, seed=args.seed, mesh=args.mesh)
    n, d = trainer.mesh.shape["ep"], trainer.mesh.shape["data"]
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    say(f"MoE transformer: {cfg.layers} layers, {cfg.num_experts} experts top-{cfg.topk}, "
        f"data x expert parallel over {d} x {n} {jax.default_backend()} devices "
        f"({cfg.num_experts // n} experts and {trainer.ep.tokens_per_rank} tokens per device)")
    err, scale = trainer.check_against_dense(trainer.sample())
    say(f"step 0: expert-parallel vs dense single-device logits: max |diff| = {err:.2e} "
        f"(logits up to {scale:.2f})")
    if err > 1e-4 * max(1.0, scale):
        raise SystemExit(f"expert-parallel model disagrees with the dense model: {err}")
    t0 = time.perf_counter()
    losses = trainer.train(steps, log=say)
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps "
        f"({time.perf_counter() - t0:.1f} s); chance level is {np.log(cfg.vocab):.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit("training did not reduce the loss by half")
    return losses


if __name__ == "__main__":
    main()
