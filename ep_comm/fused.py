"""The MoE layer's fused path: the SwiGLU experts' GEMMs read the exchange's buffer directly.

:func:`moe_layer` with ``implementation="cutlass-fused"`` (:data:`FUSED`) runs its SwiGLU experts
here (one chunk, one round, no FP8 wire): dispatch stops at the receive buffer and the row of it
each (token, local expert) pair reads (``materialize=False``), so ``expert_x`` is never written;

- the up projection gathers those rows in its prologue and writes ``h = silu(gate) * up``
  (``u``, 2I wide, is never written);
- the down projection multiplies each pair's row by its router weight (the sum of its slots'
  weights, float32) in its epilogue, so combine only sums each token's rows, in its fixed order,
  with unit weights.

The backward (a custom VJP) recomputes ``u`` with the same kernel rather than keeping it (one
GEMM's time against ``C x 2I`` elements of memory; ``keep_u=True`` keeps it instead: the forward
then writes ``u`` and applies SwiGLU in XLA, which ``layer_bench``'s ``cutlass-keep-u`` row
measures against the default); the down projection's ``dlhs`` applies the
router weight and SwiGLU's derivative in its epilogue and yields the router weights' gradient as
``<dy . w_out^T, h>`` (the pairs' unweighted outputs are neither kept nor recomputed,
:func:`ep_comm.collectives.grouped_gemm.dswiglu_dlhs`); then it runs the grouped ``dlhs``/``drhs``
passes (no transposes; ``w_in``'s gradient reads the pairs' rows by the same gather,
:func:`ep_comm.collectives.grouped_gemm.gathered_drhs`) and the gather's transpose as a sum over each
received row's pairs in ``k`` order (deterministic, no atomics). ``kernel="reference"`` runs
the same path with the plain-JAX reference of the fused kernel and ``lax.ragged_dot`` passes:
how the CPU tests check it against the unfused layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ep_comm.collectives import grouped_gemm
from ep_comm.config import EPConfig
from ep_comm.expand import expert_rows_read
from ep_comm.gemm import pass_implementations, pass_kernel, resolve_implementation
from ep_comm.dispatch_combine import combine, dispatch_steps
from ep_comm.routes import drive
from ep_comm.rows import masked_gather_sum
from ep_comm.topology._jax_compat import cotangent_like, match_vma

KERNELS = ("cutlass", "reference")
# moe_layer's implementation for this path: a choice of its own, not "auto"'s, because on an
# H200 each fused kernel (cp.async gather mainloop, one tile per CTA) ran slower than the TMA
# CUTLASS kernel of the same pass (docs/performance.md; the whole layers are not yet timed
# against each other); what it saves is memory
FUSED = "cutlass-fused"
# the forward kernels' tile config (grouped_gemm.FUSED_CONFIGS): 0 copies w's tiles by cp.async,
# 2 by TMA; on an H200, 2 ran slower (docs/performance.md), so 0
FORWARD_CONFIG = 0


def _forward(kernel: str):
    """The fused forward pass: the kernel, or its plain-JAX reference."""
    if kernel == "cutlass":
        return grouped_gemm.fused_forward
    return lambda *a, config=0, zero_tail=True, **kw: grouped_gemm.fused_forward_reference(
        *a, **kw)


def _gathered_drhs(kernel: str):
    """The weight gradient with the rows gathered in the prologue: the kernel, or its
    reference."""
    if kernel == "cutlass":
        return grouped_gemm.gathered_drhs
    return grouped_gemm.gathered_drhs_reference


def _passes(kernel: str):
    impl = "cutlass" if kernel == "cutlass" else "xla"
    return pass_kernel("dlhs", impl), pass_kernel("drhs", impl)


def runs_fused(implementation, config: EPConfig, chunks, dtype, w_in, w_out,
               api: str = "moe_layer") -> bool:
    """Whether :func:`ep_comm.moe_layer` runs its SwiGLU experts ``w_in``, ``w_out`` here: when
    ``implementation`` is :data:`FUSED`. Then it checks that the layer is one chunk
    (``chunks``; ``config`` the chunk's) in one round (dropless) without an FP8 wire, and that
    both GEMMs' operands are what the CUTLASS kernel takes (in ``dtype``, where it runs), and
    raises ``ValueError`` naming what does not fit."""
    if implementation != FUSED:  # (a name, or a dict per pass)
        return False
    where = f"{api}: implementation={FUSED!r}"
    if not config.is_dropless or chunks != 1 or config.wire_format is not None:
        raise ValueError(
            f"{where} runs the layer as one chunk in one round without an FP8 wire "
            f"(num_chunks=1, capacity_factor=None or a recv_capacity of the worst case, "
            f"wire_format=None), got {chunks} chunk(s), expert_rows={config.expert_rows} of "
            f"worst case {config.worst_case_rows}, wire_format={config.wire_format!r}")
    rows = config.expert_rows
    x_like = jax.ShapeDtypeStruct((rows, w_in.shape[1]), dtype)
    h_like = jax.ShapeDtypeStruct((rows, w_out.shape[1]), dtype)
    # (raises for operands the kernel does not take, or where it does not run; the down
    # projection's K = I a multiple of 8 is what the fused SwiGLU epilogue needs too)
    pass_implementations("cutlass", x_like, w_in, api=where)
    pass_implementations("cutlass", h_like, w_out, api=where)
    return True


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def fused_experts(rows, sources, recv_pos, group_sizes, w_in, w_out, pair_w, kernel,
                  keep_u=False, forward_config=FORWARD_CONFIG):
    """``pair_w[r] * (swiglu(rows[sources[r]] @ w_in[g]) @ w_out[g])`` for the pairs ``r`` of
    group ``g`` (``(C, H)``, zero past the groups); ``recv_pos`` ``(R, K)`` (each received row's
    pairs, ``C`` for none) is what the gather's transpose sums over. ``keep_u``: the backward
    reads the up projection's output kept from the forward instead of recomputing it;
    ``forward_config`` the forward kernels' tile config (``grouped_gemm.FUSED_CONFIGS``)."""
    # (without a gradient nothing is kept: u is not written)
    return _fused_fwd(rows, sources, recv_pos, group_sizes, w_in, w_out, pair_w, kernel,
                      False, forward_config)[0]


def _fused_fwd(rows, sources, recv_pos, group_sizes, w_in, w_out, pair_w, kernel, keep_u,
               forward_config=FORWARD_CONFIG):
    # rows past the groups are left unwritten (zero_tail=False) here and in the backward: no
    # later pass reads them (combine and the grouped passes read the groups' rows only)
    fwd = functools.partial(_forward(kernel), zero_tail=False, config=forward_config)
    if keep_u:  # u written and kept; SwiGLU in XLA (float32, rounded to u's dtype)
        u = fwd(rows, w_in, group_sizes, index=sources)
        I = w_out.shape[1]
        h = (jax.nn.silu(u[:, :I].astype(jnp.float32)) * u[:, I:].astype(jnp.float32)).astype(
            u.dtype)
    else:
        u, h = None, fwd(rows, w_in, group_sizes, index=sources, epilogue="swiglu")
    y = match_vma(fwd(h, w_out, group_sizes, epilogue="scale", scale=pair_w), rows)
    return y, (rows, sources, recv_pos, group_sizes, w_in, w_out, pair_w, h, u)


def _fused_bwd(kernel, keep_u, forward_config, res, dy_w):
    rows, sources, recv_pos, group_sizes, w_in, w_out, pair_w, h, u = res
    fwd = functools.partial(_forward(kernel), zero_tail=False, config=forward_config)
    dlhs, drhs = _passes(kernel)
    dt, C = rows.dtype, sources.shape[0]
    grouped = jnp.arange(C) < jnp.sum(group_sizes)
    # dy_w = pair_w * dy (the cotangent of the weighted rows): dh_w = dy_w . w_out^T gives the
    # router weights' gradient as <dh_w, h> (= <dy_w, h . w_out>: the pairs' unweighted outputs
    # are neither kept nor recomputed) and dh = pair_w * dh_w, whose SwiGLU derivative on u
    # (recomputed: gate first, then up) is du; the kernel does all of it in the dlhs epilogue
    if not keep_u:
        u = fwd(rows, w_in, group_sizes, index=sources)
    dy_w = dy_w.astype(dt)
    if kernel == "cutlass":
        du, part = grouped_gemm.dswiglu_dlhs(dy_w, w_out, group_sizes, u, h, pair_w)
        d_pair_w = jnp.where(grouped, jnp.sum(part, 1), 0.0)
    else:
        du, d_pair_w = grouped_gemm.dswiglu_dlhs_reference(dy_w, w_out, group_sizes, u, h,
                                                           pair_w)
    dw_out = drhs((h.astype(jnp.float32) * pair_w[:, None]).astype(dt), dy_w, group_sizes, dt)
    d_expert_x = dlhs(du, w_in, group_sizes, dt)
    # the weight gradient reads the pairs' rows by the same gather (expert_x is not written)
    dw_in = _gathered_drhs(kernel)(rows, du, group_sizes, index=sources)
    # the gather's transpose: each received row sums its pairs' rows (each pair once, k in order)
    first = expert_rows_read(recv_pos, C) < C
    d_rows = masked_gather_sum(d_expert_x, recv_pos, first, out_dtype=dt)
    zeros = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    # typed as the primals (under shard_map the kernels' results carry no varying axes)
    typed = lambda ct, p: cotangent_like(ct.astype(p.dtype), p)  # noqa: E731
    return (typed(d_rows, rows), zeros(sources), zeros(recv_pos), zeros(group_sizes),
            typed(dw_in, w_in), typed(dw_out, w_out), typed(d_pair_w, pair_w))


fused_experts.defvjp(_fused_fwd, _fused_bwd)


def fused_moe(x, topk_ids, topk_weights, config: EPConfig, w_in, w_out, kernel: str = "cutlass",
              keep_u: bool = False, forward_config: int = FORWARD_CONFIG):
    """:func:`ep_comm.moe_layer`'s SwiGLU experts through the fused kernels, for one chunk in one
    round (``config.is_dropless``) with no FP8 wire: returns ``((T, H) y, handle)``. Arguments
    as ``moe_layer``'s, checked there; ``keep_u`` and ``forward_config`` as
    :func:`fused_experts`'s."""
    if kernel not in KERNELS:
        raise ValueError(f"fused_moe: kernel must be one of {KERNELS}, got {kernel!r}")
    if not isinstance(keep_u, bool):
        raise ValueError(f"fused_moe: keep_u must be a bool, got {keep_u!r}")
    if forward_config not in (0, 2):  # (the 256-wide tiles the SwiGLU epilogue needs)
        raise ValueError(f"fused_moe: forward_config must be 0 or 2, got {forward_config!r}")
    if kernel == "cutlass":  # where it runs, and the dtypes it takes (moe_layer's own words)
        resolve_implementation("cutlass", x.dtype, api="moe_layer")
    (rows, sources), handle = drive(dispatch_steps(x, topk_ids, topk_weights, config,
                                                   materialize=False))
    C = config.expert_rows
    # each pair's weight: the sum of the slots that point at it (a token listing one expert
    # twice has one row), float32
    pair_w = jnp.zeros((C,), jnp.float32).at[handle.recv_pos].add(handle.recv_weights,
                                                                   mode="drop")
    y_pairs = fused_experts(rows, sources, handle.recv_pos, handle.group_sizes, w_in, w_out,
                            pair_w, kernel, keep_u, forward_config)
    # combine sums each token's rows, each once, unweighted: the weights are in y_pairs
    first = expert_rows_read(handle.recv_pos, C) < C
    unit = dataclasses.replace(handle, recv_weights=first.astype(jnp.float32))
    return combine(y_pairs, unit), handle
