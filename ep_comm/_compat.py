"""The one place that touches JAX internals or version-dependent behaviour.

Everything else in ep_comm uses public JAX APIs only.
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
