"""``MoE``: a Flax NNX module over :func:`ep_comm.moe_layer` (router, routed SwiGLU experts sharded
over the expert-parallel mesh axis, optional shared expert). Needs flax (``pip install
'ep_comm[flax]'``); import it as ``from ep_comm.nnx import MoE``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ep_comm.config import EPConfig
from ep_comm.layer import moe_layer
from topology.checks import positive_int


def route(x, router, topk: int, normalize: bool = True):
    """Softmax router: ``(ids, weights)`` of each token's ``topk`` most probable experts (float32;
    the weights renormalised to sum to 1 when ``normalize``)."""
    probs = jax.nn.softmax(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)), axis=-1)
    w, ids = jax.lax.top_k(probs, topk)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w


class MoE(nnx.Module):
    """A DeepSeek/Mixtral-style MoE FFN block for Flax NNX models.

    ``y = sum_k w_k * SwiGLU_{e_k}(x) (+ SwiGLU_shared(x))`` with a softmax top-k router, the
    routed experts' weights sharded over ``axis_name`` of ``mesh`` (parameters carry
    ``out_sharding`` metadata: ``(axis_name, None, None)``) and the exchange done by ep_comm
    (dropless by default).

    Args:
      hidden: model width ``H``.
      intermediate: each routed expert's SwiGLU width ``I``.
      num_experts: routed experts, divisible by the mesh axis size.
      topk: experts per token.
      mesh: the :class:`jax.sharding.Mesh` holding ``axis_name``.
      axis_name: the expert-parallel mesh axis; tokens are split over it too.
      shared_intermediate: width of the shared expert (``None``: no shared expert).
      normalize_topk: renormalise the top-k router weights to sum to 1.
      dtype: compute dtype of the experts (parameters are stored in ``param_dtype``).
      param_dtype: parameter dtype.
      rngs: :class:`flax.nnx.Rngs` for the initialisation.
      **config: further :class:`ep_comm.EPConfig` fields (``backend``, ``plan``,
        ``recv_capacity``, ``overflow``, ``combine_dtype``...).

    Call with ``x`` of shape ``(..., H)``; the tokens (all leading dims together) are split over
    ``axis_name``, so their count must be divisible by its size.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, *,
                 mesh: Mesh, axis_name: str = "ep", shared_intermediate: int | None = None,
                 normalize_topk: bool = True, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs, **config):
        api = "ep_comm.nnx.MoE"
        for name, v in (("hidden", hidden), ("intermediate", intermediate),
                        ("num_experts", num_experts), ("topk", topk)):
            positive_int(api, name, v)
        if not isinstance(mesh, Mesh) or axis_name not in mesh.shape:
            raise ValueError(f"{api}: mesh must be a jax.sharding.Mesh with axis {axis_name!r}, "
                             f"got {mesh!r}")
        n = mesh.shape[axis_name]
        if num_experts % n:
            raise ValueError(f"{api}: num_experts={num_experts} must be divisible by the "
                             f"{n} devices of mesh axis {axis_name!r}")
        if shared_intermediate is not None:
            positive_int(api, "shared_intermediate", shared_intermediate)
        fixed = {"axis_name", "num_ranks", "num_experts", "topk", "tokens_per_rank"}
        if set(config) - {f.name for f in dataclasses.fields(EPConfig)} or fixed & set(config):
            raise ValueError(f"{api}: extra keyword arguments must be EPConfig fields other than "
                             f"axis_name, num_ranks, num_experts, topk and tokens_per_rank; "
                             f"got {sorted(config)}")
        self.hidden, self.intermediate, self.num_experts, self.topk = (
            hidden, intermediate, num_experts, topk)
        self.mesh, self.axis_name, self.normalize_topk = mesh, axis_name, normalize_topk
        self.dtype, self.config = jnp.dtype(dtype), dict(config)
        H, I, E = hidden, intermediate, num_experts

        def normal(shape, fan_in, sharding):
            value = (jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in))
            return nnx.Param(value.astype(param_dtype), out_sharding=sharding,
                             eager_sharding=False)

        self.router = normal((H, E), H, (None, None))
        self.w_in = normal((E, H, 2 * I), H, (axis_name, None, None))
        self.w_out = normal((E, I, H), I, (axis_name, None, None))
        shared = shared_intermediate is not None
        self.shared_w_in = nnx.data(
            normal((H, 2 * shared_intermediate), H, (None, None)) if shared else None)
        self.shared_w_out = nnx.data(
            normal((shared_intermediate, H), shared_intermediate, (None, None)) if shared
            else None)

    def ep_config(self, num_tokens: int) -> EPConfig:
        """The :class:`EPConfig` a call on ``num_tokens`` tokens (all ranks together) uses."""
        n = self.mesh.shape[self.axis_name]
        if num_tokens % n:
            raise ValueError(f"ep_comm.nnx.MoE: the {num_tokens} tokens of x must be divisible "
                             f"by the {n} devices of mesh axis {self.axis_name!r}")
        return EPConfig(axis_name=self.axis_name, num_ranks=n, num_experts=self.num_experts,
                        topk=self.topk, tokens_per_rank=num_tokens // n, **self.config)

    def __call__(self, x):
        x = jnp.asarray(x)
        if x.ndim < 2 or x.shape[-1] != self.hidden:
            raise ValueError(f"ep_comm.nnx.MoE: x must have shape (..., hidden) = "
                             f"(..., {self.hidden}), got {tuple(x.shape)}")
        lead = x.shape[:-1]
        tokens = self._reshape(x, (-1, self.hidden)).astype(self.dtype)
        cfg = self.ep_config(tokens.shape[0])
        ids, w = route(tokens, self.router[...], self.topk, self.normalize_topk)
        shared = self.shared_w_in is not None
        cast = lambda p: p[...].astype(self.dtype)
        ax = P(self.axis_name)

        def local(x, ids, w, w_in, w_out, *shared_w):
            return moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                             shared_w_in=shared_w[0] if shared else None,
                             shared_w_out=shared_w[1] if shared else None)

        args = [tokens, ids, w, cast(self.w_in), cast(self.w_out)]
        specs = [ax] * 5
        if shared:
            args += [cast(self.shared_w_in), cast(self.shared_w_out)]
            specs += [P(), P()]
        # tokens split over the axis, experts by their leading axis, the rest replicated (resharded
        # here, so any input layout works with meshes of explicit or auto axes)
        args = [self._place(a, s) for a, s in zip(args, specs)]
        y = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs), out_specs=ax)(*args)
        return self._reshape(y, (*lead, self.hidden))

    def _reshape(self, a, shape):
        """Reshape; on a mesh of explicit axes (whose types forbid splitting a sharded dim) via
        a replicated copy."""
        if a.ndim == len(shape):
            return a
        if self._explicit:
            a = self._place(a, P())
        return a.reshape(shape)

    @property
    def _explicit(self) -> bool:
        return jax.sharding.AxisType.Explicit in tuple(getattr(self.mesh, "axis_types", ()))

    def _place(self, a, spec):
        sharding = NamedSharding(self.mesh, spec)
        if self._explicit:
            return jax.sharding.reshard(a, sharding)
        return jax.lax.with_sharding_constraint(a, sharding)
