"""Native transports: the ragged exchange through the compiled engine (``collectives/csrc``).

- ``"nccl"`` (GPU): two XLA custom calls, ``ep_comm_nccl_start`` and ``ep_comm_nccl_done``, ordered
  by data dependence. start issues the exchange on the communicator's own CUDA stream and returns;
  done makes XLA's stream wait for it. Work XLA places between them overlaps the exchange. Exactly
  the requested bytes move (grouped ``ncclSend``/``ncclRecv``); a rank's segments to itself are
  copied by a kernel that reads the offsets on the device.
- ``"mpi"`` (CPU, one device per process under ``mpirun``): one custom call,
  ``ep_comm_mpi_exchange`` (metadata and payload by point-to-point messages, tagged per call so
  that exchanges XLA:CPU runs concurrently cannot mix; needs ``MPI_THREAD_MULTIPLE``).

How sizes reach the host (NCCL): a single-rank exchange never needs them there. With peers, the
per-peer metadata (offsets, sizes, shapes, a config tag) is exchanged on the device, published by a
kernel into pinned mapped host memory, and start polls a flag for it (with a deadline) before it
issues the payload sends, because ``ncclSend`` takes its byte count from the host. That wait is the
one host synchronisation per call; XLA's own ragged all-to-all makes the same wait with a blocking
copy. Its cost is in the benchmark (``python -m ep_comm.benchmarks.dispatch``, docs/performance.md).

Errors: every rank checks every transfer it takes part in against both ends' metadata (sizes that
agree, rows inside both buffers, same shapes and config tag); ill-formed transfers are skipped by
both ends alike (no hang) and the call fails with a message naming ranks, segments and values.
A peer that never arrives fails the call after ``EP_COMM_TIMEOUT_S`` seconds (default 300; the
engine reads it, like ``EP_COMM_NCCL_SELF``, once per communicator when it is created, never per
call) and leaves the communicator aborted. ``EP_COMM_SELF_COPY_BLOCKS=k`` (read the same way) caps
the self-copy kernel at ``k`` blocks per segment: a diagnostic that gives a one-GPU self exchange a
peer link's time and SM footprint, so that its overlap with other work can be measured.

The primitive ``ep_comm_ragged_exchange`` carries ``lax.ragged_all_to_all``'s rules: it is linear in
``operand`` and ``output`` (jvp applies the same exchange to tangents; the transpose is the reverse
exchange), and ``vmap`` folds the batch into the row axis (as JAX does for its own op).
"""

from __future__ import annotations

import itertools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ep_comm.collectives import bootstrap
from ep_comm.topology._jax_compat import axis_size, module_state, named_axis_effects

TRANSPORTS = ("mpi", "nccl")
_PLATFORM = {"mpi": "cpu", "nccl": "cuda"}
_op_ids = itertools.count(1)


def _tag_value(tag) -> int:
    return int(tag) & ((1 << 62) - 1)


def _bind_args(index_arrays, axis_name, axis_index_groups):
    """The primitives' form of a call: int32 index arrays, hashable axis names and groups."""
    axis_name = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    groups = (tuple(tuple(int(i) for i in g) for g in axis_index_groups)
              if axis_index_groups else None)
    return [jnp.asarray(x).astype(jnp.int32) for x in index_arrays], axis_name, groups


def exchange(transport: str, operand, output, input_offsets, send_sizes, output_offsets,
             recv_sizes, *, axis_name, axis_index_groups=None, label="ragged_all_to_all", tag=0):
    """Bind the engine's ragged exchange (arguments already validated by ep_comm.ragged)."""
    idx, axis_name, groups = _bind_args((input_offsets, send_sizes, output_offsets, recv_sizes),
                                        axis_name, axis_index_groups)
    return ragged_exchange_p.bind(operand, output, *idx, transport=transport, axis_name=axis_name,
                                  axis_index_groups=groups, label=str(label),
                                  tag=_tag_value(tag))


def transport_fn(transport: str):
    """A transport with the signature of :mod:`ep_comm.collectives.portable`'s."""
    def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                          *, axis_name, axis_index_groups=None, max_segment_rows=None,
                          label="ragged_all_to_all", tag=0):
        del max_segment_rows  # exact-size transport
        return exchange(transport, operand, output, input_offsets, send_sizes, output_offsets,
                        recv_sizes, axis_name=axis_name, axis_index_groups=axis_index_groups,
                        label=label, tag=tag)
    ragged_all_to_all.__name__ = f"{transport}_ragged_all_to_all"
    return ragged_all_to_all


# --- primitive ---------------------------------------------------------------------------------

ragged_exchange_p = Primitive("ep_comm_ragged_exchange")


def _impl(*args, **params):
    raise RuntimeError("ep_comm's native exchange must be used inside jax.shard_map (and jit)")


def _start_abstract_eval(operand, output, *idx, transport, axis_name, axis_index_groups, **p):
    """The exchange's result (``output``'s type) and the engine's metadata workspace."""
    n = _group_size(axis_name, axis_index_groups, "ragged_all_to_all")
    return ([output.update(shape=output.shape, weak_type=False),
             _workspace_aval(transport, n, idx[0].shape[0])], named_axis_effects(axis_name))


def _abstract_eval(*args, **params):
    """The fused exchange's result is start's (its workspace stays inside the lowering)."""
    (result, _), effects = _start_abstract_eval(*args, **params)
    return result, effects


def _jvp(primals, tangents, **params):
    operand, output, *idx = primals
    d_operand, d_output, *_ = tangents
    result = ragged_exchange_p.bind(operand, output, *idx, **params)
    if type(d_operand) is type(d_output) is ad.Zero:
        return result, ad.Zero.from_primal_value(result)
    d_operand = ad.instantiate_zeros(d_operand)
    d_output = ad.instantiate_zeros(d_output)
    return result, ragged_exchange_p.bind(d_operand, d_output, *idx, **params)


def rows_covered(n_rows, offsets, sizes):
    """Boolean (n_rows,): rows inside some segment [offsets[i], offsets[i] + sizes[i])."""
    live = (sizes > 0).astype(jnp.int32)
    delta = jnp.zeros((n_rows + 1,), jnp.int32)
    delta = delta.at[jnp.where(live > 0, offsets, n_rows)].add(live, mode="drop")
    delta = delta.at[jnp.where(live > 0, offsets + sizes, n_rows)].add(-live, mode="drop")
    return jnp.cumsum(delta)[:n_rows] > 0


def _transpose(t, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
               axis_name, axis_index_groups, **params):
    op_aval = operand.aval if ad.is_undefined_primal(operand) else jax.typeof(operand)
    out_aval = output.aval if ad.is_undefined_primal(output) else jax.typeof(output)
    if type(t) is ad.Zero:
        return [ad.Zero(op_aval) if ad.is_undefined_primal(operand) else None,
                ad.Zero(out_aval) if ad.is_undefined_primal(output) else None] + [None] * 4
    # Where my received segments landed (my frame) and where the senders took them from (theirs).
    landed = _offsets_all_to_all(output_offsets, axis_name, axis_index_groups, params)
    taken = _offsets_all_to_all(input_offsets, axis_name, axis_index_groups, params)
    operand_t = output_t = None
    if ad.is_undefined_primal(operand):
        reverse = dict(params, label=params["label"] + " (transpose)")
        operand_t = ragged_exchange_p.bind(
            t, ad.zeros_like_aval(op_aval), landed, recv_sizes, taken, send_sizes,
            axis_name=axis_name, axis_index_groups=axis_index_groups, **reverse)
    if ad.is_undefined_primal(output):
        covered = rows_covered(t.shape[0], landed, recv_sizes)
        covered = lax.broadcast_in_dim(covered, t.shape, (0,))
        output_t = jnp.where(covered, jnp.zeros((), t.dtype), t)
    return [operand_t, output_t] + [None] * 4


def _offsets_all_to_all(offsets, axis_name, axis_index_groups, params):
    """A tiled all-to-all of ``(n * m,)`` int32 offsets (chunk ``j`` to member ``j``). The mpi
    transport moves them with its own exchange, so that they join its chain of exchanges: an XLA
    collective (gloo on CPU) beside the chain runs in a different order in different processes and
    deadlocks against it. Other transports: ``lax.all_to_all``."""
    groups = [list(g) for g in axis_index_groups] if axis_index_groups else None
    if params["transport"] != "mpi":
        return lax.all_to_all(offsets, axis_name, 0, 0, tiled=True, axis_index_groups=groups)
    n = _group_size(axis_name, axis_index_groups, "ragged_all_to_all")
    m = offsets.shape[0] // n
    me = lax.axis_index(axis_name)
    if groups:  # my position inside my group
        pos = np.zeros(sum(len(g) for g in groups), np.int32)
        for g in groups:
            pos[np.asarray(g)] = np.arange(len(g))
        me = jnp.asarray(pos)[me]
    i32 = jnp.int32
    sizes = jnp.full((n,), m, i32)
    out = ragged_exchange_p.bind(
        offsets.astype(i32)[:, None], jnp.zeros((n * m, 1), i32), jnp.arange(n, dtype=i32) * m,
        sizes, jnp.full((n,), me * m, i32), sizes, axis_name=axis_name,
        axis_index_groups=axis_index_groups, **dict(params, label=params["label"] + " (offsets)"))
    return out[:, 0].astype(offsets.dtype)


def _batch(vals, dims, *, axis_name, axis_index_groups, **params):
    """Fold the batch into rows: batch b's segments go to the same peers, shifted by b rows-blocks."""
    size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
    vals = [batching.bdim_at_front(v, d, size) for v, d in zip(vals, dims)]
    operand, output, io, ss, oo, rs = vals
    n_rows_in, n_rows_out = operand.shape[1], output.shape[1]
    k = io.shape[1]
    n = _group_size(axis_name, axis_index_groups, "ragged_all_to_all")
    m = k // n
    b = jnp.arange(size, dtype=jnp.int32)[:, None]
    io, oo = io + b * n_rows_in, oo + b * n_rows_out

    def by_peer(x):  # (B, n*m) -> (n*B*m,): segments grouped by destination peer
        return x.reshape(size, n, m).transpose(1, 0, 2).reshape(-1)

    out = ragged_exchange_p.bind(
        operand.reshape(size * n_rows_in, *operand.shape[2:]),
        output.reshape(size * n_rows_out, *output.shape[2:]),
        *map(by_peer, (io, ss, oo, rs)), axis_name=axis_name,
        axis_index_groups=axis_index_groups, **params)
    return out.reshape(size, n_rows_out, *output.shape[2:]), 0


def device_groups(mesh, axis_name: tuple, axis_index_groups=None) -> list[list]:
    """The device groups that exchange over ``axis_name`` of ``mesh``; each group lists its devices
    in axis-index order (row-major over the names, as ``lax.axis_index`` counts)."""
    names = list(mesh.axis_names)
    missing = [a for a in axis_name if a not in names]
    if missing:
        raise NameError(f"axis {missing} is not an axis of the mesh {tuple(names)}")
    ax = [names.index(a) for a in axis_name]
    rest = [i for i in range(len(names)) if i not in ax]
    devs = np.transpose(np.asarray(mesh.devices), rest + ax)
    width = int(np.prod([mesh.devices.shape[i] for i in ax]))
    rows = [list(r) for r in devs.reshape(-1, width)]
    if axis_index_groups:
        rows = [[row[i] for i in g] for row in rows for g in axis_index_groups]
    return rows


def _group_size(axis_name, axis_index_groups, api):
    """Members of one exchange group (traced inside shard_map)."""
    return len(axis_index_groups[0]) if axis_index_groups else axis_size(axis_name, api)


_HEADER, _SLOT = 6, 4  # int64s per metadata message: kHeader + kSlot * m (csrc/engine/exchange_plan.h)


def _workspace_aval(transport, n, k):
    """NCCL: my messages to every peer and theirs to me; MPI keeps its metadata on the host."""
    size = 2 * n * (_HEADER + _SLOT * (k // n)) if transport == "nccl" else 1
    return jax.core.ShapedArray((size,), np.int64)


def _comm_key(ctx, transport, axis_name, axis_index_groups, label, platform):
    if _PLATFORM[transport] != platform:
        raise ValueError(f"{label}: backend={transport!r} runs on {_PLATFORM[transport]}, but this "
                         f"program is being compiled for {platform}")
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or not hasattr(mesh, "devices"):
        raise ValueError(f"{label}: backend={transport!r} runs inside jax.shard_map over a "
                         f"concrete mesh (found axis context "
                         f"{type(ctx.module_context.axis_context).__name__})")
    groups = device_groups(mesh, axis_name, axis_index_groups)
    return bootstrap.communicator(transport, groups), len(groups[0])


def _mpi_chain_previous(module_context):
    """The result of the last mpi exchange lowered into the current block of this module (and its
    aval), or an empty constant when there is none: the next exchange takes it as an operand, so
    XLA runs the block's exchanges in program order in every process. The chain is state of the
    module being lowered (:func:`ep_comm.topology._jax_compat.module_state`)."""
    last = module_state(module_context).get("mpi chain")
    if last is not None:
        value, aval = last
        if value.owner.operation.block == mlir.ir.InsertionPoint.current.block:
            return value, aval
    return mlir.ir_constant(np.zeros((0,), np.int8)), jax.core.ShapedArray((0,), np.int8)


def _lower_start(ctx, operand, output, *idx, transport, axis_name, axis_index_groups, label, tag,
                 op_id, platform):
    """The exchange's first custom call; returns (result, workspace) IR values, the communicator
    key and the workspace's aval."""
    key, n = _comm_key(ctx, transport, axis_name, axis_index_groups, label, platform)
    ws_aval = _workspace_aval(transport, n, ctx.avals_in[2].shape[0])
    attrs = dict(comm_key=np.int64(key), label=label, tag=np.int64(tag))
    if transport == "mpi":  # synchronous: the whole exchange happens here
        # XLA:CPU orders independent custom calls differently in different processes: chain this
        # exchange after the previous one of the block, and give it its own MPI tags (the
        # module's channel id for it) in case exchanges still meet out of order.
        after, after_aval = _mpi_chain_previous(ctx.module_context)
        rule = jax.ffi.ffi_lowering("ep_comm_mpi_exchange", operand_output_aliases={1: 0})
        (result,) = rule(ctx.replace(avals_in=[*ctx.avals_in, after_aval],
                                     avals_out=[ctx.avals_in[1]]),
                         operand, output, *idx, after,
                         channel=np.int64(ctx.module_context.new_channel()), **attrs)
        module_state(ctx.module_context)["mpi chain"] = (result, ctx.avals_in[1])
        return result, mlir.ir_constant(np.zeros(ws_aval.shape, np.int64)), key, ws_aval
    start = jax.ffi.ffi_lowering("ep_comm_nccl_start", operand_output_aliases={1: 0})
    result, workspace = start(ctx.replace(avals_out=[ctx.avals_in[1], ws_aval]), operand, output,
                              *idx, op_id=np.int64(op_id), **attrs)
    return result, workspace, key, ws_aval


def _lower_done(ctx, result, workspace, operand, *idx, transport, key, label, op_id, result_aval,
                ws_aval, in_avals):
    if transport == "mpi":
        return [result]
    done = jax.ffi.ffi_lowering("ep_comm_nccl_done", operand_output_aliases={0: 0})
    done_ctx = ctx.replace(avals_in=[result_aval, ws_aval, *in_avals], avals_out=[result_aval])
    return done(done_ctx, result, workspace, operand, *idx, comm_key=np.int64(key),
                op_id=np.int64(op_id), label=label)


def _lower(ctx, operand, output, *idx, transport, axis_name, axis_index_groups, label, tag,
           platform):
    """The fused exchange: start and done back to back (ordered by data dependence)."""
    op_id = next(_op_ids)
    result, workspace, key, ws_aval = _lower_start(
        ctx, operand, output, *idx, transport=transport, axis_name=axis_name,
        axis_index_groups=axis_index_groups, label=label, tag=tag, op_id=op_id, platform=platform)
    return _lower_done(ctx, result, workspace, operand, *idx, transport=transport, key=key,
                       label=label, op_id=op_id, result_aval=ctx.avals_out[0], ws_aval=ws_aval,
                       in_avals=[ctx.avals_in[0], *ctx.avals_in[2:]])


ragged_exchange_p.def_impl(_impl)
ragged_exchange_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[ragged_exchange_p] = _jvp
ad.primitive_transposes[ragged_exchange_p] = _transpose
batching.primitive_batchers[ragged_exchange_p] = _batch
# cacheable=False: lowered in place, not as a private function per call, so that consecutive mpi
# exchanges of a block can be chained (_mpi_chain_previous).
mlir.register_lowering(ragged_exchange_p, lambda ctx, *a, **p: _lower(ctx, *a, platform="cpu", **p),
                       platform="cpu", cacheable=False)
mlir.register_lowering(ragged_exchange_p, lambda ctx, *a, **p: _lower(ctx, *a, platform="cuda", **p),
                       platform="cuda")


# --- the async pair, for callers that place work between start and done --------------------------

exchange_start_p = Primitive("ep_comm_ragged_exchange_start")
exchange_start_p.multiple_results = True
exchange_done_p = Primitive("ep_comm_ragged_exchange_done")


def _done_abstract_eval(result, workspace, *keep, axis_name, **p):
    return result, named_axis_effects(axis_name)


def _no_rule(what):
    def rule(*args, **kwargs):
        raise NotImplementedError(
            f"ragged_all_to_all_start/done do not support {what}; use ep_comm.ragged_all_to_all "
            f"(the same engine, start and done fused) inside grad/jvp/vmap")
    return rule


exchange_start_p.def_impl(_impl)
exchange_done_p.def_impl(_impl)
exchange_start_p.def_effectful_abstract_eval(_start_abstract_eval)
exchange_done_p.def_effectful_abstract_eval(_done_abstract_eval)
for _p in (exchange_start_p, exchange_done_p):
    ad.primitive_jvps[_p] = _no_rule("differentiation")
    batching.primitive_batchers[_p] = _no_rule("vmap")


def _start_rule(platform):
    def rule(ctx, *args, **params):
        return list(_lower_start(ctx, *args, platform=platform, **params)[:2])
    return rule


def _done_rule(platform):
    def rule(ctx, result, workspace, *keep, transport, axis_name, axis_index_groups, label,
             op_id):
        key, _ = _comm_key(ctx, transport, axis_name, axis_index_groups, label, platform)
        return _lower_done(ctx, result, workspace, *keep, transport=transport, key=key,
                           label=label, op_id=op_id, result_aval=ctx.avals_in[0],
                           ws_aval=ctx.avals_in[1], in_avals=list(ctx.avals_in[2:]))
    return rule


for _platform in ("cpu", "cuda"):
    mlir.register_lowering(exchange_start_p, _start_rule(_platform), platform=_platform,
                           cacheable=_platform != "cpu")  # see the fused rule's note
    mlir.register_lowering(exchange_done_p, _done_rule(_platform), platform=_platform)


def exchange_start(transport, operand, output, input_offsets, send_sizes, output_offsets,
                   recv_sizes, *, axis_name, axis_index_groups=None, label="ragged_all_to_all",
                   tag=0):
    """Issue the exchange; returns ``(result, workspace, keep, params)`` for :func:`exchange_done`.
    ``result`` must not be read before done."""
    idx, axis_name, groups = _bind_args((input_offsets, send_sizes, output_offsets, recv_sizes),
                                        axis_name, axis_index_groups)
    params = dict(transport=transport, axis_name=axis_name, axis_index_groups=groups,
                  label=str(label), op_id=next(_op_ids))
    result, workspace = exchange_start_p.bind(operand, output, *idx, tag=_tag_value(tag), **params)
    return result, workspace, (operand, *idx), params


def exchange_done(result, workspace, keep, params):
    """Wait for the exchange issued by :func:`exchange_start`; returns the output."""
    return exchange_done_p.bind(result, workspace, *keep, **params)

