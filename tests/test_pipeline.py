"""moe_layer as a pipeline of chunks of tokens or of experts (``EPConfig.num_chunks``,
``chunk_by``): the same results and gradients as one chunk and as a dense reference, with rounds
inside chunks, exchanges that do not wait for other chunks' experts, the schedule check,
``"auto"`` and bad input."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import ep_comm
from ep_comm import topology
from conftest import BASE_SEED, FULL, full
from ep_comm import pipeline
from moe_reference import dense_swiglu_moe, routing
from test_rounds import max_load, routings, served_once, swiglu_layer_and_grads

pytestmark = pytest.mark.layer  # under mpirun: the 2 x 2 phase only (pyproject.toml)

T, K, H, I = 8, 3, 4, 5
SETTINGS = settings(max_examples=(8 if FULL else 3) if jax.process_count() == 1 else
                    (2 if FULL else 1),
                    deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def config(n, chunks, capacity=None, L=4, **kw):
    """``capacity=None``: each chunk's worst case (``capacity_factor=None``)."""
    return ep_comm.EPConfig("ep", num_ranks=n, num_experts=L * n, topk=K, tokens_per_rank=T,
                            recv_capacity=capacity, num_chunks=chunks,
                            **{"capacity_factor": None} | kw)


# chunks of experts: each chunk's exchange is one of num_experts / chunks >= topk experts, so at
# any rank count up to 4 chunks of L_X experts per rank
L_X = 12


def _inputs(rng, n, kind, L=4):
    E = L * n
    ids = routing(rng, kind, n, T, K, E)
    ids[0, 1] = ids[0, 0]  # a repeated expert: merged into one pair
    ids[1, 2] = -1  # a masked slot
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    w = rng.random((n * T, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    cot = rng.standard_normal((n * T, H)).astype(np.float32)
    return ids, x, w, w_in, w_out, cot


NAMES = ("y", "d x", "d topk_weights", "d w_in", "d w_out")


@pytest.mark.parametrize("by,kind,chunks", [  # fast: two chunkings of each kind, 4 programs
    pytest.param("tokens", "random", 2, marks=full),
    pytest.param("tokens", "skewed", 4, marks=pytest.mark.multiprocess),
    ("tokens", "one_expert", 4), pytest.param("tokens", "empty_ranks", 2, marks=full),
    pytest.param("experts", "random", 2, marks=full),
    pytest.param("experts", "skewed", 3, marks=pytest.mark.multiprocess),
    pytest.param("experts", "one_expert", 4, marks=full), ("experts", "empty_ranks", 3)])
def test_chunks_equal_one_chunk_and_the_dense_layer_with_gradients(sharded, n, rng, by, kind,
                                                                    chunks):
    """Token chunks: a token's rows go through the same experts and sums in either case, and
    the weight gradients add the chunks' parts in another order. Expert chunks: each token's sum
    is split by chunk and the parts add in float32. Either way, float32 reassociation only."""
    L = 4 if by == "tokens" else L_X
    ids, x, w, w_in, w_out, cot = _inputs(rng, n, kind, L=L)
    args = sharded.put(x, ids, w, w_in, w_out, cot)
    one = sharded.get(swiglu_layer_and_grads(sharded, config(n, 1, L=L))(*args))
    got = sharded.get(swiglu_layer_and_grads(
        sharded, config(n, chunks, L=L, chunk_by=by))(*args))
    assert np.all(one[1] == 1) and np.all(got[1] == chunks), (one[1], got[1])
    for name, g, r in zip(NAMES, got[:1] + got[2:], one[:1] + one[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)
    # and the dense single-device layer, differentiated by JAX, in float64
    with jax.enable_x64():
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731
        ref_y, ref_vjp = jax.vjp(lambda x, w, wi, wo: dense_swiglu_moe(x, ids, w, wi, wo),
                                 f64(x), f64(w), f64(w_in), f64(w_out))
        refs = jax.tree.map(np.asarray, (ref_y,) + ref_vjp(f64(cot)))
    for name, g, r in zip(NAMES, got[:1] + got[2:], refs):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-4 * (1 + np.abs(r).max()),
                                   err_msg=f"{name} against the dense layer")


def test_chunk_routing_gives_every_pair_to_one_chunk():
    cfg = ep_comm.EPConfig("ep", num_ranks=2, num_experts=8, topk=3, tokens_per_rank=4,
                           num_chunks=2, chunk_by="experts")
    # experts 0-3 on rank 0, 4-7 on rank 1; chunk 0 holds local experts 0-1, chunk 1 2-3
    ids = jnp.asarray([[0, 3, 5], [6, -1, 9], [1, 1, 7], [2, -4, 4]], jnp.int32)
    w = jnp.asarray(np.arange(1, 13, dtype=np.float32).reshape(4, 3))
    got = [pipeline.chunk_routing(cfg, 2, c, ids, w) for c in range(2)]
    # renumbered: rank r's chunk expert j is r * 2 + j; out-of-range ids (9, -4) stay out of
    # range in chunk 0 (9 becomes the chunk's 4 experts: 4), -1 elsewhere
    np.testing.assert_array_equal(got[0][0], [[0, -1, 3], [-1, -1, 4], [1, 1, -1],
                                              [-1, -4, 2]])
    np.testing.assert_array_equal(got[1][0], [[-1, 1, -1], [2, -1, -1], [-1, -1, 3],
                                              [0, -1, -1]])
    np.testing.assert_array_equal(got[0][1] + got[1][1], np.where(
        (np.asarray(ids) >= 0) & (np.asarray(ids) < 8), w, 0))
    assert pipeline.chunk_config(cfg, 2).num_experts == 4
    np.testing.assert_array_equal(
        pipeline.chunk_group_sizes(cfg, 2, 1, jnp.asarray([5, 6])), [0, 0, 5, 6])
    # the parts add in float32 and round once: 1 + 4 * 2^-9 = 1 + 2^-7 is a bfloat16, while
    # adding 2^-9 to 1 in bfloat16 four times stays at 1
    y = [jnp.ones((2,), jnp.bfloat16)] + [jnp.full((2,), 2 ** -9, jnp.bfloat16)] * 4
    joined = pipeline.join_chunks(cfg, y)
    assert joined.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(joined, np.float32), 1 + 2 ** -7)


def chunk_rounds(ids, n, chunks, capacity, by="tokens"):
    """Rounds the layer takes: per chunk (``"tokens"``: every rank's tokens [c T/C, (c+1) T/C);
    ``"experts"``: the pairs with local experts [c L/C, (c+1) L/C) of every rank), the busiest
    rank's pairs of the chunk over the capacity (rounded up), summed over chunks. A chunk's first
    round runs in the pipeline, with pairs or without (with few ranks a chunk of experts often
    has none)."""
    L = 4 if by == "tokens" else L_X
    Tc, Lc = (T // chunks, L) if by == "tokens" else (T, L // chunks)
    total = 0
    for c in range(chunks):
        if by == "tokens":
            part = np.concatenate([ids[r * T + c * Tc: r * T + (c + 1) * Tc] for r in range(n)])
        else:
            part = np.where((ids >= 0) & (ids < n * L) & ((ids % L) // Lc == c), ids, -1)
        worst = n * Tc * min(K, Lc)
        cap = capacity if capacity is not None and capacity < worst else None
        total += 1 if cap is None else max(1, math.ceil(max_load(part, n, n * L) / cap))
    return total


@pytest.mark.multiprocess
@seed(BASE_SEED)
@SETTINGS
@given(data=st.data())
def test_every_pair_served_once_in_chunks_and_rounds(sharded, n, data):
    by = data.draw(st.sampled_from(["tokens", "experts"]))
    L = 4 if by == "tokens" else L_X
    ids = data.draw(routings(n, L))
    chunks = data.draw(st.sampled_from([2, 4]))
    capacity = data.draw(st.sampled_from([None, 3, T * K // 2]))
    rounds = served_once(sharded, config(n, chunks, capacity, L=L, chunk_by=by), ids, data)
    want = chunk_rounds(ids, n, chunks, capacity, by)
    assert np.all(rounds == want), (by, rounds, want)


@functools.lru_cache(maxsize=None)
def shared_layer_and_grads(sharded, cfg):
    def f(x, ids, w, w_in, w_out, s_in, s_out, cot):
        s_in, s_out = s_in[0], s_out[0]  # replicated: every rank holds the block of rank 0's

        def loss(x, w, w_in, w_out, s_in, s_out):
            y = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out, shared_w_in=s_in,
                                  shared_w_out=s_out)
            return jax.lax.psum(jnp.sum(y * cot), "ep")
        y = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out, shared_w_in=s_in,
                              shared_w_out=s_out)
        grads = jax.grad(loss, argnums=range(6))(x, w, w_in, w_out, s_in, s_out)
        return (y,) + grads[:4] + tuple(g[None] for g in grads[4:])
    return sharded.smap(f)


@pytest.mark.parametrize("by", ["tokens", pytest.param("experts", marks=full)])
def test_chunks_with_a_shared_expert_equal_one_chunk_and_the_dense_layer(sharded, n, rng, by):
    """The shared expert runs inside the pipeline, in two halves under the first dispatch and
    the last combine; values and gradients (its weights' too) as without chunks, and as dense."""
    L = 4 if by == "tokens" else L_X
    ids, x, w, w_in, w_out, cot = _inputs(rng, n, "random", L=L)
    Is = 3
    s_in = (rng.standard_normal((H, 2 * Is)) / np.sqrt(H)).astype(np.float32)
    s_out = (rng.standard_normal((Is, H)) / np.sqrt(Is)).astype(np.float32)
    rep = lambda a: np.broadcast_to(a, (n, *a.shape)).copy()  # noqa: E731 (one block per rank)
    args = sharded.put(x, ids, w, w_in, w_out, rep(s_in), rep(s_out), cot)
    one = sharded.get(shared_layer_and_grads(sharded, config(n, 1, L=L))(*args))
    got = sharded.get(shared_layer_and_grads(sharded, config(n, 4, L=L, chunk_by=by))(*args))
    names = NAMES + ("d shared_w_in", "d shared_w_out")
    for name, g, r in zip(names, got, one):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)
    with jax.enable_x64():
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731
        ref_y, ref_vjp = jax.vjp(
            lambda x, w, wi, wo, si, so: dense_swiglu_moe(x, ids, w, wi, wo, si, so),
            *map(f64, (x, w, w_in, w_out, s_in, s_out)))
        refs = jax.tree.map(np.asarray, (ref_y,) + ref_vjp(f64(cot)))
    # every rank's shared-weight gradient is its own tokens' part: their sum is the dense one
    got_sum = got[:5] + tuple(g.reshape(n, *g.shape[1:]).sum(0) for g in got[5:])
    for name, g, r in zip(names, got_sum, refs):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-4 * (1 + np.abs(r).max()),
                                   err_msg=f"{name} against the dense layer")


@pytest.mark.parametrize("chunks", [2, pytest.param(4, marks=full)])
def test_hierarchical_chunks_equal_one_chunk(sharded, n, rng, chunks):
    """The hierarchical plan's two legs per exchange: the first overlaps, the second runs when
    the chunk is finished."""
    if n % 2:
        pytest.skip(f"two simulated nodes need an even device count, got {n}")
    kw = dict(plan="hierarchical", topology=topology.simulated(2, n // 2))
    ids, x, w, w_in, w_out, cot = _inputs(rng, n, "skewed")
    args = sharded.put(x, ids, w, w_in, w_out, cot)
    one = sharded.get(swiglu_layer_and_grads(sharded, config(n, 1, **kw))(*args))
    got = sharded.get(swiglu_layer_and_grads(sharded, config(n, chunks, **kw))(*args))
    for name, g, r in zip(NAMES, got[:1] + got[2:], one[:1] + one[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)


@pytest.mark.parametrize("by,kind", [pytest.param("tokens", "skewed", marks=full),
                                     ("experts", "skewed"),
                                     ("experts", "one_expert")])  # (chunk 1: no pairs)
def test_chunks_in_rounds_equal_the_worst_case_layer_with_gradients(sharded, n, rng, by, kind):
    L = 4 if by == "tokens" else L_X
    ids, x, w, w_in, w_out, cot = _inputs(rng, n, kind, L=L)
    args = sharded.put(x, ids, w, w_in, w_out, cot)
    worst = sharded.get(swiglu_layer_and_grads(sharded, config(n, 1, L=L))(*args))
    got = sharded.get(swiglu_layer_and_grads(
        sharded, config(n, 2, capacity=2, L=L, chunk_by=by))(*args))
    assert np.all(got[1] == chunk_rounds(ids, n, 2, 2, by))
    for name, g, r in zip(NAMES, got[:1] + got[2:], worst[:1] + worst[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)


# --- what the pipeline issues in what order ----------------------------------------------------

_SCOPE = re.compile(r"ep_comm_chunk(\d+)/(dispatch|experts|combine)")
_SIDE = re.compile(r"ep_comm_side(\d)")
_CALLS = ("pjit", "jit", "shard_map", "custom_vjp_call", "custom_jvp_call", "closed_call")
# what carries an exchange in a jaxpr: the portable transport's all-to-alls, the engine's start
_EXCHANGES = ("all_to_all", "ep_comm_ragged_exchange_start", "ep_comm_ragged_exchange")


def exchange_dependencies(closed_jaxpr, full_barriers: bool):
    """Trace-order events of the program: ``("x", chunk, part, deps)`` for every all-to-all of a
    chunk's dispatch or combine, ``("e", chunk, deps)`` for every op of a chunk's experts;
    ``deps``: the labels its inputs depend on (``("e", c)`` experts of chunk ``c``, ``("x", c,
    part)`` that chunk's exchanges). An optimization barrier makes its output ``i`` depend on its
    input ``i`` only (data), or on every input (``full_barriers``: the order XLA keeps)."""
    events = []

    def run(jaxpr, in_deps):
        env = dict(zip(jaxpr.invars, in_deps))
        get = lambda a: env.get(a, frozenset()) if not hasattr(a, "val") else frozenset()  # noqa
        for e in jaxpr.eqns:
            ins = [get(a) for a in e.invars]
            union = frozenset().union(*ins)
            m = _SCOPE.search(str(e.source_info.name_stack))
            sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
            if e.primitive.name == "optimization_barrier":
                outs = [union] * len(e.outvars) if full_barriers else ins
            elif sub is not None and e.primitive.name in _CALLS:
                outs = run(getattr(sub, "jaxpr", sub), ins)
            else:
                outs = [union] * len(e.outvars)
                if m and e.primitive.name in _EXCHANGES:
                    events.append(("x", int(m.group(1)), m.group(2), union))
                    outs = [union | {("x", int(m.group(1)), m.group(2))}] * len(e.outvars)
                elif (side := _SIDE.search(str(e.source_info.name_stack))):
                    events.append(("s", int(side.group(1)), union))
                elif m and m.group(2) == "experts":
                    events.append(("e", int(m.group(1)), union))
                    outs = [union | {("e", int(m.group(1)))}] * len(e.outvars)
            for v, d in zip(e.outvars, outs):
                env[v] = d
        return [get(v) for v in jaxpr.outvars]

    run(closed_jaxpr.jaxpr, [frozenset()] * len(closed_jaxpr.jaxpr.invars))
    return events


@pytest.mark.parametrize("by,capacity", [("tokens", None), ("experts", None),
                                         ("tokens", 2)])  # (rounds: the first in the pipeline)
def test_exchanges_do_not_wait_for_other_chunks_experts_and_experts_wait_for_the_starts(
        sharded, n, monkeypatch, by, capacity):
    monkeypatch.setenv("EP_COMM_LOCAL_EXCHANGE", "1")  # one rank (one GPU) exchanges too
    C, L = 4, (4 if by == "tokens" else L_X)
    cfg = config(n, C, capacity, L=L, chunk_by=by)
    f = sharded.smap(lambda x, ids, w, wi, wo: ep_comm.moe_layer(x, ids, w, cfg, w_in=wi,
                                                                 w_out=wo))
    args = sharded.put(np.zeros((n * T, H), np.float32), np.zeros((n * T, K), np.int32),
                       np.ones((n * T, K), np.float32), np.zeros((L * n, H, 2 * I), np.float32),
                       np.zeros((L * n, I, H), np.float32))
    jaxpr = jax.make_jaxpr(f)(*args)
    data = exchange_dependencies(jaxpr, full_barriers=False)
    exchanges = [e for e in data if e[0] == "x"]
    assert {(c, p) for _, c, p, _ in exchanges} == {(c, p) for c in range(C)
                                                  for p in ("dispatch", "combine")}
    for _, c, part, deps in exchanges:
        experts = {d[1] for d in deps if d[0] == "e"}
        # a chunk's dispatch needs no experts; its combine needs its own experts only
        assert experts == (set() if part == "dispatch" else {c}) or (
            part == "combine" and experts <= {c}), (c, part, experts)
    # in trace order: the exchanges of dispatch c+1 and combine c-1 come before chunk c's experts
    pos = {}
    for i, e in enumerate(data):
        key = (e[1], e[2]) if e[0] == "x" else (e[1], "experts")
        pos.setdefault(key, []).append(i)
    for c in range(C):
        first = min(pos[(c, "experts")])
        if c + 1 < C:
            assert max(pos[(c + 1, "dispatch")]) < first
        if c >= 1:
            assert max(pos[(c - 1, "combine")]) < first
    # and the barriers tie them: with barriers as dependencies, experts c come after both
    ordered = exchange_dependencies(jaxpr, full_barriers=True)
    for c in range(C):
        deps = frozenset().union(*(e[2] for e in ordered if e[0] == "e" and e[1] == c))
        if c + 1 < C:
            assert ("x", c + 1, "dispatch") in deps, c
        if c >= 1:
            assert ("x", c - 1, "combine") in deps, c


@pytest.mark.parametrize("C,capacity", [(4, None), (4, 2)])
def test_the_shared_expert_runs_under_the_first_dispatch_and_the_last_combine(sharded, n,
                                                                            monkeypatch, C,
                                                                            capacity):
    """And in rounds: under the first dispatch and the last combine of the first rounds."""
    monkeypatch.setenv("EP_COMM_LOCAL_EXCHANGE", "1")
    Is = 3
    cfg = config(n, C, capacity)
    f = sharded.smap(lambda x, ids, w, wi, wo, si, so: ep_comm.moe_layer(
        x, ids, w, cfg, w_in=wi, w_out=wo, shared_w_in=si[0], shared_w_out=so[0]))
    args = sharded.put(np.zeros((n * T, H), np.float32), np.zeros((n * T, K), np.int32),
                       np.ones((n * T, K), np.float32), np.zeros((4 * n, H, 2 * I), np.float32),
                       np.zeros((4 * n, I, H), np.float32), np.zeros((n, H, 2 * Is), np.float32),
                       np.zeros((n, Is, H), np.float32))
    jaxpr = jax.make_jaxpr(f)(*args)
    for full in (False, True):
        events = exchange_dependencies(jaxpr, full_barriers=full)
        side = {h: frozenset().union(*(e[2] for e in events if e[0] == "s" and e[1] == h))
                for h in (0, 1)}
        assert all(any(e[0] == "s" and e[1] == h for e in events) for h in (0, 1))
        # as data the shared expert needs no exchange; as order, each half follows its exchange
        want0 = {("x", 0, "dispatch")} if full else set()
        want1 = {("x", C - 1, "combine")} if full else set()
        assert {d for d in side[0] if d[0] == "x"} == want0, side[0]
        assert want1 <= {d for d in side[1] if d[0] == "x"}, side[1]
        if not full:
            assert not any(d[0] in ("x", "e") for d in side[1]), side[1]


GPU_SCHEDULE = """\
HloModule jit_f, is_scheduled=true

%command_buffer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %g1 = f32[8]{0} custom-call(%p), custom_call_target="mosaic_gpu", metadata={op_name="jit(f)/ep_comm_chunk{E}/experts/dot_general"}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %m0 = s32[4]{0} add(%a), metadata={op_name="jit(f)/ep_comm_chunk0/experts/cumsum"}
  %s1 = (f32[8]{0}, s64[4]{0}) custom-call(%a), custom_call_target="ep_comm_nccl_start", metadata={op_name="jit(f)/ep_comm_chunk1/dispatch/x"}
  %g0 = f32[8]{0} custom-call(%a), custom_call_target="mosaic_gpu", metadata={op_name="jit(f)/ep_comm_chunk0/experts/dot_general"}
  %d1 = f32[8]{0} custom-call(%s1), custom_call_target="ep_comm_nccl_done", metadata={op_name="jit(f)/ep_comm_chunk1/dispatch/x"}
  %s0 = (f32[8]{0}, s64[4]{0}) custom-call(%g0), custom_call_target="ep_comm_nccl_start", metadata={op_name="jit(f)/ep_comm_chunk0/combine/x"}
  %c = f32[8]{0} call(%d1), to_apply=%command_buffer
  %d0 = f32[8]{0} custom-call(%s0), custom_call_target="ep_comm_nccl_done", metadata={op_name="jit(f)/ep_comm_chunk0/combine/x"}
  ROOT %t = f32[8]{0} add(%c, %d0)
}
"""


def test_schedule_check_reads_a_compiled_gpu_schedule():
    good = GPU_SCHEDULE.replace("{E}", "1")
    order = pipeline.schedule_order(good)
    # (an expert op that reads no exchanged rows, here before the start, does not count)
    assert order == [(0, "experts", "op"), (1, "dispatch", "start"), (0, "experts", "gemm"),
                     (1, "dispatch", "done"), (0, "combine", "start"), (1, "experts", "gemm"),
                     (0, "combine", "done")]
    assert pipeline.check_schedule(order, 2) == []
    assert pipeline.order_summary(order) == "E0 D1s E0 D1d C0s E1 C0d"
    # a done moved before the experts it should wait behind, and a missing start
    bad = good.replace('%d0 = f32[8]{0} custom-call(%s0), custom_call_target="ep_comm_nccl_done"',
                       '%d0 = f32[8]{0} custom-call(%s0), custom_call_target="ep_comm_nccl_done"')
    lines = bad.splitlines()
    i_c = next(i for i, l in enumerate(lines) if "to_apply=%command_buffer" in l)
    i_d = next(i for i, l in enumerate(lines) if "%d0 =" in l)
    lines[i_c], lines[i_d] = lines[i_d], lines[i_c]
    assert pipeline.check_schedule(pipeline.schedule_order("\n".join(lines)), 2) == [
        "combine of chunk 0 is finished before experts of chunk 1 end"]
    no_start = good.replace('custom_call_target="ep_comm_nccl_start", metadata={op_name='
                            '"jit(f)/ep_comm_chunk1', 'custom_call_target="x", metadata={op_name='
                            '"jit(f)/other')
    assert pipeline.check_schedule(pipeline.schedule_order(no_start), 2) == [
        "dispatch of chunk 1: no exchange in the schedule"]


def test_one_rank_exchanging_through_its_transport_gives_the_local_result(rng, monkeypatch):
    """EP_COMM_LOCAL_EXCHANGE=1 (the one-GPU benchmarks' switch): one rank runs its exchanges
    through the transport instead of its local route, with the same results."""
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:1])
    ids, x, w, w_in, w_out, _ = _inputs(rng, 1, "random")
    cfg = config(1, 2)
    f = lambda: jax.jit(jax.shard_map(  # noqa: E731 (traced anew: the switch is read then)
        lambda x, ids, w, wi, wo: ep_comm.moe_layer(x, ids, w, cfg, w_in=wi, w_out=wo),
        mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w, w_in, w_out)]
    exchanges = lambda fn: [e for e in exchange_dependencies(  # noqa: E731
        jax.make_jaxpr(fn)(*args), False) if e[0] == "x"]
    monkeypatch.delenv("EP_COMM_LOCAL_EXCHANGE", raising=False)
    local = f()
    assert exchanges(local) == []
    monkeypatch.setenv("EP_COMM_LOCAL_EXCHANGE", "1")
    exchanged = f()
    assert {(c, part) for _, c, part, _ in exchanges(exchanged)} == {
        (c, part) for c in range(2) for part in ("dispatch", "combine")}
    np.testing.assert_allclose(np.asarray(exchanged(*args)), np.asarray(local(*args)),
                               rtol=1e-6, atol=1e-6)


# --- choosing num_chunks, and bad input -----------------------------------------------------------

def test_auto_chunks_follow_the_cost_model(n):
    H_big, I_big = 7168, 2048
    flops, weights = 6.0 * H_big * I_big, 3.0 * 4 * H_big * I_big * 2
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=8 * n, topk=8, tokens_per_rank=4096,
                           num_chunks="auto")
    # one rank: nothing is exchanged, chunks only re-read the weights
    one_rank = ep_comm.EPConfig("ep", num_ranks=1, num_experts=4, topk=4, tokens_per_rank=4096,
                                num_chunks="auto")
    assert pipeline.resolve_chunks(one_rank, H_big, jnp.bfloat16, flops, weights) == 1
    # slow links: the exchange rivals the experts, and hiding it pays for the re-reads
    slow = topology.CostModel(self=topology.Link(2e-6, 20e9), nvlink=topology.Link(3e-6, 20e9))
    if n > 1:
        c = pipeline.resolve_chunks(dataclasses.replace(cfg, cost_model=slow), H_big,
                                    jnp.bfloat16, flops, weights)
        assert c > 1 and 4096 % c == 0, c
    # chunks of experts read the weights once: one rank gains nothing from them either; at the
    # DeepSeek-V3 rank shape (32 experts per rank) over NVLink they pay where token chunks do not
    by_experts = dataclasses.replace(one_rank, num_experts=32, chunk_by="experts")
    assert pipeline.resolve_chunks(by_experts, H_big, jnp.bfloat16, flops, 8 * weights) == 1
    if n > 1:
        nvlink = topology.Link(3e-6, 160e9)  # every link (CPU devices' too) NVLink's
        deepseek = dataclasses.replace(cfg, num_experts=32 * n, cost_model=topology.CostModel(
            nvlink=nvlink, pcie=nvlink, network=nvlink))
        c = pipeline.resolve_chunks(dataclasses.replace(deepseek, chunk_by="experts"), H_big,
                                    jnp.bfloat16, flops, 8 * weights)
        assert c > 1 and 32 % c == 0, c
        assert pipeline.resolve_chunks(deepseek, H_big, jnp.bfloat16, flops, 8 * weights) < c
    assert pipeline.chunk_counts(dataclasses.replace(cfg, num_experts=16 * n, chunk_by="experts")
                                 ) == [c for c in (1, 2, 4, 8, 16) if 16 * n // c >= 8]
    m = topology.CostModel()
    args = (1e-3, 1e12, 256.0, 1e9)
    assert m.pipeline_seconds(1, *args) == pytest.approx(
        1e-3 + 1e12 / m.gemm_flops + 1e9 / m.weight_bytes_per_s + m.step_seconds)
    # four chunks: a quarter of the exchange alone, then four steps of the longer of the two
    q = (0.25e-3, 0.25e12, 64.0, 1e9)
    gemm = 0.25e12 * 2 / m.gemm_flops + 1e9 / m.weight_bytes_per_s  # 64 rows pad to 128
    assert m.pipeline_seconds(4, *q) == pytest.approx(0.25e-3 + 4 * max(gemm, 0.25e-3)
                                                      + 4 * m.step_seconds)


def test_num_chunks_bad_input(sharded, n):
    with pytest.raises(ValueError, match="EPConfig: num_chunks=3 must divide tokens_per_rank=8 "
                                         r"\(every chunk is an exchange of the same size\)"):
        config(n, 3)
    for bad in (0, -2, 1.5, True, "many"):
        with pytest.raises(ValueError, match="EPConfig: num_chunks must be a positive int or "
                                             f"'auto', got {re.escape(repr(bad))}"):
            config(n, bad)
    with pytest.raises(ValueError, match="EPConfig: chunk_by must be one of \\('tokens', "
                                         "'experts'\\), got 'rows'"):
        config(n, 2, chunk_by="rows")
    with pytest.raises(ValueError, match="EPConfig: num_chunks=3 must divide experts_per_rank=4 "
                                         "with chunk_by='experts' \\(every chunk holds as many "
                                         "experts\\)"):
        config(n, 3, chunk_by="experts")
    with pytest.raises(ValueError, match="EPConfig: num_chunks=4 leaves 2 experts per chunk "
                                         "with chunk_by='experts', fewer than topk=3"):
        ep_comm.EPConfig("ep", num_ranks=2, num_experts=8, topk=3, tokens_per_rank=T,
                         num_chunks=4, chunk_by="experts")
    with pytest.raises(ValueError, match="CostModel: weight_bytes_per_s must be a finite "
                                         "number > 0, got 0"):
        topology.CostModel(weight_bytes_per_s=0)
    with pytest.raises(ValueError, match="CostModel.pipeline_seconds: chunks must be a positive "
                                         "int, got 0"):
        topology.CostModel().pipeline_seconds(0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="CostModel.pipeline_seconds: flops must be a finite "
                                         "number >= 0, got -1.0"):
        topology.CostModel().pipeline_seconds(2, 1.0, -1.0, 1.0)
    cfg = config(n, "auto")
    with pytest.raises(ValueError, match="moe_layer: num_chunks='auto' estimates the experts' "
                                         "time from the SwiGLU weights w_in/w_out; with experts= "
                                         "give num_chunks as an int"):
        sharded.smap(lambda x, ids, w: ep_comm.moe_layer(x, ids, w, cfg,
                                                         experts=lambda ex, gs: ex))(
            *sharded.put(np.zeros((n * T, H), np.float32), np.zeros((n * T, K), np.int32),
                         np.zeros((n * T, K), np.float32)))
    with pytest.raises(ValueError, match="moe_layer: topk_weights must be a floating array of "
                                         r"shape \(8, 3\), got int32 \(8, 3\)"):
        sharded.smap(lambda x, ids, w: ep_comm.moe_layer(
            x, ids, w.astype(jnp.int32), config(n, 2), experts=lambda ex, gs: ex))(
                *sharded.put(np.zeros((n * T, H), np.float32), np.zeros((n * T, K), np.int32),
                             np.zeros((n * T, K), np.float32)))
