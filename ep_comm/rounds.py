"""Dropless rounds: the MoE layer in bounded memory.

With the layer's expert buffer below the worst case (``config.recv_capacity``, or by default
``config.capacity_factor`` times the balanced load), one dispatch cannot take every (token,
expert) pair a rank may receive. The layer then runs in rounds: each round every rank receives at
most ``C = config.expert_rows`` pairs, the pairs that did not fit wait for the next round, and the
rounds go on until every pair was served exactly once. Nothing is dropped, and memory is that of
one round.

The schedule is decided from one ``all_gather`` of the ``(n, n)`` matrix of pairs each rank sends
each rank, so every rank computes the same schedule and runs the same number of rounds: in each
round, destination ``d`` takes its remaining pairs from sources in rank order up to ``C``
(``quota[s, d] = clip(C - sum_{s' < s} remaining[s', d], 0, remaining[s, d])``), and source ``s``
sends to ``d`` its next ``quota[s, d]`` pairs in (token, k) order. Every round serves
``min(C, remaining)`` pairs at every destination, so the rounds number exactly
``ceil(max_d load_d / C)``. Pairs that list an expert twice are merged first (weights added), as
dispatch does. :func:`ep_comm.moe_layer` runs the first round (:func:`first_round`) as a step
of its pipeline (:mod:`ep_comm.pipeline`) and only what did not fit in the rounds after it
(:func:`forward`), inside the pipeline's custom VJP.

The rounds' outputs are summed in float32 (each is rounded to ``x.dtype`` first, as the layer's
output is). Differentiation: the forward pass is a ``lax.while_loop`` over rounds; the backward
pass (:func:`backward`) runs the same rounds again, each round's forward recomputed and its VJP
taken, so it also holds one round at a time (the price: one more forward pass of the later rounds
in training). It adds each round's weight gradient to the first round's, so a step whose pairs
all fit the first round pays nothing for the loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ep_comm.config import EPConfig
from ep_comm.layout import repeats_earlier
from ep_comm.routes import exclusive_cumsum, gather_counts
from ep_comm.topology._jax_compat import match_vma


def merge_repeats(ids, weights):
    """Ids with each repeat of an earlier expert of the same token set to -1, and that expert's
    weight the sum over its repeats (``dispatch``'s semantics for a repeated expert)."""
    ids = ids.astype(jnp.int32)
    same = ids[:, :, None] == ids[:, None, :]
    repeat = repeats_earlier(ids)
    merged = jnp.einsum("tkj,tj->tk", (same & ~repeat[:, :, None]).astype(weights.dtype), weights)
    return jnp.where(repeat, -1, ids), jnp.where(repeat, jnp.zeros((), weights.dtype), merged)


def _pair_positions(ids, cfg: EPConfig):
    """Per (token, k): destination rank (``n`` if none), and the pair's position among this rank's
    pairs to that destination in (token, k) order; and the ``(n,)`` pair counts."""
    n, E = cfg.num_ranks, cfg.num_experts
    valid = (ids >= 0) & (ids < E)
    dest = jnp.where(valid, cfg.placement.rank_of(ids), n)
    onehot = (dest.reshape(-1)[:, None] == jnp.arange(n, dtype=jnp.int32)).astype(jnp.int32)
    pos = jnp.cumsum(onehot, axis=0) - onehot  # (T*K, n): pairs to d before this one
    pos = jnp.take_along_axis(pos, jnp.minimum(dest.reshape(-1), n - 1)[:, None], axis=1)
    return dest, pos.reshape(ids.shape), jnp.sum(onehot, axis=0)


def _quota(remaining, capacity):
    """``(n, n)``: pairs source ``s`` sends destination ``d`` this round."""
    return jnp.clip(capacity - exclusive_cumsum(remaining, axis=0), 0, remaining)


class Start(NamedTuple):
    """A piece's rounds after its first: its pairs' destinations and positions (as
    :func:`_pair_positions` gives them), this rank, and the pairs left per ``(source,
    destination)`` and served per destination once the first round is done."""

    dest: jax.Array
    pos: jax.Array
    me: jax.Array
    remaining: jax.Array
    served: jax.Array


def _next_round(ids, start: Start, remaining, served, capacity):
    """This round's ids (the pairs at positions ``[served[d], served[d] + quota[d])`` of each
    destination ``d``, the others -1; ``start`` gives the pairs' destinations and positions and
    this rank) and the remaining counts and served positions after it."""
    n = remaining.shape[0]
    quota = _quota(remaining, capacity)
    mine = quota[start.me]
    d = jnp.minimum(start.dest, n - 1)
    lo = jnp.take(served, d)
    take = (start.dest < n) & (start.pos >= lo) & (start.pos < lo + jnp.take(mine, d))
    return jnp.where(take, ids, -1), remaining - quota, served + mine


def first_round(ids, cfg: EPConfig):
    """``(taken, start)``: ``(T, K)`` bool, the pairs of ``ids`` (repeats merged) that the first
    round serves -- at every destination, up to ``cfg.expert_rows`` of them -- and the
    :class:`Start` of the rounds after it (:func:`forward`, which reuses this schedule: the counts
    are gathered once). The layer runs that round in its pipeline and the rest with
    :func:`forward`."""
    dest, pos, mine = _pair_positions(ids, cfg)
    counts = gather_counts(cfg, mine, "moe_layer (rounds)")  # (n, n): [s, d] pairs s -> d
    start = Start(dest, pos, lax.axis_index(cfg.axis_name), counts, _served0(cfg, counts, ids))
    round_ids, remaining, served = _next_round(ids, start, start.remaining, start.served,
                                               cfg.expert_rows)
    return round_ids >= 0, start._replace(remaining=remaining, served=served)


def forward(one_rounds, cfg: EPConfig, parts, params, starts, sum_pieces=False):
    """The rounds after the first, of one or more pieces (the layer's chunks) in one
    ``lax.while_loop``: ``(ys, rounds)`` -- per piece ``c`` with operands ``parts[c] = (x, ids,
    weights)`` and first round ``starts[c]`` (:func:`first_round` of these ``ids``), the sum over
    its later rounds of ``one_rounds[c](x, round_ids, weights, params)`` (each a layer output over
    that round's pairs, added in float32, the sum in ``x.dtype``) and how many rounds it took.
    ``ids`` must have repeats merged (:func:`merge_repeats`); the pairs the first round served are
    not served again, and pairs with id -1 never (their ``weights`` are never read). ``params``:
    a pytree of arrays. ``sum_pieces``: the pieces' outputs are parts of one sum (the layer's
    chunks of experts, every ``x`` the same tokens): one float32 accumulator for all of them, and
    ``ys`` is that one sum.

    One loop for all pieces: on GPUs XLA reads a loop's predicate on the host, so each loop stalls
    the stream once; a piece with nothing left runs an empty round while another still has
    pairs."""
    def body(state):
        rounds, remaining, served, ys = map(list, state)
        for c, ((x, ids, w), one_round, st) in enumerate(zip(parts, one_rounds, starts)):
            rounds[c] = rounds[c] + (jnp.sum(remaining[c]) > 0).astype(jnp.int32)
            round_ids, remaining[c], served[c] = _next_round(
                ids, st, remaining[c], served[c], cfg.expert_rows)
            at = 0 if sum_pieces else c
            ys[at] = ys[at] + one_round(x, round_ids, w, params).astype(jnp.float32)
        return rounds, remaining, served, ys

    outs = parts[:1] if sum_pieces else parts
    init = ([match_vma(jnp.zeros((), jnp.int32), st.remaining) for st in starts],
            [st.remaining for st in starts], [st.served for st in starts],
            [_zeros_like(x, x, jnp.float32) for x, _, _ in outs])
    rounds, _, _, ys = lax.while_loop(lambda s: _any_left(s[1]), body, init)
    return [y.astype(x.dtype) for y, (x, _, _) in zip(ys, outs)], rounds


def backward(one_rounds, cfg: EPConfig, parts, params, starts, gs, params_grad,
             sum_pieces=False):
    """The VJP of :func:`forward` for the cotangents ``gs`` (one per piece): the same rounds
    again, each round's forward recomputed and its VJP taken, so it too holds one round at a time.
    Returns per piece (one for all with ``sum_pieces``, whose pieces share ``x`` and ``weights``)
    the float32 gradients of its ``x`` and ``weights``, and ``params_grad`` (a pytree like
    ``params``, in any dtype) plus the gradient of ``params``: each round's is added in float32
    and rounded to ``params_grad``'s dtype. The caller passes the gradient it already holds (the
    first round's): when no round follows, the loop costs no pass over the weights' gradient."""
    add = lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)  # noqa

    def body(state):
        remaining, served, grads, dp = state
        remaining, served, grads = list(remaining), list(served), list(grads)
        for c, ((x, ids, w), one_round, st) in enumerate(zip(parts, one_rounds, starts)):
            round_ids, remaining[c], served[c] = _next_round(
                ids, st, remaining[c], served[c], cfg.expert_rows)
            _, vjp = jax.vjp(lambda x, w, p: one_round(x, round_ids, w, p), x, w, params)
            sx, sw, sp = vjp(gs[c].astype(x.dtype))
            at = 0 if sum_pieces else c
            grads[at] = (add(grads[at][0], sx), add(grads[at][1], sw))
            dp = jax.tree.map(add, dp, sp)
        return remaining, served, grads, dp

    init = ([st.remaining for st in starts], [st.served for st in starts],
            [jax.tree.map(lambda a: _zeros_like(a, a, jnp.float32), (x, w))
             for x, _, w in (parts[:1] if sum_pieces else parts)], params_grad)
    _, _, grads, params_grad = lax.while_loop(lambda s: _any_left(s[0]), body, init)
    return grads, params_grad


def _any_left(remaining):
    """Any piece has pairs left."""
    return sum(jnp.sum(r) for r in remaining) > 0


def _zeros_like(a, like, dtype=None):
    return match_vma(jnp.zeros(a.shape, dtype or a.dtype), like)


def _served0(cfg, counts, x):
    """Positions served so far per destination: none. Indexed by this rank in the loop, so typed
    varying over the axis from the start."""
    return match_vma(match_vma(jnp.zeros((cfg.num_ranks,), jnp.int32), counts), x)
