"""``MoE``: a Flax NNX module over :func:`ep_comm.moe_layer` (router, routed SwiGLU experts sharded
over the expert-parallel mesh axis, optional shared expert), and :func:`param_initializer`, which
creates a parameter already sharded. Needs flax (``pip install 'ep_comm[flax]'``); import it as
``from ep_comm.nnx import MoE``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ep_comm.config import EPConfig
from ep_comm.layer import moe_layer
from ep_comm.topology._checks import positive_int


def route(x, router, topk: int, normalize: bool = True):
    """Softmax router: ``(ids, weights)`` of each token's ``topk`` most probable experts (float32;
    the weights renormalised to sum to 1 when ``normalize``)."""
    probs = jax.nn.softmax(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)), axis=-1)
    w, ids = jax.lax.top_k(probs, topk)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w


@functools.lru_cache(maxsize=None)
def param_initializer(shape: tuple, fan_in: int, dtype, sharding: NamedSharding):
    """A jitted ``key -> normal(0, 1 / fan_in)`` array of ``shape`` and ``dtype``, made with
    ``sharding``: no device ever holds more than its block of it, even while it is drawn.

    A stack of matrices (3 or more dims, e.g. ``(experts, H, 2I)``) is drawn matrix by matrix:
    each device loops over its own leading indices ``e`` and draws matrix ``e`` from
    ``fold_in(key, e)`` (cut to its block where other dims are split), so its peak memory is its
    block plus a few of one matrix. A matrix is drawn by one program compiled with output
    ``sharding`` (each device draws its own block: JAX's partitionable threefry). Either way the
    values do not depend on ``sharding`` (up to float32 rounding of the normal's arithmetic).
    Cached per arguments; ``.lower(key).compile().memory_analysis()`` shows the memory per
    device."""
    dtype, shape = jnp.dtype(dtype), tuple(int(d) for d in shape)

    def draw(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    if len(shape) < 3:
        return jax.jit(functools.partial(draw, shape=shape), out_shardings=sharding)
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    block = sharding.shard_shape(shape)

    def start(d):  # this device's first index along dim d
        if spec[d] is None:
            return 0
        return jax.lax.axis_index(spec[d]) * block[d]

    def local(key):
        starts = [start(d) for d in range(len(shape))]

        def one(e):
            m = draw(jax.random.fold_in(key, starts[0] + e), shape[1:])
            return jax.lax.dynamic_slice(m, starts[1:], block[1:])

        return jax.lax.map(one, jnp.arange(block[0]))

    return jax.jit(jax.shard_map(local, mesh=sharding.mesh, in_specs=P(),
                                 out_specs=P(*spec)), out_shardings=sharding)


def _axes_size(mesh: Mesh, axes) -> int:
    """Devices of ``mesh`` along the axes ``axes`` together."""
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


class MoE(nnx.Module):
    """A DeepSeek/Mixtral-style MoE FFN block for Flax NNX models.

    ``y = sum_k w_k * SwiGLU_{e_k}(x) (+ SwiGLU_shared(x))`` with a softmax top-k router and the
    exchange done by ep_comm (dropless by default).

    Layout over ``mesh`` (every parameter is created in it, :func:`param_initializer`: no device
    holds more than its share at any time):

    - the routed experts' weights ``w_in`` ``(E, H, 2I)`` and ``w_out`` ``(E, I, H)`` are split
      over ``axis_name`` by expert (``E / n`` experts per device), replicated over the other axes,
      or with ``fsdp=True`` also split over ``data_axes`` along their second dimension;
    - the router ``(H, E)`` and the shared expert are replicated, or with ``fsdp=True`` split over
      ``data_axes`` along their first dimension;
    - the tokens are split over ``data_axes`` and ``axis_name`` together: each device routes and
      sends its own ``1 / (data x ep)`` of them, and the experts of a device serve the tokens of
      its ``axis_name`` group. FSDP-split weights are gathered for the call (their gradients are
      reduce-scattered back) by JAX's sharding propagation. Parameters carry their
      ``PartitionSpec`` as ``out_sharding`` metadata (``nnx.get_partition_spec``).

    Args:
      hidden: model width ``H``.
      intermediate: each routed expert's SwiGLU width ``I``.
      num_experts: routed experts, divisible by the size of ``axis_name``.
      topk: experts per token.
      mesh: the :class:`jax.sharding.Mesh` holding ``axis_name``.
      axis_name: the expert-parallel mesh axis.
      data_axes: the data-parallel mesh axes the tokens are also split over: a name or a tuple of
        names of ``mesh`` other than ``axis_name``. Default ``None``: every other axis of
        ``mesh`` (on a ``("data", "ep")`` mesh, ``("data",)``); ``()`` replicates the layer's
        work over them.
      fsdp: store the weights split over ``data_axes`` as well (fully sharded data parallel):
        the experts along ``H``, the router and the shared expert along their first dimension,
        which must be divisible by the product of the ``data_axes`` sizes.
      shared_intermediate: width of the shared expert (``None``: no shared expert).
      normalize_topk: renormalise the top-k router weights to sum to 1.
      dtype: compute dtype of the experts (parameters are stored in ``param_dtype``).
      param_dtype: parameter dtype.
      rngs: :class:`flax.nnx.Rngs` for the initialisation.
      **config: further :class:`ep_comm.EPConfig` fields (``backend``, ``plan``,
        ``recv_capacity``, ``overflow``, ``invalid_ids``, ``combine_dtype``...). The layer's
        own router picks ids with ``lax.top_k`` over ``num_experts`` probabilities, so none
        can be out of range: ``invalid_ids`` defaults to ``"ignore"`` here, which keeps the
        run-time check's host callback out of the step (``EPConfig``'s ``invalid_ids``).

    Call with ``x`` of shape ``(..., H)``; the tokens (all leading dims together) are split over
    ``data_axes`` and ``axis_name``, so their count must be divisible by the product of their sizes.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, *,
                 mesh: Mesh, axis_name: str = "ep", data_axes: str | tuple | None = None,
                 fsdp: bool = False, shared_intermediate: int | None = None,
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
        if data_axes is None:
            data_axes = tuple(a for a in mesh.axis_names if a != axis_name)
        elif isinstance(data_axes, str):
            data_axes = (data_axes,)
        if (not isinstance(data_axes, tuple) or len(set(data_axes)) != len(data_axes)
                or any(a == axis_name or a not in mesh.shape for a in data_axes)):
            raise ValueError(f"{api}: data_axes must be None, a name or a tuple of distinct names "
                             f"of mesh axes other than axis_name={axis_name!r} (the mesh has "
                             f"{tuple(mesh.axis_names)}), got {data_axes!r}")
        if not isinstance(fsdp, bool):
            raise TypeError(f"{api}: fsdp must be a bool, got {type(fsdp).__name__}")
        data = _axes_size(mesh, data_axes)
        if shared_intermediate is not None:
            positive_int(api, "shared_intermediate", shared_intermediate)
        if fsdp:
            dims = {"hidden": hidden}
            if shared_intermediate is not None:
                dims["shared_intermediate"] = shared_intermediate
            for name, v in dims.items():
                if v % data:
                    raise ValueError(f"{api}: with fsdp=True, {name}={v} must be divisible by "
                                     f"the {data} devices of data_axes {data_axes}")
        fixed = {"axis_name", "num_ranks", "num_experts", "topk", "tokens_per_rank"}
        if set(config) - {f.name for f in dataclasses.fields(EPConfig)} or fixed & set(config):
            raise ValueError(f"{api}: extra keyword arguments must be EPConfig fields other than "
                             f"axis_name, num_ranks, num_experts, topk and tokens_per_rank; "
                             f"got {sorted(config)}")
        self.hidden, self.intermediate, self.num_experts, self.topk = (
            hidden, intermediate, num_experts, topk)
        self.mesh, self.axis_name, self.normalize_topk = mesh, axis_name, normalize_topk
        self.data_axes, self.fsdp = data_axes, fsdp
        self.dtype, self.config = jnp.dtype(dtype), dict(config)
        H, I, E = hidden, intermediate, num_experts
        d = (data_axes or None) if fsdp else None  # the FSDP split, when asked

        def normal(shape, fan_in, spec):
            init = param_initializer(shape, fan_in, jnp.dtype(param_dtype),
                                     NamedSharding(mesh, spec))
            value = init(rngs.params())
            return nnx.Param(value, out_sharding=tuple(spec), eager_sharding=False)

        self.router = normal((H, E), H, P(d, None))
        self.w_in = normal((E, H, 2 * I), H, P(axis_name, d, None))
        self.w_out = normal((E, I, H), I, P(axis_name, d, None))
        shared = shared_intermediate is not None
        self.shared_w_in = nnx.data(
            normal((H, 2 * shared_intermediate), H, P(d, None)) if shared else None)
        self.shared_w_out = nnx.data(
            normal((shared_intermediate, H), shared_intermediate, P(d, None)) if shared
            else None)

    @property
    def token_axes(self) -> tuple:
        """The mesh axes the tokens are split over: ``data_axes``, then ``axis_name``."""
        return (*self.data_axes, self.axis_name)

    def ep_config(self, num_tokens: int) -> EPConfig:
        """The :class:`EPConfig` a call on ``num_tokens`` tokens (all devices together) uses."""
        n = self.mesh.shape[self.axis_name]
        split = _axes_size(self.mesh, self.token_axes)
        if num_tokens % split:
            raise ValueError(f"ep_comm.nnx.MoE: the {num_tokens} tokens of x must be divisible "
                             f"by the {split} devices of mesh axes {self.token_axes}")
        # (ids from the layer's own top-k router are in range: no run-time check by default)
        config = {"invalid_ids": "ignore", **self.config}
        return EPConfig(axis_name=self.axis_name, num_ranks=n, num_experts=self.num_experts,
                        topk=self.topk, tokens_per_rank=num_tokens // split, **config)

    def __call__(self, x):
        x = jnp.asarray(x)
        if x.ndim < 2 or x.shape[-1] != self.hidden:
            raise ValueError(f"ep_comm.nnx.MoE: x must have shape (..., hidden) = "
                             f"(..., {self.hidden}), got {tuple(x.shape)}")
        lead = x.shape[:-1]
        cfg = self.ep_config(int(np.prod(lead, dtype=np.int64)))
        rows, experts = P(self.token_axes), P(self.axis_name)
        tokens = self._reshape(x, (-1, self.hidden), rows).astype(self.dtype)
        shared = self.shared_w_in is not None
        cast = lambda p: p[...].astype(self.dtype)

        def local(x, router, w_in, w_out, *shared_w):
            ids, w = route(x, router, self.topk, self.normalize_topk)
            return moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                             shared_w_in=shared_w[0] if shared else None,
                             shared_w_out=shared_w[1] if shared else None)

        args = [tokens, self.router[...], cast(self.w_in), cast(self.w_out)]
        specs = [rows, P(), experts, experts]
        if shared:
            args += [cast(self.shared_w_in), cast(self.shared_w_out)]
            specs += [P(), P()]
        # tokens split over the data axes and the expert axis, experts by their leading axis, the
        # rest replicated (resharded here: FSDP-split weights are gathered, and any input layout
        # works with meshes of explicit or auto axes)
        args = [self._place(a, s) for a, s in zip(args, specs)]
        y = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs), out_specs=rows)(*args)
        if not self._explicit:
            return y.reshape(*lead, self.hidden)  # (its layout left to XLA, as x's was)
        return self._reshape(y, (*lead, self.hidden), jax.typeof(x).sharding.spec)

    def _reshape(self, a, shape, spec):
        """Reshape into the layout ``spec`` (on a mesh of explicit axes, whose types make the
        caller say the result's layout, given to the reshape; else a sharding constraint)."""
        if a.ndim == len(shape):
            return self._place(a, spec)
        if self._explicit:
            return jnp.reshape(a, shape, out_sharding=NamedSharding(self.mesh, spec))
        return self._place(a.reshape(shape), spec)

    @property
    def _explicit(self) -> bool:
        return jax.sharding.AxisType.Explicit in tuple(getattr(self.mesh, "axis_types", ()))

    def _place(self, a, spec):
        sharding = NamedSharding(self.mesh, spec)
        if self._explicit:
            return jax.sharding.reshard(a, sharding)
        return jax.lax.with_sharding_constraint(a, sharding)
