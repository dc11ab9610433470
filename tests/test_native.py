"""The native engine (collectives/csrc): protocol checks, failure behaviour, bootstrap rules.

The MPI transport runs under ``mpirun`` with one CPU device per process (``EP_COMM_CPU_DEVICES=1``);
the NCCL transport on GPUs (one GPU: a single-rank communicator). Results against the reference and
the other transports are in test_ragged_all_to_all.py and test_dispatch_combine.py, which run every
backend; this file covers what only the engine does.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from ep_comm import collectives
import ep_comm
from ep_comm.collectives import bootstrap
from conftest import AXIS, BACKENDS, Sharded, backend_skip_reason
from ep_comm.ragged import _ragged_all_to_all

ROWS, D = 6, 3
pytestmark = [pytest.mark.multiprocess, pytest.mark.processes]  # the file is about processes


@pytest.fixture(params=[b for b in ("mpi", "nccl") if b in BACKENDS])
def native(request):
    return request.param


def exchange_fn(sharded, backend, **kw):
    def f(a, b, io, ss, oo, rs):
        return _ragged_all_to_all(a, b, io, ss, oo, rs, axis_name=AXIS, backend=backend, **kw)
    return sharded.smap(f)


def uniform_case(n):
    """Every rank sends 1 row to every rank: segment d of rank s is operand row d, landing at row s
    of rank d. Returns per-rank index arrays (n, n)."""
    io = np.tile(np.arange(n), (n, 1))
    ss = np.ones((n, n), np.int32)
    oo = np.tile(np.arange(n)[:, None], (1, n))
    rs = np.ones((n, n), np.int32)
    return io, ss, oo, rs


def run_case(sharded, n, backend, io, ss, oo, rs, gather=True, **kw):
    """Run one exchange; ``gather=False`` only waits for this process's part (a test in which some
    ranks fail must not follow with a collective that the failed ranks never join)."""
    a = np.arange(n * ROWS * D, dtype=np.float32).reshape(n * ROWS, D)
    b = np.zeros((n * ROWS, D), np.float32)
    ints = [x.astype(np.int32).reshape(-1) for x in (io, ss, oo, rs)]
    out = exchange_fn(sharded, backend, **kw)(*sharded.put(a, b, *ints))
    return sharded.get(out) if gather else jax.block_until_ready(out)


def engine_error(msg):
    return pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(msg))


def test_uniform_exchange(sharded, n, native):
    got = run_case(sharded, n, native, *uniform_case(n)).reshape(n, ROWS, D)
    a = np.arange(n * ROWS * D, dtype=np.float32).reshape(n, ROWS, D)
    for d in range(n):
        for s in range(n):
            np.testing.assert_array_equal(got[d, s], a[s, d])
        assert not got[d, n:].any()


def test_size_mismatch_is_reported_by_both_ends(sharded, n, native):
    io, ss, oo, rs = uniform_case(n)
    dst = 1 % n
    rs[dst, 0] = 2  # rank dst expects 2 rows from rank 0, which sends 1
    msg = (f"invalid exchange, these transfers were skipped: rank 0 sends 1 rows (send_sizes[{dst}]) "
           f"but rank {dst} expects 2 (recv_sizes[0])")
    if n == 1:  # the single-rank self copy checks on the device and reports on the next call
        run_case(sharded, n, native, io, ss, oo, rs)
        with engine_error("an earlier exchange on this communicator had an ill-formed self "
                          "segment (send_sizes != recv_sizes"):
            run_case(sharded, n, native, *uniform_case(n))
        return
    if jax.process_index() in (0, dst):
        with engine_error(msg):
            run_case(sharded, n, native, io, ss, oo, rs, gather=False)
    else:
        run_case(sharded, n, native, io, ss, oo, rs, gather=False)
    run_case(sharded, n, native, *uniform_case(n))  # the communicator is still usable


def test_rows_outside_the_receiver_are_reported(sharded, n, native):
    if n == 1:
        pytest.skip("a single rank checks its self segment on the device (see the test above)")
    io, ss, oo, rs = uniform_case(n)
    oo[0, 1] = ROWS  # rank 0 writes its row for rank 1 past rank 1's last row
    msg = (f"rank 0 writes rows [{ROWS}, {ROWS + 1}) (output_offsets[1]) outside rank 1's {ROWS} "
           f"output rows")
    if jax.process_index() in (0, 1):
        with engine_error(msg):
            run_case(sharded, n, native, io, ss, oo, rs, gather=False)
    else:
        run_case(sharded, n, native, io, ss, oo, rs, gather=False)


def test_ranks_with_different_configurations_fail_on_first_exchange(sharded, n, native):
    if jax.process_count() == 1:
        pytest.skip("needs ranks in different processes")
    me = jax.process_index()
    with engine_error(f"rank {me} exchanges rows of {4 * D} bytes, {n} segments, config tag {me}"):
        run_case(sharded, n, native, *uniform_case(n), gather=False, tag=me, label="tagged")
    # dispatch: rank 0 configured otherwise than the rest (a field that leaves the dispatch program's
    # shapes alone, so that the XLA collectives before the exchange still match)
    cfg = ep_comm.EPConfig(axis_name=AXIS, num_ranks=n, num_experts=n, topk=1, tokens_per_rank=4,
                           backend=native, combine_dtype="float16" if me == 0 else None)
    x = np.ones((n * 4, D), np.float32)
    ids = np.zeros((n * 4, 1), np.int32)
    w = np.ones((n * 4, 1), np.float32)
    f = sharded.smap(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg)[0])
    # the mpi transport gathers dispatch's counts through its own exchange, which fails first
    first = "counts" if native == "mpi" else "tokens"
    with engine_error(f"ep_comm dispatch ({first})"):
        jax.block_until_ready(f(*sharded.put(x, ids, w)))


def test_missing_peer_times_out_with_a_diagnostic(n, native, monkeypatch):
    if jax.process_count() == 1:
        pytest.skip("needs a peer process that does not come")
    # A mesh of its own (devices in another order): a communicator no other test uses.
    mesh = Mesh(np.array(jax.devices()[::-1]), (AXIS,))
    sharded = Sharded(mesh)
    io, ss, oo, rs = uniform_case(n)
    a = np.zeros((n * ROWS, D), np.float32)
    ints = [x.astype(np.int32).reshape(-1) for x in (io, ss, oo, rs)]
    args = sharded.put(a, a, *ints)
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()  # the bootstrap below waits at most the same 1 s for its peers
    monkeypatch.setenv("EP_COMM_TIMEOUT_S", "1")  # read when the communicator is created
    f = exchange_fn(sharded, native).lower(*args).compile()  # every process bootstraps
    if jax.process_index() == n - 1:  # the first rank of the reversed mesh waits alone
        peers = ", ".join(str(p) for p in range(1, n))
        with engine_error(f"timed out after 1.000000 s waiting for peer(s) {peers}"):
            jax.block_until_ready(f(*args))
        with engine_error("the communicator is unusable after an earlier failure"):
            jax.block_until_ready(f(*args))
    MPI.COMM_WORLD.Barrier()


def test_mpi_needs_one_device_per_process(sharded, n):
    if collectives.available()["mpi"] is not None:
        pytest.skip(collectives.available()["mpi"])
    if backend_skip_reason("mpi") is None:
        pytest.skip("this process drives one device: the mpi transport runs here")
    with pytest.raises(ValueError, match=re.escape(
            "backend='mpi' needs one device per process along the exchange axis (MPI ranks are "
            "processes), but devices")):
        run_case(sharded, n, "mpi", *uniform_case(n))


def test_finalize_then_the_next_program_bootstraps_again(sharded, n, native):
    run_case(sharded, n, native, *uniform_case(n))
    key = bootstrap.comm_key(native, collectives.native.device_groups(sharded.mesh, (AXIS,)))
    assert set(bootstrap.status(key).values()) == {"ok"}
    collectives.finalize()
    assert not bootstrap._comms
    got = run_case(sharded, n, native, *uniform_case(n))  # lowered anew: new communicators
    assert got.reshape(n, ROWS, D)[0, 0].tolist() == [0.0, 1.0, 2.0]


def test_native_lowering_has_no_xla_collective_for_the_payload(sharded, n, native):
    io, ss, oo, rs = uniform_case(n)
    a = np.zeros((n * ROWS, D), np.float32)
    ints = [x.astype(np.int32).reshape(-1) for x in (io, ss, oo, rs)]
    text = exchange_fn(sharded, native).lower(*sharded.put(a, a, *ints)).as_text()
    targets = re.findall(r'custom_call @(\w+)|call_target_name = "(\w+)"', text)
    names = {x or y for x, y in targets}
    want = {"ep_comm_mpi_exchange"} if native == "mpi" else {"ep_comm_nccl_start",
                                                             "ep_comm_nccl_done"}
    assert want <= names
    assert not re.search(r"stablehlo\.all_to_all|all-to-all", text)


def test_independent_exchanges_in_one_program_stay_apart(sharded, n, native):
    """Three exchanges with no data dependence between them in one program: each must deliver its
    own rows on every rank (XLA:CPU may run independent custom calls in any order, differently in
    each process; the mpi lowering chains them and tags each call)."""
    io, ss, oo, rs = uniform_case(n)
    ints = [x.astype(np.int32).reshape(-1) for x in (io, ss, oo, rs)]
    a = np.arange(n * ROWS * D, dtype=np.float32).reshape(n * ROWS, D)

    def f(a, b, io, ss, oo, rs):
        outs = [_ragged_all_to_all(a * (i + 1), b, io, ss, oo, rs, axis_name=AXIS,
                                   backend=native, label=f"exchange {i}") for i in range(3)]
        return jnp.stack(outs, axis=1)

    fn = sharded.smap(f)
    args = sharded.put(a, np.zeros_like(a), *ints)
    if native == "mpi":  # the exchanges are chained: each takes the previous one's result
        calls = re.findall(r"(%\S+) = stablehlo\.custom_call @ep_comm_mpi_exchange\((.*?)\)",
                           fn.lower(*args).as_text())
        assert len(calls) == 3
        for (prev, _), (_, operands) in zip(calls, calls[1:]):
            assert operands.split(", ")[-1] == prev
    for _ in range(3):
        got = sharded.get(fn(*args)).reshape(n, ROWS, 3, D)
        want = a.reshape(n, ROWS, D)
        for i in range(3):
            for d in range(n):
                for s_ in range(n):
                    np.testing.assert_array_equal(got[d, s_, i], (i + 1) * want[s_, d])


def test_built_engines_report_their_libraries():
    """Each transport the install built loads and names the library it runs on (the NCCL engine is
    compiled on CPU machines too, with nvcc, and must at least load there)."""
    for name in ("mpi", "nccl"):
        mod, why = bootstrap.load(name)
        if mod is None:  # the only acceptable reason: the install did not build it
            assert "is not built into this install" in why, why
            continue
        if name == "mpi":
            from mpi4py import MPI
            assert mod.library_version().strip() == MPI.Get_library_version().strip()
        else:
            assert mod.built_version() >= 22800 and mod.runtime_version() >= 22800


def test_available_names_the_native_kernels_and_why_a_build_left_a_part_out(monkeypatch):
    """``available()`` covers the row kernels and the grouped GEMM beside the transports; a module
    the build left out is reported with the reason its ``_build_info.json`` gives (the binary
    wheel's MPI transport, for one), each module's XLA FFI handlers listed by ``handlers()``."""
    avail = collectives.available()
    assert {"portable", "xla", "mpi", "nccl", "row_kernels", "grouped_gemm"} == set(avail)
    if jax.default_backend() == "cpu":
        assert avail["row_kernels"] == "the row kernels run on CUDA GPUs, not cpu"
        assert avail["grouped_gemm"] == "the grouped GEMM runs on CUDA GPUs, not cpu"
    info = bootstrap.build_info()
    if info is not None:  # what an install built, it loads, with its handler table
        assert set(info) == {"built", "skipped", "cuda_architectures", "selftests", "wheel"}
        for name in info["built"]:
            mod, why = bootstrap.load(name)
            if mod is not None:
                assert mod.handlers() and all(t.startswith("ep_comm_") for t in mod.handlers())
    import importlib

    def missing(name, *args):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(bootstrap, "_modules", {})
    monkeypatch.setattr(bootstrap, "_reasons", {})
    monkeypatch.setattr(bootstrap, "build_info",
                        lambda: {"built": [], "skipped": {"gemm": "left out for this test"}})
    monkeypatch.setattr(importlib, "import_module", missing)
    assert bootstrap.load("gemm") == (None, "the native grouped GEMM (CUTLASS, sm_90a) is not built "
                                            "into this install: left out for this test")
    assert bootstrap.load("rows")[1].startswith(
        "the native row kernels are not built into this install: No module named")
