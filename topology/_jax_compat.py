"""The one module that touches JAX internals or version-dependent behaviour.

It sits at the bottom of the package stack (``ep_comm`` -> ``ep_comm.collectives`` -> ``ep_comm.topology``), so
every layer takes its shims from here; everything else uses public JAX APIs only.
"""

from __future__ import annotations

import jax
from jax import lax


def is_tracer(x) -> bool:
    """True for a value being traced (inside jit/shard_map/grad), False for a concrete array."""
    return isinstance(x, jax.core.Tracer)


def axis_size(axis_name, api_name: str) -> int:
    """Size of the bound mesh axis (or tuple of axes) ``axis_name``, as a Python int.

    Raises ``NameError`` with guidance when the axis is not bound, i.e. the collective is called
    outside ``jax.shard_map`` (or a ``vmap`` with that ``axis_name``).
    """
    try:
        size = lax.axis_size(axis_name)
    except NameError as e:
        raise NameError(
            f"{api_name}: axis_name {axis_name!r} is not bound here ({e}). Call {api_name} inside "
            f"jax.shard_map(..., mesh=mesh) over a mesh that has this axis.") from None
    try:
        return int(size)
    except TypeError:  # a tracer: the size is not static here
        raise TypeError(f"{api_name}: the size of axis {axis_name!r} is not static here; "
                        f"call it directly inside jax.shard_map") from None


def named_axis_effects(axis_names) -> set:
    """The effects JAX's own collectives declare over ``axis_names`` (``core.NamedAxisEffect``)."""
    from jax._src import core

    return {*map(core.NamedAxisEffect, axis_names)}


def distributed_client():
    """The ``jax.distributed`` key-value store client of this process, or None before
    ``jax.distributed.initialize``."""
    from jax._src import distributed

    return distributed.global_state.client


def module_state(module_context) -> dict:
    """A dict that lives as long as the MLIR module being lowered (for lowering rules that link
    the calls of one module, such as the mpi transport's chain of exchanges)."""
    cache = module_context.cached_primitive_lowerings
    return cache.setdefault("ep_comm module state", {})


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (``check_vma`` types): the
    aval's ``mat.varying`` (jax >= 0.10), ``vma`` before."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def match_vma(x, like):
    """``x`` marked varying over the manual mesh axes ``like`` varies over, for values made by
    kernels that do not carry them (Pallas outputs)."""
    missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def sum_to_vma(ct, like):
    """A cotangent ``ct`` for a primal ``like``, summed (``psum``) over the manual mesh axes it
    varies over and ``like`` does not: the transpose of using an invariant value in varying work,
    for custom VJP rules (JAX inserts the same sum for its own rules)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(like)))
    return jax.lax.psum(ct, extra) if extra else ct


def cotangent_like(ct, primal):
    """``ct`` typed as ``primal``'s cotangent inside ``shard_map``, for custom VJP rules: summed
    over the mesh axes only it varies over (a weight replicated over a data axis gets the sum of
    that axis's gradients), marked varying over those only ``primal`` varies over."""
    return match_vma(sum_to_vma(ct, primal), primal)


def command_buffer_traits() -> dict:
    """``register_ffi_target`` keyword arguments marking a handler safe to capture into XLA's
    command buffers (CUDA graphs): it launches the same device work for the same shapes and
    attributes, and never synchronises with the host. Empty where this jaxlib lacks the flag."""
    try:
        from jax._src.lib import xla_client
        return dict(traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    except (ImportError, AttributeError):
        return {}


def vma_unchecked():
    """A context in which traced values carry no varying-axes types (``check_vma`` off), for
    kernels whose Pallas outputs do not declare them (tokamax's Mosaic TPU ragged dot under jax
    0.10: "manual_axis_type ... must not be None"); ``match_vma`` restores the types after."""
    from jax._src import config

    return config._check_vma(False)
