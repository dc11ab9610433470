"""``moe_layer``: the whole expert-parallel MoE FFN in one call -- dispatch, the local experts as
grouped GEMMs, combine -- and the SwiGLU experts it runs by default."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ep_comm.config import EPConfig
from ep_comm.fused import fused_moe, runs_fused
from ep_comm.gemm import grouped_matmul, pass_implementations
from ep_comm.handle import EPHandle
from ep_comm.layout import check_topk_ids
from ep_comm.dispatch_combine import check_float, combine, dispatch
from ep_comm.pipeline import (chunk_config, chunk_operands, chunk_routing, join_chunks,
                              resolve_chunks, run_pipeline)
from ep_comm.rounds import first_round, merge_repeats
from ep_comm.swiglu_gmm import SWIGLU_KERNEL, swiglu, swiglu_grouped_matmul
from ep_comm.topology._jax_compat import match_vma


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
    """What ``moe_layer(..., return_handle=True)`` returns.

    Attributes:
      y: ``(T, H)``, the layer's output (as ``moe_layer`` returns it alone).
      handle: the :class:`EPHandle` of the layer's dispatch (group sizes, drops, traffic) when it
        ran as one exchange: one chunk, with an expert buffer at the worst case (one rank, or
        ``config.capacity_factor=None`` with ``recv_capacity=None``); ``None`` with chunks or
        rounds (the default on several ranks: a buffer of twice the balanced load).
      rounds: ``(1,)`` int32; the pieces of the exchange the layer processed: the sum over its
        chunks of the rounds each took, ``max(1, ceil(max load / recv_capacity))`` (1 with one
        chunk at the worst-case capacity; ``num_chunks`` when every chunk fits one round).
    """

    y: jax.Array
    handle: EPHandle | None
    rounds: jax.Array


def shared_swiglu(x, shared_w_in, shared_w_out):
    """The dense shared SwiGLU expert over the rows of ``x``, in float32: ``swiglu(x @ w_in) @
    w_out`` with ``x @ w_in`` rounded to ``x``'s dtype."""
    u = jnp.dot(x, shared_w_in, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.dot(swiglu(u, shared_w_out.shape[0]), shared_w_out,
                   preferred_element_type=jnp.float32)


def swiglu_experts(expert_x, group_sizes, w_in, w_out, implementation="auto", *,
                   zero_past_groups: bool = True):
    """SwiGLU experts over grouped rows: ``swiglu(x @ w_in[g]) @ w_out[g]`` per group ``g``.

    ``w_in`` is ``(G, H, 2I)`` with the gate projection in its first ``I`` columns and the up
    projection in the last ``I`` (one GEMM for both), ``w_out`` is ``(G, I, H)``.
    ``implementation`` is :func:`ep_comm.grouped_matmul`'s, or ``"megablox-swiglu"``: the up
    projection as one Pallas TPU kernel with SwiGLU in its epilogue (:mod:`ep_comm.swiglu_gmm`),
    the rest on megablox. Rows past the groups: zero, or unspecified with
    ``zero_past_groups=False`` (one pass over the output less: :func:`ep_comm.grouped_matmul`),
    as :func:`moe_layer` runs them (combine reads only the groups' rows)."""
    # u's rows past the groups matter only to a weight-gradient kernel that reads them: tokamax's
    # masks rows by multiplying with zero, so they must be finite there; lax.ragged_dot (XLA:CPU
    # and XLA:GPU write zeros anyway; XLA:TPU's never lets them reach the groups:
    # tools/ragged_dot_probe.py) and the CUTLASS kernels read only the groups' rows, so the
    # zeroing pass is left out for them
    if implementation == SWIGLU_KERNEL:  # the up projection with SwiGLU in its epilogue (TPU)
        h = swiglu_grouped_matmul(expert_x, w_in, group_sizes, "megablox")
        return grouped_matmul(h, w_out, group_sizes, implementation="megablox",
                              zero_past_groups=zero_past_groups)
    h_like = jax.ShapeDtypeStruct((expert_x.shape[0], w_out.shape[1]), expert_x.dtype)
    drhs = pass_implementations(implementation, h_like, w_out, api="swiglu_experts")[2]
    u = grouped_matmul(expert_x, w_in, group_sizes, implementation=implementation,
                       zero_past_groups=drhs == "tokamax")
    return grouped_matmul(swiglu(u, w_out.shape[1]), w_out, group_sizes,
                          implementation=implementation, zero_past_groups=zero_past_groups)


def _check_weight(api, name, a, shape, dtype, what):
    if a.ndim != len(shape) or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{api}: {name} must have shape {what} = {tuple(shape)}, "
                         f"got {tuple(a.shape)}")
    if a.dtype != dtype:
        raise ValueError(f"{api}: {name} must have x's dtype {jnp.dtype(dtype).name}, "
                         f"got {a.dtype}")


def moe_layer(x, topk_ids, topk_weights, config: EPConfig, *, w_in=None, w_out=None,
              experts: Callable | None = None, shared_w_in=None, shared_w_out=None,
              implementation="auto", return_handle: bool = False):
    """The expert-parallel MoE FFN of one rank: ``y[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t])``
    (plus the shared expert's output when given). Dropless in bounded memory: its expert buffer
    holds ``config.recv_capacity`` pairs per rank, by default ``config.capacity_factor`` (2) times
    the balanced load; a routing that sends a rank more runs in rounds of at most that many pairs
    per rank (:mod:`ep_comm.rounds`).
    With ``config.num_chunks`` above 1 the layer runs as a pipeline of chunks (of tokens, or of
    each rank's experts: ``config.chunk_by``) whose exchanges overlap the experts of their
    neighbours (:mod:`ep_comm.pipeline`); ``recv_capacity`` is then the expert buffer of one
    chunk. In rounds, each chunk's first round runs in the pipeline and the pairs that did not
    fit in rounds after it, chunk by chunk.

    Call inside ``jax.shard_map`` over ``config.axis_name``; expert weights are sharded over that
    axis (this rank holds experts ``[r * E_local, (r + 1) * E_local)``, ``E_local =
    config.experts_per_rank``). Differentiable in ``x``, ``topk_weights`` and every weight.

    Args:
      x: ``(T, H)`` floating, ``T = config.tokens_per_rank``.
      topk_ids: ``(T, topk)`` integer expert ids, ``-1`` for none (see :func:`ep_comm.dispatch`).
      topk_weights: ``(T, topk)`` floating router weights.
      config: :class:`EPConfig`.
      w_in: ``(E_local, H, 2 * I)`` in ``x.dtype``: this rank's SwiGLU input projections, gate
        in the first ``I`` columns, up in the last ``I``.
      w_out: ``(E_local, I, H)`` in ``x.dtype``: the output projections.
      experts: instead of ``w_in``/``w_out``, a function ``(expert_x, group_sizes) -> expert_y``
        (``(config.expert_rows, H)`` each; rows grouped by local expert as ``group_sizes`` says).
        :func:`ep_comm.grouped_matmul` is the GEMM to build it from.
      shared_w_in, shared_w_out: optional shared expert (``(H, 2 * I_s)`` and ``(I_s, H)``,
        SwiGLU, applied densely to every token and added).
      implementation: :func:`ep_comm.grouped_matmul`'s choice for the SwiGLU experts (a name
        or a dict per pass), or ``"cutlass-fused"``: the experts fused with the exchange
        (:mod:`ep_comm.fused`: the up projection gathers the received rows and applies SwiGLU,
        the down projection the router weights, so ``expert_x`` and ``u`` are never written),
        for one chunk in one round without an FP8 wire on Hopper; less memory, but on an H200
        its kernels ran slower than ``"cutlass"`` per pass, which is what ``"auto"`` runs there.
        On TPU, ``"megablox-swiglu"``: the up projection's forward as one Pallas kernel with
        SwiGLU in its epilogue (``u`` never written), megablox for the other passes
        (:mod:`ep_comm.swiglu_gmm`).
      return_handle: also return dispatch's handle (a :class:`MoEOutput`).

    Returns:
      ``(T, H)`` in ``x.dtype`` (or :class:`MoEOutput` with ``return_handle=True``).
    """
    api = "moe_layer"
    x = jnp.asarray(x)
    if not isinstance(config, EPConfig):
        raise TypeError(f"{api}: config must be an ep_comm.EPConfig, got {type(config).__name__}")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (tokens_per_rank, hidden), "
                         f"got {x.dtype} {tuple(x.shape)}")
    H, L = x.shape[1], config.experts_per_rank
    if experts is None:
        if w_in is None or w_out is None:
            raise ValueError(f"{api}: pass the SwiGLU weights w_in and w_out, or experts=; "
                             f"got w_in={'set' if w_in is not None else None}, "
                             f"w_out={'set' if w_out is not None else None}")
        w_in, w_out = jnp.asarray(w_in), jnp.asarray(w_out)
        if w_in.ndim != 3 or w_in.shape[2] % 2:
            raise ValueError(f"{api}: w_in must have shape (experts_per_rank, hidden, "
                             f"2 * intermediate), got {tuple(w_in.shape)}")
        inter = w_in.shape[2] // 2
        if (w_out.ndim == 3 and w_in.shape[1] == w_out.shape[2] != H
                and w_out.shape[:2] == (L, inter)):  # the weights agree on hidden: x is off
            raise ValueError(f"{api}: x must have shape (tokens_per_rank, hidden) = "
                             f"({config.tokens_per_rank}, {w_in.shape[1]}) (hidden as w_in and "
                             f"w_out have it), got {tuple(x.shape)}")
        _check_weight(api, "w_in", w_in, (L, H, 2 * inter), x.dtype,
                      "(experts_per_rank = num_experts / num_ranks, hidden, 2 * intermediate)")
        _check_weight(api, "w_out", w_out, (L, inter, H), x.dtype,
                      "(experts_per_rank, intermediate, hidden)")
        params = (w_in, w_out)
        # combine reads only the groups' rows: expert_y's tail needs no zeroing pass
        run_experts = lambda ex, gs, p: swiglu_experts(ex, gs, *p, implementation,  # noqa
                                                       zero_past_groups=False)
    else:
        if w_in is not None or w_out is not None:
            raise ValueError(f"{api}: pass either experts= or the SwiGLU weights w_in/w_out, "
                             f"not both")
        if not callable(experts):
            raise TypeError(f"{api}: experts must be a function (expert_x, group_sizes) -> "
                            f"expert_y, got {type(experts).__name__}")
        params = ()
        run_experts = lambda ex, gs, p: experts(ex, gs)
    shared = (shared_w_in is not None, shared_w_out is not None)
    if any(shared) and not all(shared):
        raise ValueError(f"{api}: the shared expert needs both shared_w_in and shared_w_out")
    if all(shared):
        shared_w_in, shared_w_out = jnp.asarray(shared_w_in), jnp.asarray(shared_w_out)
        if shared_w_in.ndim != 2 or shared_w_in.shape[1] % 2:
            raise ValueError(f"{api}: shared_w_in must have shape (hidden, 2 * intermediate), "
                             f"got {tuple(shared_w_in.shape)}")
        s_inter = shared_w_in.shape[1] // 2
        _check_weight(api, "shared_w_in", shared_w_in, (H, 2 * s_inter), x.dtype,
                      "(hidden, 2 * intermediate)")
        _check_weight(api, "shared_w_out", shared_w_out, (s_inter, H), x.dtype,
                      "(intermediate, hidden)")

    chunks = resolve_chunks(config, H, x.dtype,
                            None if experts is not None else 6.0 * H * inter,
                            0.0 if experts is not None else (w_in.size + w_out.size)
                            * x.dtype.itemsize, api=api)
    one = chunk_config(config, chunks)  # one chunk's exchange (the whole layer's at 1 chunk)

    def checked(expert_x, group_sizes, params):
        expert_y = run_experts(expert_x, group_sizes, params)
        if tuple(getattr(expert_y, "shape", ())) != tuple(expert_x.shape):
            raise ValueError(f"{api}: experts must return expert_y of shape (expert_rows, hidden) "
                             f"= {tuple(expert_x.shape)}, got "
                             f"{tuple(getattr(expert_y, 'shape', ()))}")
        return expert_y

    shared_y = None  # the shared expert's output (float32), where the pipeline computed it
    if experts is None and runs_fused(implementation, one, chunks, x.dtype, w_in, w_out):
        # the fused path: the GEMMs read the exchange's buffer, SwiGLU and the router weights in
        # their epilogues (ep_comm.fused)
        y, handle = fused_moe(x, topk_ids, topk_weights, one, w_in, w_out, kernel="cutlass")
        rounds = jnp.ones((1,), jnp.int32)
    elif one.is_dropless and chunks == 1:  # one round holds every pair any routing can send
        expert_x, handle = dispatch(x, topk_ids, topk_weights, one)
        y = combine(checked(expert_x, handle.group_sizes, params), handle)
        rounds = jnp.ones((1,), jnp.int32)
    else:
        handle = None
        topk_ids = check_topk_ids(api, topk_ids, config.tokens_per_rank, config.topk)
        topk_weights = jnp.asarray(topk_weights)
        check_float(api, "topk_weights", topk_weights, topk_ids.shape)
        if experts is not None:
            # the experts' closed-over arrays become explicit parameters: the custom VJPs of the
            # pipeline and the rounds differentiate them (examples typed like expert_x and
            # group_sizes: varying as x)
            converted, params = jax.closure_convert(
                experts, match_vma(jnp.zeros((one.expert_rows, H), x.dtype), x),
                match_vma(jnp.zeros((L,), jnp.int32), x))
            run_experts = lambda ex, gs, p: converted(ex, gs, *p)
        first, rest = topk_ids, None
        if not one.is_dropless:
            # dropless rounds: each chunk's first round (at most one.expert_rows pairs per rank)
            # runs in the pipeline; what did not fit, in rounds after it, chunk by chunk
            ids, topk_weights = merge_repeats(topk_ids, topk_weights)
            parts = chunk_operands(config, chunks, x, ids, topk_weights)
            starts = [first_round(chunk_routing(config, chunks, c, i, w)[0], one)
                      for c, (_, i, w) in enumerate(parts)]
            taken = join_chunks(config, [t.astype(jnp.int32) for t, _ in starts]) > 0
            valid = (ids >= 0) & (ids < config.num_experts)
            # (an id out of range goes to dispatch, which counts it or raises, as without rounds)
            first = jnp.where(taken | ~valid, ids, -1)
            rest = (ids, [s for _, s in starts])
        # the pipeline of chunks, the shared expert in it under the end exchanges (one chunk,
        # in rounds, is the serial layer's first round: the shared expert after it), then the
        # rounds for what did not fit
        in_pipeline = all(shared) and chunks > 1
        y, shared_y, rounds = run_pipeline(
            checked, config, chunks, x, first, topk_weights, params,
            (lambda rows, p: shared_swiglu(rows, *p)) if in_pipeline else None,
            (shared_w_in, shared_w_out) if in_pipeline else (), rest=rest)
    if all(shared) and shared_y is None:
        shared_y = shared_swiglu(x, shared_w_in, shared_w_out)
    if shared_y is not None:
        y = y.astype(jnp.float32) + shared_y
    y = y.astype(x.dtype)
    return MoEOutput(y, handle, rounds) if return_handle else y
