"""What the compiled program moves: asserted on the lowered StableHLO."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ep_comm import collectives
import ep_comm

T, K, H = 16, 4, 24


def collectives_in(text):
    """[(op, operand type)] for every all_gather / all_to_all / ragged_all_to_all in the module."""
    out = []
    for line in text.splitlines():
        m = re.search(r'"stablehlo\.(all_gather|all_to_all)"', line)
        if m:
            out.append((m.group(1), re.search(r"\}> : \((tensor<[^>]*>)\)", line).group(1)))
        elif "@ragged_all_to_all" in line or '"ragged_all_to_all"' in line:
            out.append(("ragged_all_to_all", line.strip()[-120:]))
    return out


def lowered_dispatch(mesh, n, backend, **kw):
    cfg = ep_comm.EPConfig("ep", num_ranks=n, num_experts=4 * n, topk=K, tokens_per_rank=T,
                           backend=backend, **kw)
    f = jax.jit(jax.shard_map(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg)[0], mesh=mesh,
                              in_specs=P("ep"), out_specs=P("ep")))
    args = (jax.ShapeDtypeStruct((n * T, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((n * T, K), jnp.int32),
            jax.ShapeDtypeStruct((n * T, K), jnp.float32))
    shard = jax.sharding.NamedSharding(mesh, P("ep"))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard) for a in args]
    return f.lower(*args).as_text()


def test_portable_dispatch_gathers_only_counts_and_sends_T_rows_per_peer(mesh, n):
    ops = collectives_in(lowered_dispatch(mesh, n, "portable"))
    if n == 1:  # one rank: the receive buffer is the tokens themselves (routes.is_local)
        assert ops == []
        return
    gathers = [t for op, t in ops if op == "all_gather"]
    # the n x n token/pair count matrix and the id check's [count, token, k, value] (EPConfig.
    # invalid_ids), nothing else
    assert gathers == [f"tensor<1x{2 * n + 4}xi32>"]
    a2a = [t for op, t in ops if op == "all_to_all"]
    if n > 1:  # JAX lowers an all_to_all over one device to nothing
        assert f"tensor<{n}x{T}x{H}xbf16>" in a2a  # tokens: a slot of T rows per peer, bf16 wire
    assert not any(op == "ragged_all_to_all" for op, _ in ops)
    assert all(not t.endswith(f"x{H}xf32>") for t in a2a)  # no upcast of the payload


def test_xla_backend_lowers_to_native_ragged_all_to_all(mesh, n):
    if collectives.available()["xla"] is not None:
        pytest.skip(collectives.available()["xla"])
    ops = collectives_in(lowered_dispatch(mesh, n, "xla"))
    if n == 1:  # one rank: nothing to exchange (routes.is_local)
        assert ops == []
        return
    # tokens, then weights and expert ids together
    assert sum(op == "ragged_all_to_all" for op, _ in ops) == 2
    assert not any(op == "all_to_all" and t.endswith(f"x{H}xbf16>") for op, t in ops)


def test_hierarchical_dispatch_sends_T_rows_per_node_then_forwards_inside_the_node(mesh, n):
    if n < 4 or n % 2:
        pytest.skip("needs an even device count >= 4")
    from ep_comm import topology
    N, G = 2, n // 2
    text = lowered_dispatch(mesh, n, "portable", plan="hierarchical",
                            topology=topology.simulated(N, G))
    ops = collectives_in(text)
    gathers = [t for op, t in ops if op == "all_gather"]
    assert gathers == [f"tensor<1x{2 * n + N + 4}xi32>"]  # counts per rank, per node, id check
    a2a = [t for op, t in ops if op == "all_to_all"]
    # stage 1 (between nodes): one slot of T token rows per node; stage 2 (inside the node): one
    # slot per local rank of at most N * T rows (every token that reached this node)
    assert f"tensor<{N}x{T}x{H}xbf16>" in a2a
    assert f"tensor<{G}x{N * T}x{H}xbf16>" in a2a
    assert f"tensor<{n}x{T}x{H}xbf16>" not in a2a  # no flat exchange
    if collectives.available()["xla"] is None:
        ops = collectives_in(lowered_dispatch(mesh, n, "xla", plan="hierarchical",
                                              topology=topology.simulated(N, G)))
        assert sum(op == "ragged_all_to_all" for op, _ in ops) == 4
