"""How a row kernel is one JAX primitive: the lowering it takes (CUDA kernel, fast XLA or
reference XLA) and its rules, defined once (:func:`primitive`)."""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ep_comm.collectives import bootstrap
from ep_comm.topology._jax_compat import match_vma

LOWERINGS = ("cuda", "xla", "reference")
_forced: list[str] = []  # the lowering the innermost xla_only() / reference_only() block asks for


def unavailable_reason() -> str | None:
    """None when the CUDA row kernels are built and loadable here, else why not."""
    return bootstrap.load("rows")[1]


@contextlib.contextmanager
def _forcing(lowering: str):
    _forced.append(lowering)
    try:
        yield
    finally:
        _forced.pop()


def xla_only():
    """Trace with the fast XLA lowerings on every platform inside this block (no CUDA kernels):
    the production path off CUDA, for A/B comparisons on GPUs."""
    return _forcing("xla")


def reference_only():
    """Trace with the XLA *reference* lowerings inside this block: the definitions the CUDA
    kernels and the fast XLA lowerings are tested against (per-element scatters, poisoned rows;
    written to be checked, not to be fast)."""
    return _forcing("reference")


def lowering() -> str:
    """The lowering a primitive bound now asks for (one of :data:`LOWERINGS`):
    ``EP_COMM_ROW_KERNELS=0`` (read when a program is traced) means ``"xla"``,
    ``EP_COMM_ROW_KERNELS=reference`` ``"reference"``; ``"cuda"`` falls back to ``"xla"`` where
    no kernel is built or fits."""
    if _forced:
        return _forced[-1]
    env = os.environ.get("EP_COMM_ROW_KERNELS", "1")
    return {"0": "xla", "reference": "reference"}.get(env, "cuda")


def same_vma(*xs):
    """Every operand marked varying over the mesh axes any of them varies over."""
    out = list(xs)
    for i in range(len(out)):
        for other in xs:
            out[i] = match_vma(out[i], other)
    return out


def zero_tangent(out):
    """The symbolic zero tangent of a primitive's output (float0 for integer outputs)."""
    return ad.Zero(jax.typeof(out).to_tangent_aval())


def constant_jvp(p):
    """Register ``p`` as constant in its operands (it moves bytes: no gradient flows)."""
    def jvp(primals, tangents, **params):
        out = p.bind(*primals, **params)
        return out, ([zero_tangent(o) for o in out] if p.multiple_results
                     else zero_tangent(out))
    ad.primitive_jvps[p] = jvp


def poison(dtype):
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.array(jnp.nan, dtype)
    return jnp.array(np.array(-1, np.int64).astype(dtype))  # all bits set


def primitive(name, reference, abstract, static, ffi_attrs=lambda **params: {},
               kernel_fits=lambda ctx, **params: True, multiple_results=False, fast=None,
               ffi_operands=None):
    """The primitive ``name`` (also its FFI target's name). Its ``kernel`` parameter (one of
    :data:`LOWERINGS`, :func:`lowering` at bind time) picks the lowering: ``"reference"``:
    ``reference`` (an XLA function of the operands and every parameter); ``"xla"``: ``fast``
    (the same function written for speed on TPUs and CPUs: sorts and whole-row gathers, no scatter
    of rows; equal to ``reference``, bitwise for moves) or ``reference`` when there is none;
    ``"cuda"``: on GPUs the CUDA kernel when ``kernel_fits`` and the kernels are built here (with
    the attributes ``ffi_attrs(**params)``), else as ``"xla"``. Outside ``jit`` it runs jitted
    (``static``: its parameters), so eager calls take the same lowering; batching goes through the
    XLA function the parameter picks. ``ffi_operands``: how many of the leading operands the
    kernel takes (default all; the others only serve the XLA lowerings)."""
    p = Primitive(name)
    p.multiple_results = multiple_results

    def chosen(params):
        return reference if fast is None or params["kernel"] == "reference" else fast

    def xla(ctx, *args, **params):
        return mlir.lower_fun(functools.partial(chosen(params), **params),
                              multiple_results=multiple_results)(ctx, *args)

    def cuda(ctx, *args, **params):
        if params["kernel"] == "cuda" and kernel_fits(ctx, **params) and _registered():
            used = len(args) if ffi_operands is None else ffi_operands
            return jax.ffi.ffi_lowering(name)(ctx.replace(avals_in=ctx.avals_in[:used]),
                                              *args[:used], **ffi_attrs(**params))
        return xla(ctx, *args, **params)

    def batch(args, dims, **params):
        out = jax.vmap(functools.partial(chosen(params), **params), in_axes=dims)(*args)
        return out, ([0] * len(out) if multiple_results else 0)

    p.def_impl(functools.partial(jax.jit, static_argnames=static)(
        lambda *args, **params: p.bind(*args, **params)))
    p.def_abstract_eval(abstract)
    batching.primitive_batchers[p] = batch
    mlir.register_lowering(p, xla)
    mlir.register_lowering(p, cuda, platform="cuda")
    return p


def _registered() -> bool:
    """Register the kernels with XLA (once); False when they are not built here."""
    if unavailable_reason() is not None:
        return False
    bootstrap.register_targets("rows")
    return True
