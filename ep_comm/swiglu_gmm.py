"""The SwiGLU experts' up projection as one Pallas TPU kernel: ``h = silu(x @ w_gate) * (x @ w_up)``
per group of rows, with SwiGLU in the kernel's epilogue, so that ``u = x @ w_in`` (``2I`` wide) is
never written to HBM nor read back.

:func:`moe_layer` and :func:`ep_comm.swiglu_experts` run it with ``implementation=``
:data:`SWIGLU_KERNEL` (``"megablox-swiglu"``): this kernel for the up projection's forward, megablox
(:func:`ep_comm.grouped_matmul` ``"megablox"``) for the down projection and for every backward pass.
Under ``grad`` the forward keeps ``u`` for the backward as the unfused path does (the backward needs
it); the saving is the forward's, in inference and in a forward whose result is not differentiated.

The kernel walks the row tiles of each group in turn (megablox's scheme, written here for this
epilogue): a grid over ``(column tiles, visits, K tiles)`` where a visit is one (group, row tile)
pair, so a row tile that holds the end of one group and the start of the next is visited once per
group. Each visit accumulates the gate and the up tile of its group's weight in float32, and at the
last K tile writes ``silu(gate) * up`` into the rows of the tile that belong to its group; the output
tile stays in VMEM over a tile's consecutive visits. The number of visits depends on the group sizes;
the grid holds the most there can be (row tiles + groups - 1) and the visits past the real ones
repeat the last one's blocks and compute nothing. Off TPU it runs in Pallas's interpret mode (for
the tests).

Measured on a TPU v5e (docs/performance.md, "megablox on TPU"): alone, 0.73x-0.88x the time of
megablox's up projection then XLA's SwiGLU; in ``moe_layer`` at H=2048 the forward gained nothing
(1.01x) and forward+backward lost 10%, so ``"auto"`` does not take it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ep_comm.gemm import grouped_matmul, pallas_trace
from ep_comm.topology._jax_compat import match_vma

SWIGLU_KERNEL = "megablox-swiglu"
# (tm, tk, tn): rows, K and columns of a tile of each half; the default where it divides: on a
# TPU v5e the fastest of 7 at T=4096, top-8 of 32, H=7168, I=2048 (0.88x megablox's up projection
# + XLA's SwiGLU), 0.81x at H=2048, I=1024 (docs/performance.md, "megablox on TPU")
TILING = (256, 1024, 1024)


def _divisor(n: int, want: int, quantum: int) -> int:
    """The largest multiple of ``quantum`` that divides ``n`` and is at most ``want`` (``n``
    itself when ``n <= want``)."""
    if n <= want:
        return n
    for t in range(want - want % quantum, 0, -quantum):
        if n % t == 0:
            return t
    return n


def swiglu_tiling(rows: int, hidden: int, inter: int, tiling=None) -> tuple[int, int, int]:
    """The kernel's ``(tm, tk, tn)`` for ``rows`` of ``hidden`` into SwiGLU width ``inter``,
    from ``tiling`` (default :data:`TILING`): ``tk`` and ``tn`` the largest multiples of 128 up
    to them that divide ``hidden`` and ``inter`` (or the whole dimension), ``tm`` no larger
    than the rows rounded up to 8."""
    tm, tk, tn = tiling or TILING
    return min(tm, -(-rows // 8) * 8), _divisor(hidden, tk, 128), _divisor(inter, tn, 128)


def visits(group_sizes, rows: int, tm: int):
    """The kernel's walk over ``rows`` (a multiple of ``tm``) grouped by ``group_sizes``:
    ``(offsets, group_ids, tile_ids, count)`` -- ``offsets`` ``(G + 1,)`` the groups' bounds
    (clipped to ``rows``), then per visit (``rows // tm + G - 1`` of them, the last ones repeating
    the final real visit) its group and row tile, and ``count`` ``(1,)`` the real visits."""
    G = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offsets = jnp.concatenate([starts, ends[-1:]])
    first = starts // tm
    tiles = jnp.where(ends > starts, (ends - 1) // tm - first + 1, 0)  # per group
    last_visit = jnp.cumsum(tiles)  # one past each group's last visit
    count = last_visit[-1]
    V = rows // tm + G - 1
    i = jnp.minimum(jnp.arange(V, dtype=jnp.int32), jnp.maximum(count - 1, 0))
    g = jnp.minimum(jnp.searchsorted(last_visit, i, side="right"), G - 1).astype(jnp.int32)
    tile = first[g] + i - (last_visit[g] - tiles[g])
    return offsets, g, jnp.clip(tile, 0, rows // tm - 1), count[None]


def _kernel(offsets, group_ids, tile_ids, count, x_ref, wg_ref, wu_ref, out_ref, acc_g, acc_u,
            *, tm: int, k_tiles: int):
    i, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_g[...] = jnp.zeros_like(acc_g)
        acc_u[...] = jnp.zeros_like(acc_u)

    real = i < count[0]

    @pl.when(real)
    def _():
        x = x_ref[...]
        acc_g[...] += jnp.dot(x, wg_ref[...], preferred_element_type=jnp.float32)
        acc_u[...] += jnp.dot(x, wu_ref[...], preferred_element_type=jnp.float32)

    @pl.when(real & (k == k_tiles - 1))
    def _():
        g, tile = group_ids[i], tile_ids[i]
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_g.shape, 0)
        mine = (rows >= offsets[g]) & (rows < offsets[g + 1])
        h = (jax.nn.silu(acc_g[...]) * acc_u[...]).astype(out_ref.dtype)
        # the tile's first visit starts it from zero (rows of no group stay zero), a later one
        # keeps the rows of the groups before
        fresh = (i == 0) | (tile_ids[jnp.maximum(i - 1, 0)] != tile)
        before = jnp.where(fresh, jnp.zeros_like(h), out_ref[...])
        out_ref[...] = jnp.where(mine, h, before)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _swiglu_gmm(x, w_in, group_sizes, tiling, interpret):
    M, H = x.shape
    I = w_in.shape[2] // 2
    tm, tk, tn = tiling
    rows = -(-M // tm) * tm
    xp = x if rows == M else jnp.pad(x, ((0, rows - M), (0, 0)))
    offsets, group_ids, tile_ids, count = visits(group_sizes, rows, tm)
    V, k_tiles, n_tiles = group_ids.shape[0], H // tk, I // tn
    squeezed = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n_tiles, V, k_tiles),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda j, i, k, o, g, t, c: (t[i], k)),
            pl.BlockSpec((squeezed, tk, tn), lambda j, i, k, o, g, t, c: (g[i], k, j)),
            pl.BlockSpec((squeezed, tk, tn), lambda j, i, k, o, g, t, c: (g[i], k, j + n_tiles)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i, k, o, g, t, c: (t[i], j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32)])
    call = pl.pallas_call(
        functools.partial(_kernel, tm=tm, k_tiles=k_tiles),
        out_shape=jax.ShapeDtypeStruct((rows, I), x.dtype),
        grid_spec=grid,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * rows * H * 2 * I, transcendentals=rows * I,
                                      bytes_accessed=(rows * H + w_in.size + rows * I)
                                      * x.dtype.itemsize),
        interpret=interpret)
    return call(offsets, group_ids, tile_ids, count, xp, w_in, w_in)[:M]


def swiglu_gmm(x, w_in, group_sizes, *, tiling=None):
    """``silu(x[r] @ w_in[g][:, :I]) * (x[r] @ w_in[g][:, I:])`` for each row ``r`` of group ``g``
    (float32 accumulation, the result in ``x``'s dtype): the kernel alone, not differentiable
    (:func:`swiglu_grouped_matmul` is). Rows past the groups: zero where a visited tile holds
    them, else unspecified (``moe_layer``'s down projection reads only the groups' rows).

    Args:
      x: ``(M, H)`` bfloat16, float16 or float32, rows grouped contiguously from row 0.
      w_in: ``(G, H, 2I)`` in ``x``'s dtype: the gate projection in the first ``I`` columns.
      group_sizes: ``(G,)`` integer.
      tiling: ``(tm, tk, tn)`` as given (``tm`` clipped to the rows), default
        :func:`swiglu_tiling`'s.
    """
    api = "swiglu_gmm"
    x, w_in, group_sizes = jnp.asarray(x), jnp.asarray(w_in), jnp.asarray(group_sizes)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (rows, hidden), got "
                         f"{x.dtype} {tuple(x.shape)}")
    if (w_in.ndim != 3 or w_in.shape[1] != x.shape[1] or w_in.shape[2] % 2
            or w_in.dtype != x.dtype):
        raise ValueError(f"{api}: w_in must be a {x.dtype} array of shape (groups, hidden = "
                         f"{x.shape[1]}, 2 * intermediate), got {w_in.dtype} "
                         f"{tuple(w_in.shape)}")
    if (group_sizes.ndim != 1 or group_sizes.shape[0] != w_in.shape[0]
            or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
        raise ValueError(f"{api}: group_sizes must be an integer array of shape (groups,) = "
                         f"({w_in.shape[0]},), got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    if tiling is None:
        tm, tk, tn = swiglu_tiling(x.shape[0], x.shape[1], w_in.shape[2] // 2)
    else:
        tm, tk, tn = min(tiling[0], -(-x.shape[0] // 8) * 8), *tiling[1:]
    if x.shape[1] % tk or (w_in.shape[2] // 2) % tn or tm % 8:
        raise ValueError(f"{api}: tiling (tm, tk, tn) = {(tm, tk, tn)} must have tk dividing "
                         f"hidden ({x.shape[1]}), tn dividing intermediate "
                         f"({w_in.shape[2] // 2}) and tm a multiple of 8")
    interpret = jax.default_backend() != "tpu"
    if not interpret and (tn % 128 or (tk % 128 and tk != x.shape[1])):
        raise ValueError(f"{api}: on TPU the kernel's blocks are whole (8, 128) tiles: tn must be "
                         f"a multiple of 128 (so intermediate, {w_in.shape[2] // 2}, too) and tk "
                         f"one or all of hidden ({x.shape[1]}), got tiling {(tm, tk, tn)}; "
                         f"implementation='megablox' runs any shape")
    with pallas_trace(x.dtype):
        h = _swiglu_gmm(x, w_in, group_sizes.astype(jnp.int32), (tm, tk, tn), interpret)
    return match_vma(match_vma(h, x), w_in)


def swiglu(u, intermediate: int):
    """``silu(u[:, :I]) * u[:, I:]`` in float32, in ``u``'s dtype: the gate half first."""
    g = u[:, :intermediate].astype(jnp.float32)
    return (jax.nn.silu(g) * u[:, intermediate:].astype(jnp.float32)).astype(u.dtype)


def _unfused(x, w_in, group_sizes, implementation):
    """What the kernel computes, as :func:`ep_comm.swiglu_experts`' unfused up projection does:
    :func:`ep_comm.grouped_matmul`, then :func:`swiglu`."""
    u = grouped_matmul(x, w_in, group_sizes, implementation=implementation,
                       zero_past_groups=False)
    return swiglu(u, w_in.shape[2] // 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def swiglu_grouped_matmul(x, w_in, group_sizes, implementation="megablox"):
    """:func:`swiglu_gmm`, differentiable in ``x`` and ``w_in``: the forward is the fused
    kernel; under ``grad`` the forward runs :func:`ep_comm.grouped_matmul` (``implementation``)
    then SwiGLU, keeping ``u`` for the backward, which is that path's VJP."""
    return swiglu_gmm(x, w_in, group_sizes)


def _vjp_fwd(x, w_in, group_sizes, implementation):
    h, vjp = jax.vjp(lambda a, b: _unfused(a, b, group_sizes, implementation), x, w_in)
    return h, (vjp, group_sizes)


def _vjp_bwd(implementation, res, dh):
    vjp, group_sizes = res
    dx, dw = vjp(dh)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


swiglu_grouped_matmul.defvjp(_vjp_fwd, _vjp_bwd)
