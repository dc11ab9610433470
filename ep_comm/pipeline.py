"""The MoE layer as a pipeline of chunks (``EPConfig.num_chunks``, ``EPConfig.chunk_by``).

The layer's work is split into ``C`` chunks, each a whole dispatch, experts and combine of its own
(:func:`chunk_config`):

- ``chunk_by="tokens"``: chunk ``c`` is tokens ``[c T / C, (c + 1) T / C)`` with all their
  experts. Every chunk's GEMMs read all of the rank's expert weights again.
- ``chunk_by="experts"``: chunk ``c`` is every token's pairs with local experts ``[c L / C, (c +
  1) L / C)`` of each rank (:func:`chunk_routing`), an exchange of ``num_experts / C`` experts.
  Each expert's GEMM runs once over all its rows (the weights are read once); a token with
  experts in several chunks on one rank is sent once per chunk, and the chunks' outputs are
  added in float32 (:func:`join_chunks`).

They are issued so that the exchanges of one chunk run while the experts of another compute::

    dispatch 0
    step c = 0 .. C-1:   start dispatch c+1, start combine c-1 | experts c | finish both
    combine C-1

Dispatch and combine are step generators (:func:`ep_comm.routes.drive`): everything up to an
exchange runs when a chunk is started, the exchange is issued
(:func:`ep_comm.ragged.ragged_all_to_all_start`: on the nccl transport it runs on the engine's
own CUDA stream until its done) and the rest runs when the chunk is finished. Optimization
barriers pin the order XLA may not change (XLA:GPU schedules before it removes them; XLA:CPU
removes them first, which on CPU only changes the order of work that does not overlap anyway): the
experts of chunk ``c`` take, through a barrier, the started exchanges' buffers (so they are issued
after the starts), the dones take the experts' output (so they wait behind the experts), and the
starts take chunk ``c``'s expanded rows (so they start right before its experts, not under the
non-GEMM work before them). The other transports complete an exchange at its start: the schedule
is the same, without concurrency, and so are the results.

The first chunk's dispatch and the last chunk's combine have no experts to hide under: ``(C - 1)
/ C`` of the exchange time can hide under the experts. Dense work on the tokens that does not need
the exchange (the layer's shared expert: ``side``) runs in two halves under those two. The
hierarchical plan's second stage runs when its chunk is finished (after its first stage), so
only its first stage overlaps.

Results equal the unchunked layer's. Token chunks: every token's rows go through the same experts
and its combine sums the same terms in the same order (a GEMM's rows do not depend on the other
rows of its group, up to the kernel's choice of tiling). Expert chunks: each chunk sums a part of
a token's terms, and the parts add in float32 (reassociation; in a 16-bit combine dtype, each
part is rounded once, as each rank's partial sum is without chunks).

Differentiation: a custom VJP. The forward keeps each chunk's expert VJP (the GEMMs' residuals,
as plain autodiff does), its ``expert_y`` and its handle; the backward pass runs, chunk by chunk,
the VJP of combine, of the experts and of dispatch (dispatch's and combine's forward are traced
again for their VJPs: one more pair of exchanges per chunk; the GEMMs are not recomputed). The
backward pass is not pipelined.

Rounds (:mod:`ep_comm.rounds`): with an expert buffer below a chunk's worst case, the pipeline
runs each chunk's first round, and the pairs that did not fit (``rest``) run after it, every
chunk's in one ``lax.while_loop`` of rounds -- inside the same custom VJP, so that the backward pass
adds the later rounds' weight gradients to the first round's (no pass over the weights'
gradients when nothing was left over). The rounds reuse the first round's schedule (one gather of
the counts per chunk), and chunks of experts, whose outputs are parts of one sum, share one
float32 accumulator (of the output in the forward, of the gradients in the backward).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ep_comm import topology
from ep_comm import plan as plans
from ep_comm import rounds
from ep_comm.config import EPConfig
from ep_comm.dispatch_combine import combine, combine_steps, dispatch, dispatch_steps
from ep_comm.ragged import ragged_all_to_all_done
from ep_comm.routes import is_local

MAX_AUTO_CHUNKS = 16


def chunk_config(cfg: EPConfig, chunks: int) -> EPConfig:
    """The configuration of one of ``chunks`` chunks (``cfg.chunk_by``): its ``recv_capacity``
    is ``cfg.recv_capacity``, or with ``None`` ``ceil(capacity_factor * T * topk / chunks)`` (the
    balanced load's multiple, :class:`EPConfig`), or ``None`` where that is not below the
    chunk's worst case.

    ``"tokens"``: ``tokens_per_rank / chunks`` tokens. ``"experts"``: every token, over
    ``num_experts / chunks`` experts (each rank's ``experts_per_rank / chunks`` experts of the
    chunk, numbered as :func:`chunk_routing` renumbers them)."""
    if cfg.chunk_by == "experts":
        one = dataclasses.replace(cfg, num_experts=cfg.num_experts // chunks, recv_capacity=None,
                                  num_chunks=1, chunk_by="tokens")
    else:
        one = dataclasses.replace(cfg, tokens_per_rank=cfg.tokens_per_rank // chunks,
                                  recv_capacity=None, num_chunks=1)
    capacity = cfg.recv_capacity
    if capacity is None and cfg.capacity_factor is not None:
        capacity = math.ceil(cfg.capacity_factor * cfg.tokens_per_rank * cfg.topk / chunks)
    if capacity is not None and capacity < one.worst_case_rows:
        one = dataclasses.replace(one, recv_capacity=capacity)
    return one


def chunk_operands(cfg: EPConfig, chunks: int, x, ids, weights) -> list[tuple]:
    """Per chunk, the ``(x, ids, weights)`` it starts from: a slice of the tokens
    (``"tokens"``), or all of them (``"experts"``: :func:`chunk_routing` picks the pairs)."""
    if cfg.chunk_by == "experts":
        return [(x, ids, weights)] * chunks
    return list(zip(*(_split(a, chunks) for a in (x, ids, weights))))


def chunk_routing(cfg: EPConfig, chunks: int, c: int, ids, weights):
    """Chunk ``c``'s ids and weights (as :func:`ep_comm.dispatch` takes them, for
    :func:`chunk_config`'s configuration) from its operands. ``"tokens"``: unchanged.
    ``"experts"``: the pairs whose expert is local expert ``l`` of rank ``r`` with ``l // Lc ==
    c`` (``Lc = experts_per_rank / chunks``), renumbered ``r * Lc + l % Lc``; the other pairs
    get id -1 and weight 0. An id out of range (neither -1 nor an expert) stays out of range in
    chunk 0 only, where dispatch counts it (or raises) as it would unchunked."""
    if cfg.chunk_by != "experts":
        return ids, weights
    L, E = cfg.experts_per_rank, cfg.num_experts
    Lc = L // chunks
    ids = ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < E)
    local = jnp.where(valid, ids, 0) % L
    keep = valid & (local // Lc == c)
    other = jnp.full_like(ids, -1)
    if c == 0:  # out of range: kept out of range (ids >= E become the chunk's E / chunks)
        other = jnp.where(valid | (ids == -1), -1, jnp.where(ids < 0, ids, E // chunks))
    return (jnp.where(keep, (ids // L) * Lc + local % Lc, other),
            jnp.where(keep, weights, jnp.zeros((), weights.dtype)))


def chunk_group_sizes(cfg: EPConfig, chunks: int, c: int, group_sizes):
    """Chunk ``c``'s group sizes as the experts take them: ``(experts_per_rank,)``, zero for the
    local experts of other chunks (``"experts"``; so the GEMMs take every local expert's
    weights and read only the chunk's)."""
    if cfg.chunk_by != "experts":
        return group_sizes
    Lc = group_sizes.shape[0]
    return jnp.pad(group_sizes, (c * Lc, (chunks - c - 1) * Lc))


def join_chunks(cfg: EPConfig, parts: list):
    """The chunks' ``(T, ...)`` results as one: concatenated (``"tokens"``), or summed in
    float32 (``"experts"``: every chunk holds a part of every token's sum), in the first part's
    dtype."""
    if cfg.chunk_by != "experts":
        return jnp.concatenate(parts)
    total = parts[0].astype(jnp.float32)
    for p in parts[1:]:
        total = total + p.astype(jnp.float32)
    return total.astype(parts[0].dtype)


def chunk_counts(cfg: EPConfig) -> list[int]:
    """The chunk counts ``cfg.chunk_by`` allows, up to :data:`MAX_AUTO_CHUNKS`."""
    if cfg.chunk_by == "experts":
        return [c for c in range(1, min(cfg.experts_per_rank, MAX_AUTO_CHUNKS) + 1)
                if cfg.experts_per_rank % c == 0 and cfg.num_experts // c >= cfg.topk]
    return [c for c in range(1, min(cfg.tokens_per_rank, MAX_AUTO_CHUNKS) + 1)
            if cfg.tokens_per_rank % c == 0]


def resolve_chunks(cfg: EPConfig, hidden: int, dtype, flops_per_row: float | None,
                   weight_bytes: float = 0.0, api: str = "moe_layer") -> int:
    """``cfg.num_chunks``, with ``"auto"`` resolved by the cost model: the chunk count (of
    :func:`chunk_counts`) with the smallest :meth:`ep_comm.topology.CostModel.pipeline_seconds` for
    balanced routing. ``flops_per_row``: expert FLOPs per (token, expert) row (``None``:
    unknown, which ``"auto"`` cannot work with); ``weight_bytes``: this rank's expert weights
    (every token chunk's GEMMs read all of them; an expert chunk's read its share). An expert
    chunk's exchange is predicted as ``ceil(topk / chunks)`` experts per token."""
    if cfg.num_chunks != "auto":
        return cfg.num_chunks
    if flops_per_row is None:
        raise ValueError(f"{api}: num_chunks='auto' estimates the experts' time from the SwiGLU "
                         f"weights w_in/w_out; with experts= give num_chunks as an int")
    model = cfg.cost_model or topology.CostModel()
    T, K, L = cfg.tokens_per_rank, cfg.topk, cfg.experts_per_rank
    by_experts = cfg.chunk_by == "experts"
    best, best_s = 1, None
    for c in chunk_counts(cfg):
        one = chunk_config(cfg, c)
        if by_experts:  # each token's pairs spread over the chunks
            one = dataclasses.replace(one, topk=-(-K // c))
        kind = plans.resolve_plan(one, hidden, dtype, api).kind
        if is_local(one, kind):
            ex = 0.0
        else:
            topo = plans.machine(one, api, need=kind != "flat") or topology.simulated(
                1, cfg.num_ranks)
            ex = plans.predict(one, topo, hidden, dtype)[kind]["total"]
        rows = T * K / c  # (token, expert) rows per rank per chunk, balanced
        s = model.pipeline_seconds(c, ex, rows * flops_per_row,
                                   T * K / L if by_experts else rows / L,
                                   weight_bytes / c if by_experts else weight_bytes)
        if best_s is None or s < best_s * (1 - 1e-9):
            best, best_s = c, s
    return best


class _Chunk:
    """One step generator (a chunk's dispatch or combine) under the pipeline: its next exchanges
    started, later finished (the rest of the generator then runs at once)."""

    _NOT_YET = object()

    def __init__(self, steps, scope: str):
        self.steps, self.scope = steps, scope
        self.pending = ()
        self.value = self._NOT_YET

    def start(self, after=None):
        with jax.named_scope(self.scope):
            try:
                requests = next(self.steps)
            except StopIteration as stop:  # nothing to exchange (one rank, local route)
                self.value = stop.value
                return
            if after is not None:  # issued after `after` is computed
                requests = [dataclasses.replace(r, operand=_after(r.operand, after))
                            for r in requests]
            self.pending = tuple(r.start() for r in requests)

    def in_flight(self) -> tuple:
        """The started exchanges' buffers: work tied to them is issued after the starts."""
        return tuple(p.result for p in self.pending)

    def finish(self, after=None):
        with jax.named_scope(self.scope):
            if self.value is not self._NOT_YET:
                return self.value
            results = []
            for p in self.pending:
                if after is not None:  # the done waits behind `after`
                    result, workspace = _after((p.result, p.workspace), after)
                    p = dataclasses.replace(p, result=result, workspace=workspace)
                results.append(ragged_all_to_all_done(p))
            try:
                requests = self.steps.send(tuple(results))
                while True:
                    requests = self.steps.send(tuple(r.run() for r in requests))
            except StopIteration as stop:
                return stop.value


def _after(value, after):
    """``value``, ordered after ``after`` in XLA's schedule (an optimization barrier)."""
    return lax.optimization_barrier((value, after))[0]


def run_pipeline(run_experts, cfg: EPConfig, chunks: int, x, ids, weights, params,
                 side=None, side_params=(), rest=None):
    """``(y, side_y, rounds)``: the routed experts' output ``(T, H)`` over ``chunks`` pipelined
    chunks, the output of ``side`` (float32 ``(T, H)``, or ``None`` without it), and the pieces
    processed (``(1,)`` int32). ``run_experts(expert_x, group_sizes, params)`` -> ``expert_y``;
    it may not close over traced values (``params`` is its differentiable pytree of arrays).
    ``ids``/``weights`` as :func:`ep_comm.dispatch` takes them. ``side(x_rows, side_params)`` ->
    float32 rows: dense work on the tokens (the shared expert), run in two halves of the tokens
    under the two exchanges nothing else hides, the first chunk's dispatch and the last chunk's
    combine. ``rest``: ``(all_ids, starts)`` for dropless rounds (:mod:`ep_comm.rounds`): the
    ``(T, K)`` ids of every pair (repeats merged; ``ids`` is the part of them the chunks' first
    round takes) and per chunk the :class:`ep_comm.rounds.Start` of its later rounds
    (:func:`ep_comm.rounds.first_round` of its chunk-routed ``all_ids``). What the first rounds
    did not take is served after the pipeline, every chunk's in one loop; its outputs are added to
    ``y``."""
    return _pipeline(run_experts, side, cfg, chunks, x, ids, weights, params, side_params, rest)


def _split(a, chunks):
    return a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])


def _halves(a):
    return a[:a.shape[0] // 2], a[a.shape[0] // 2:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _pipeline(run_experts, side, cfg, chunks, x, ids, weights, params, side_params, rest):
    return _forward(run_experts, side, cfg, chunks, x, ids, weights, params, side_params, rest,
                    keep=False)[0]


def _round_fns(run_experts, cfg, chunks):
    """Per chunk ``c``, its layer over the pairs of ``ids`` (chunk-routed): one dispatch, its
    experts, one combine (a round of :mod:`ep_comm.rounds`)."""
    def one_round(c):
        def layer(x, ids, weights, params):
            expert_x, handle = dispatch(x, ids, weights, chunk_config(cfg, chunks))
            gs = chunk_group_sizes(cfg, chunks, c, handle.group_sizes)
            return combine(run_experts(expert_x, gs, params), handle)
        return layer
    return [one_round(c) for c in range(chunks)]


def _rest_parts(cfg, chunks, x, rest, weights):
    """Per chunk: its rounds' operands ``(x, ids, weights)``, the ids (``rest``'s, every pair of
    the layer) chunk-routed (the weights of the pairs a chunk does not serve are never read: their
    ids are -1)."""
    ids, _ = rest
    return [(x_c, chunk_routing(cfg, chunks, c, i_c, w_c)[0], w_c)
            for c, (x_c, i_c, w_c) in enumerate(chunk_operands(cfg, chunks, x, ids, weights))]


def _side_half(side, x, half, side_params, after, keep):
    """``side`` over token half ``half`` of ``x``, issued after ``after`` (the exchange it runs
    under), with its VJP when ``keep``."""
    rows = _halves(x)[half]
    if after:
        rows = _after(rows, after)
    with jax.named_scope(f"ep_comm_side{half}"):
        if keep:
            return jax.vjp(lambda r, p: side(r, p), rows, side_params)
        return side(rows, side_params), None


def _dispatch_chunk(cfg, chunks, c, operands, steps=False):
    x, ids, weights = operands
    ids, weights = chunk_routing(cfg, chunks, c, ids, weights)
    return (dispatch_steps if steps else dispatch)(x, ids, weights, chunk_config(cfg, chunks))


def _forward(run_experts, side, cfg, chunks, x, ids, weights, params, side_params, rest,
             keep):
    operands = chunk_operands(cfg, chunks, x, ids, weights)
    disp = [_Chunk(_dispatch_chunk(cfg, chunks, c, operands[c], steps=True),
                   f"ep_comm_chunk{c}/dispatch") for c in range(chunks)]
    sides = []
    disp[0].start()
    if side is not None:  # under the first dispatch
        sides.append(_side_half(side, x, 0, side_params, disp[0].in_flight(), keep))
    ready = disp[0].finish(after=sides[0][0] if sides else None)
    ys, saved = [None] * chunks, []
    comb = None
    for c in range(chunks):
        nxt = disp[c + 1] if c + 1 < chunks else None
        expert_x, handle = ready
        # both exchanges start once this chunk's rows are in place, right before its experts
        if nxt is not None:
            nxt.start(after=expert_x)
        if comb is not None:
            comb.start(after=expert_x)
        flying = (nxt.in_flight() if nxt else ()) + (comb.in_flight() if comb else ())
        if flying:
            expert_x = _after(expert_x, flying)
        gs = chunk_group_sizes(cfg, chunks, c, handle.group_sizes)
        with jax.named_scope(f"ep_comm_chunk{c}/experts"):
            if keep:
                expert_y, vjp = jax.vjp(lambda e, p, gs=gs: run_experts(e, gs, p), expert_x,
                                        params)
            else:
                expert_y, vjp = run_experts(expert_x, gs, params), None
        if nxt is not None:
            ready = nxt.finish(after=expert_y)
        if comb is not None:
            ys[c - 1] = comb.finish(after=expert_y)
        comb = _Chunk(combine_steps(expert_y, handle), f"ep_comm_chunk{c}/combine")
        saved.append((expert_y, handle, vjp))
    comb.start()
    if side is not None:  # under the last combine
        sides.append(_side_half(side, x, 1, side_params, comb.in_flight(), keep))
    ys[chunks - 1] = comb.finish(after=sides[1][0] if sides else None)
    side_y = jnp.concatenate([s[0] for s in sides]) if sides else None
    y = join_chunks(cfg, ys)
    pieces = jnp.full((1,), chunks, jnp.int32)
    if rest is not None:  # every chunk's later rounds, in one loop
        with jax.named_scope("ep_comm_rounds"):
            ys, taken = rounds.forward(_round_fns(run_experts, cfg, chunks),
                                       chunk_config(cfg, chunks),
                                       _rest_parts(cfg, chunks, x, rest, weights), params,
                                       rest[1], sum_pieces=cfg.chunk_by == "experts")
        pieces = pieces + sum(taken)
        # the first round's output and the later rounds' add in float32, each rounded to x's
        # dtype (as the rounds add theirs)
        y = (y.astype(jnp.float32) + join_chunks(cfg, ys).astype(jnp.float32)).astype(y.dtype)
    return (y, side_y, pieces), (saved, [s[1] for s in sides])


def _pipeline_fwd(run_experts, side, cfg, chunks, x, ids, weights, params, side_params, rest):
    out, saved = _forward(run_experts, side, cfg, chunks, x, ids, weights, params, side_params,
                          rest, keep=True)
    return out, (x, ids, weights, params, side_params, rest, saved)


def _pipeline_bwd(run_experts, side, cfg, chunks, res, cts):
    x, ids, weights, params, side_params, rest, (saved, side_vjps) = res
    g, g_side, _ = cts
    f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731
    cast_like = lambda d, like: jax.tree.map(lambda a, b: a.astype(b.dtype), d, like)  # noqa
    d_x_side, d_side_params = None, side_params  # (side_params is () without a side)
    if side is not None:
        halves = [vjp(part) for vjp, part in zip(side_vjps, _halves(g_side))]
        d_x_side = jnp.concatenate([h[0] for h in halves]).astype(jnp.float32)
        d_side_params = cast_like(jax.tree.map(jnp.add, f32(halves[0][1]), f32(halves[1][1])),
                                  side_params)
    operands = chunk_operands(cfg, chunks, x, ids, weights)
    g_parts = [o[0] for o in chunk_operands(cfg, chunks, g, ids, weights)]
    dxs, dws, dparams = [], [], None
    for c, (expert_y, handle, vjp) in enumerate(saved):
        d_y, d_handle = jax.vjp(combine, expert_y, handle)[1](g_parts[c].astype(expert_y.dtype))
        d_x_experts, d_p = vjp(d_y)
        a, i, w = operands[c]
        _, dispatch_vjp = jax.vjp(
            lambda a, w, c=c, i=i: _dispatch_chunk(cfg, chunks, c, (a, i, w)), a, w)
        d_x, d_w = dispatch_vjp((d_x_experts, d_handle))
        dxs.append(d_x.astype(jnp.float32))
        dws.append(d_w.astype(jnp.float32))
        dparams = f32(d_p) if dparams is None else jax.tree.map(jnp.add, dparams, f32(d_p))
    dparams = cast_like(dparams, params)
    if rest is not None:  # the later rounds, their weight gradients added to the first's
        grads, dparams = rounds.backward(
            _round_fns(run_experts, cfg, chunks), chunk_config(cfg, chunks),
            _rest_parts(cfg, chunks, x, rest, weights), params, rest[1], g_parts, dparams,
            sum_pieces=cfg.chunk_by == "experts")
        for c, (d_x_c, d_w_c) in enumerate(grads):
            dxs[c], dws[c] = dxs[c] + d_x_c, dws[c] + d_w_c
    d_x = join_chunks(cfg, dxs)
    if d_x_side is not None:
        d_x = d_x + d_x_side
    float0 = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)  # noqa
    return (d_x.astype(x.dtype), float0(ids), join_chunks(cfg, dws).astype(weights.dtype),
            dparams, d_side_params, jax.tree.map(float0, rest))


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


# --- checking the schedule -----------------------------------------------------------------------

_SCOPE = re.compile(r'op_name="[^"]*ep_comm_chunk(\d+)/(dispatch|experts|combine)')
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
# a matrix product: a GEMM library call or kernel, or an op traced from a dot
_GEMM = re.compile(r'custom_call_target="[^"]*(mosaic|cublas|gemm|matmul)|gemm_fusion|'
                   r'op_name="[^"]*/(dot_general|ragged_dot[^"/]*|pallas_call)"')


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    comps, name, entry = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps, entry


def schedule_order(hlo_text: str) -> list[tuple[int, str, str]]:
    """The chunk work of a compiled (scheduled) module in execution order: ``(chunk, part,
    kind)`` for each instruction of the entry computation (and of the computations it ``call``s,
    such as command buffers) that :func:`run_pipeline` scoped: ``part`` ``dispatch``, ``experts``
    or ``combine``; ``kind`` ``start`` / ``done`` (the engine's exchange custom calls), ``a2a``
    (an XLA all-to-all: a transport that completes at start), ``gemm`` (a matrix product) or
    ``op``."""
    comps, entry = _computations(hlo_text)
    out = []

    def walk(name, depth=0):
        for line in comps.get(name, ()):
            called = _CALLED.search(line)
            if " call(" in line and called and depth < 4:
                walk(called.group(1), depth + 1)
                continue
            m = _SCOPE.search(line)
            if m is None:
                continue
            kind = ("start" if "ep_comm_nccl_start" in line else
                    "done" if "ep_comm_nccl_done" in line else
                    "a2a" if "all-to-all" in line else
                    "gemm" if _GEMM.search(line) else "op")
            out.append((int(m.group(1)), m.group(2), kind))
    walk(entry)
    return out


def check_schedule(order: list[tuple[int, str, str]], chunks: int) -> list[str]:
    """What in ``order`` (:func:`schedule_order`) breaks the pipeline: for every step ``c``, the
    exchanges of dispatch ``c + 1`` and combine ``c - 1`` must be issued (``start``; ``a2a`` on
    transports that finish at start) before the first GEMM of experts ``c``, and (``done``) not
    finished before its last GEMM (its other ops when it has no GEMM: ops that do not read the
    exchanged rows, such as group-size bookkeeping, may run anywhere). Empty when the schedule
    is the pipeline's."""
    where = {}
    for i, key in enumerate(order):
        where.setdefault(key, []).append(i)
    problems = []
    for c in range(chunks):
        ops = where.get((c, "experts", "gemm")) or where.get((c, "experts", "op"))
        if not ops:
            problems.append(f"chunk {c}: no expert ops in the schedule")
            continue
        for other, part in ((c + 1, "dispatch"), (c - 1, "combine")):
            if not 0 <= other < chunks:
                continue
            issued = where.get((other, part, "start")) or where.get((other, part, "a2a"))
            if not issued:
                problems.append(f"{part} of chunk {other}: no exchange in the schedule")
                continue
            if max(issued) > min(ops):
                problems.append(f"{part} of chunk {other} is issued after experts of chunk {c} "
                                f"begin")
            done = where.get((other, part, "done"), [])
            if done and min(done) < max(ops):
                problems.append(f"{part} of chunk {other} is finished before experts of chunk {c} "
                                f"end")
    return problems


def order_summary(order: list[tuple[int, str, str]]) -> str:
    """:func:`schedule_order` in short: ``D1s`` (dispatch of chunk 1 started), ``D1d`` (done),
    ``D1x`` (an XLA all-to-all), ``E0`` (a run of chunk 0's expert ops); other ops left out."""
    out = []
    for c, part, kind in order:
        if kind in ("op", "gemm") and part != "experts":
            continue
        tok = (f"E{c}" if kind in ("op", "gemm") else
               f"{part[0].upper()}{c}{dict(start='s', done='d', a2a='x')[kind]}")
        if not out or out[-1] != tok:
            out.append(tok)
    return " ".join(out)
