"""The dense MoE layer the benchmarks and the tests check against: every token's top-k experts
run one by one on its own row, with no routing buffers, no groups and no exchange."""

from __future__ import annotations

import numpy as np


def dense_swiglu_moe(x, ids, w, w_in, w_out, shared_w_in=None, shared_w_out=None, xp=None):
    """``sum_k w[:, k] * swiglu(x @ w_in[e]) @ w_out[e]`` with ``e = ids[:, k]``, over the slots
    with ``ids >= 0``, plus the shared expert when given. ``xp``: the array namespace,
    ``jax.numpy`` (the default: differentiable, any float dtype; run it under
    ``jax.enable_x64()`` on float64 inputs for a float64 reference) or ``numpy`` (float64 on the
    host). Each slot gathers its tokens' weights, ``(T, H, 2I)``: for a few tokens."""
    if xp is None:
        import jax.numpy as xp

    def swiglu(u, inter):
        gate = u[..., :inter]
        return gate / (1 + xp.exp(-gate)) * u[..., inter:]

    E, inter = w_in.shape[0], w_out.shape[-2]
    y = 0.0
    for k in range(ids.shape[1]):
        e = xp.clip(ids[:, k], 0, E - 1)
        a = swiglu(xp.einsum("th,thf->tf", x, w_in[e]), inter)
        y = y + xp.where(ids[:, k:k + 1] >= 0, w[:, k:k + 1], 0.0) * \
            xp.einsum("tf,tfh->th", a, w_out[e])
    if shared_w_in is not None:
        y = y + swiglu(x @ shared_w_in, shared_w_out.shape[-2]) @ shared_w_out
    return y


def layer_reference(x, ids, w, w_in, w_out, dtype):
    """The layer's output in float64 on the host from the inputs rounded to ``dtype``."""
    import jax.numpy as jnp

    r = lambda a: np.asarray(jnp.asarray(a, dtype), np.float64)  # noqa: E731
    return dense_swiglu_moe(r(x), np.asarray(ids), np.asarray(w, np.float64), r(w_in), r(w_out),
                            xp=np)


def dense_experts(xg, w_in, w_out):
    """The experts' FLOPs with every group the same size, the benchmarks' dense ceiling: ``xg``
    ``(G, M, H)``, group ``g``'s rows through ``swiglu(xg[g] @ w_in[g]) @ w_out[g]`` as two batched
    einsums (``(G, M, H)`` out): the work of a layer without the raggedness or the routing."""
    import jax.numpy as jnp

    from ep_comm.layer import swiglu

    G, M, _ = xg.shape
    inter = w_out.shape[-2]
    u = jnp.einsum("gmh,ghf->gmf", xg, w_in)
    return jnp.einsum("gmf,gfh->gmh", swiglu(u.reshape(G * M, 2 * inter), inter).reshape(
        G, M, inter), w_out)
