"""grouped_matmul against lax.ragged_dot, and moe_layer against a dense float64 model."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ep_comm
from ep_comm.collectives import grouped_gemm
from ep_comm import gemm
from moe_reference import check_nnx_against_dense, dense_swiglu_moe, routing

pytestmark = pytest.mark.layer  # under mpirun: the 2 x 2 phase only (pyproject.toml)

T, K, H, I, I_SHARED = 16, 4, 8, 6, 5
CUTLASS = pytest.mark.skipif(grouped_gemm.unavailable_reason() is not None,
                             reason=f"the CUTLASS grouped GEMM: {grouped_gemm.unavailable_reason()}")
TOKAMAX = pytest.mark.skipif(
    not (jax.default_backend() == "gpu" and gemm.tokamax_available()),
    reason="tokamax's GPU kernels need a CUDA backend and tokamax (pip install 'ep_comm[gpu]')")


# ---- grouped_matmul ------------------------------------------------------------------------------

GROUPINGS = {
    "uneven with empty groups": [3, 0, 7, 0, 5],
    "all rows in one group": [0, 0, 24, 0, 0],
    "rows past the groups": [2, 4, 1, 3, 0],  # 10 of 24 rows
    "no rows": [0, 0, 0, 0, 0],
}


def _ragged_case(rng, sizes, dtype, M=24, Kd=16, N=8):
    x = rng.standard_normal((M, Kd)).astype(np.float32)
    w = (rng.standard_normal((len(sizes), Kd, N)) / 4).astype(np.float32)
    cot = rng.standard_normal((M, N)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), cast(w), jnp.asarray(sizes, jnp.int32), cast(cot)


@functools.lru_cache(maxsize=None)
def _value_and_grads(implementation):
    def f(x, w, gs, cot):
        out, vjp = jax.vjp(lambda x, w: grouped(x, w, gs), x, w)
        return (out,) + vjp(cot)

    impl = dict(implementation) if isinstance(implementation, tuple) else implementation
    grouped = (lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)) if impl is None else \
        functools.partial(ep_comm.grouped_matmul, implementation=impl)
    return jax.jit(f)


def _dense_grouped(x, w, sizes, cot):
    """float64 numpy: out, dx and dw of the grouped product, zero past the groups."""
    x, w, cot = (np.asarray(a, np.float64) for a in (x, w, cot))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    for g, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        out[lo:hi] = x[lo:hi] @ w[g]
        dx[lo:hi] = cot[lo:hi] @ w[g].T
        dw[g] = x[lo:hi].T @ cot[lo:hi]
    return out, dx, dw


def _check_against_ragged_dot(rng, sizes, dtype, implementation, rtol):
    x, w, gs, cot = _ragged_case(rng, sizes, dtype)
    key = tuple(implementation.items()) if isinstance(implementation, dict) else implementation
    got = _value_and_grads(key)(x, w, gs, cot)
    # the references: the dense float64 product, and lax.ragged_dot (values and its own transpose
    # rules) in float32 on the groups' rows (past them, XLA:TPU leaves its output unwritten)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ragged = _value_and_grads(None)(f32(x), f32(w), gs, f32(cot))
    total = int(np.sum(sizes))
    for name, g, dense, r in zip(("out", "dx", "dw"), got, _dense_grouped(x, w, sizes, cot),
                                 ragged):
        assert g.dtype == x.dtype, name
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        tol = dict(rtol=rtol, atol=rtol * (1 + np.abs(dense).max()))
        np.testing.assert_allclose(g, dense, err_msg=name + " against float64", **tol)
        rows = slice(None) if name == "dw" else slice(0, total)
        np.testing.assert_allclose(g[rows], r[rows], err_msg=name + " against ragged_dot", **tol)
    np.testing.assert_array_equal(np.asarray(got[0], np.float64)[total:], 0.0)  # past the groups
    np.testing.assert_array_equal(np.asarray(got[1], np.float64)[total:], 0.0)


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_matmul_equals_ragged_dot_with_gradients(rng, grouping, dtype):
    # bf16: the reference sees the same bf16-rounded inputs; results differ by output rounding
    _check_against_ragged_dot(rng, GROUPINGS[grouping], dtype, "auto",
                              rtol=1e-6 if dtype == "float32" else 2 ** -7)


@TOKAMAX
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_grouped_matmul_tokamax_equals_ragged_dot_with_gradients(rng, grouping):
    _check_against_ragged_dot(rng, GROUPINGS[grouping], "bfloat16", "tokamax", rtol=2 ** -7)


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_matmul_megablox_equals_ragged_dot_with_gradients(rng, grouping, dtype):
    """megablox (Pallas interpret mode off TPU) at 24 rows: tm 8 (24 is no multiple of 16),
    groups that are empty, of one row, not whole tiles, and none at all."""
    _check_against_ragged_dot(rng, GROUPINGS[grouping], dtype, "megablox",
                              rtol=1e-6 if dtype == "float32" else 2 ** -7)


def test_cutlass_configs_per_weight_shape_override_the_pass_defaults(monkeypatch):
    """``SHAPE_CONFIGS`` (picked per pass and weight shape by the layer bench's ``--tune``)
    overrides ``DEFAULT_CONFIGS`` for that shape only; every pass reads the weight's (K, N) from
    its operands; the sweep's rows give the fastest right config per (pass, K, N)."""
    from ep_comm.benchmarks.gemm_sweep import fastest_by_shape

    monkeypatch.setattr(grouped_gemm, "SHAPE_CONFIGS",
                        {("forward", 64, 32): 1, ("drhs", 64, 32): 4})
    d = grouped_gemm.DEFAULT_CONFIGS
    assert grouped_gemm.config_for("forward", 64, 32) == 1
    assert grouped_gemm.config_for("forward", 32, 64) == d["forward"]
    assert grouped_gemm.config_for("dlhs", 64, 32) == d["dlhs"]
    assert grouped_gemm.weight_dims("forward", (8, 64), (2, 64, 32)) == (64, 32)
    assert grouped_gemm.weight_dims("dlhs", (8, 32), (2, 64, 32)) == (64, 32)
    assert grouped_gemm.weight_dims("drhs", (8, 64), (8, 32)) == (64, 32)
    with pytest.raises(ValueError, match=re.escape(
            "config_for: pass_name must be one of ('forward', 'dlhs', 'drhs'), got 'up'")):
        grouped_gemm.config_for("up", 64, 32)
    # the table is read where no config is given: an entry the kernel lacks is refused by name
    grouped_gemm.SHAPE_CONFIGS[("forward", 64, 32)] = 9
    with pytest.raises(ValueError, match=re.escape(
            "grouped_gemm: config must be one of (0, 1, 2, 3, 4), got 9")):
        grouped_gemm.grouped_gemm("forward", jnp.zeros((8, 64), jnp.bfloat16),
                                  jnp.zeros((2, 64, 32), jnp.bfloat16), jnp.array([3, 5]))
    row = lambda p, w, c, t, wrong=0: dict(pass_=p, impl=f"ep_comm cutlass config {c}",  # noqa
                                           config=c, time_us=t, wrong=wrong, weight=w)
    results = [row("forward", [64, 32], 0, 5.0), row("forward", [64, 32], 3, 4.0),
               row("forward", [64, 32], 1, 1.0, wrong=2),  # (fastest, but wrong: not a choice)
               row("forward", [32, 64], 0, 2.0), row("forward", [32, 64], 3, 3.0),
               dict(pass_="forward", impl="ep_comm cutlass config 2", skipped="no"),
               dict(pass_="forward", impl="dense einsum", time_us=0.5, wrong=0, x_dense=1.0)]
    assert fastest_by_shape(results, "ep_comm cutlass") == {("forward", 64, 32): 3,
                                                            ("forward", 32, 64): 0}


def test_megablox_traces_16_bit_kernels_at_the_default_precision():
    """Mosaic fails to compile a bf16 dot at a global ``jax_default_matmul_precision="highest"``
    ("Bad lhs type", as the TPU tests set it); every megablox pass of 16-bit inputs is traced at
    the default precision (the same product), float32 ones at the caller's."""
    gs = jnp.array([30, 34], jnp.int32)

    def precisions(dtype):
        x, w = jnp.ones((64, 128), dtype), jnp.ones((2, 128, 128), dtype)
        loss = lambda x, w: ep_comm.grouped_matmul(  # noqa: E731
            x, w, gs, implementation="megablox").astype(jnp.float32).sum()
        with jax.default_matmul_precision("highest"):
            text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
        return set(re.findall(r"precision=\(?Precision\.(\w+)", text))

    assert precisions(jnp.bfloat16) == {"DEFAULT"}
    assert precisions(jnp.float32) == {"HIGHEST"}


def _dense_swiglu_up(x, w_in, sizes):
    """float64 numpy: ``silu(x @ w_gate) * (x @ w_up)`` per group (zero past the groups), and
    the rows in groups."""
    inter = w_in.shape[2] // 2
    u = _dense_grouped(x, w_in, sizes, np.zeros((x.shape[0], 2 * inter)))[0]
    return u[:, :inter] / (1 + np.exp(-u[:, :inter])) * u[:, inter:], int(np.sum(sizes))


def test_swiglu_kernel_walks_each_groups_row_tiles_once():
    """A visit per (group, row tile) the group touches, in order; empty groups none; the grid's
    spare visits repeat the last real one."""
    from ep_comm.swiglu_gmm import visits

    offsets, groups, tiles, count = visits(jnp.array([5, 0, 17, 1, 9]), 40, 8)
    assert offsets.tolist() == [0, 5, 5, 22, 23, 32]
    assert int(count[0]) == 7 and len(groups) == 40 // 8 + 5 - 1
    assert list(zip(groups.tolist(), tiles.tolist())) == [
        (0, 0), (2, 0), (2, 1), (2, 2), (3, 2), (4, 2), (4, 3), (4, 3), (4, 3)]
    # sizes past the rows are clipped, negative ones are empty, no rows: no visit
    offsets, groups, tiles, count = visits(jnp.array([-3, 30, 20]), 32, 16)
    assert offsets.tolist() == [0, 0, 30, 32] and int(count[0]) == 3
    assert list(zip(groups.tolist(), tiles.tolist()))[:3] == [(1, 0), (1, 1), (2, 1)]
    assert int(visits(jnp.zeros(3, jnp.int32), 16, 8)[3][0]) == 0


# the SwiGLU kernel's tests at toy sizes: Pallas interpret mode; on a TPU its blocks must be whole
# (8, 128) tiles, and tools/tpu_megablox.py checks it at the layer's shapes on the chip
INTERPRETED = pytest.mark.skipif(
    jax.default_backend() == "tpu",
    reason="toy sizes run in interpret mode; on TPU tools/tpu_megablox.py checks the kernel")


@INTERPRETED
@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_kernel_equals_the_unfused_up_projection_with_gradients(rng, grouping, dtype):
    """The Pallas kernel with SwiGLU in its epilogue (interpret mode off TPU) at 24 rows in
    row tiles of 8: groups empty, of one row, across tiles, none; against float64 and the
    unfused megablox path (values, and the gradients it takes under grad). The rows past the
    groups in a tile the kernel visits are zero."""
    from ep_comm.swiglu_gmm import swiglu_gmm, swiglu_grouped_matmul

    sizes = GROUPINGS[grouping]
    x, w_in, gs, _ = _ragged_case(rng, sizes, dtype, N=32)  # (the gate and the up half: 16 each)
    cot = jnp.asarray(rng.standard_normal((24, 16)), dtype)
    want, total = _dense_swiglu_up(x, w_in, sizes)
    rtol = 1e-5 if dtype == "float32" else 2 ** -7
    tol = dict(rtol=rtol, atol=rtol * (1 + np.abs(want).max()))
    h = swiglu_gmm(x, w_in, gs, tiling=(8, 16, 8))
    assert h.dtype == x.dtype and h.shape == (24, 16)
    np.testing.assert_allclose(np.asarray(h, np.float64)[:total], want[:total], **tol)
    np.testing.assert_array_equal(np.asarray(h, np.float64)[total:-(-total // 8) * 8], 0.0)
    unfused = lambda a, b: ep_comm.swiglu_experts(  # noqa: E731 (its up half: w_out = identity)
        a, gs, b, jnp.broadcast_to(jnp.eye(16, dtype=a.dtype), (5, 16, 16)), "megablox")
    for name, fn in (("fused", lambda a, b: swiglu_grouped_matmul(a, b, gs)),
                     ("unfused", unfused)):
        y, vjp = jax.vjp(fn, x, w_in)
        np.testing.assert_allclose(np.asarray(y, np.float64)[:total], want[:total],
                                   err_msg=name, **tol)
        if name == "fused":
            got = vjp(cot)
        else:
            ref = vjp(cot)
    for a, b, name in zip(got, ref, ("dx", "dw_in")):
        rows = slice(None) if name == "dw_in" else slice(0, total)
        np.testing.assert_allclose(np.asarray(a, np.float64)[rows], np.asarray(b, np.float64)[rows],
                                   rtol=rtol, atol=rtol * (1 + np.abs(np.asarray(b, np.float64)).max()),
                                   err_msg=name)


@INTERPRETED
def test_swiglu_kernel_names_what_it_was_given(monkeypatch):
    from ep_comm.swiglu_gmm import swiglu_gmm, swiglu_tiling

    x, w = jnp.zeros((16, 32), jnp.bfloat16), jnp.zeros((2, 32, 12), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape(
            "swiglu_gmm: w_in must be a bfloat16 array of shape (groups, hidden = 32, 2 * "
            "intermediate), got float32 (2, 32, 12)")):
        swiglu_gmm(x, w.astype(jnp.float32), jnp.array([8, 8]))
    with pytest.raises(ValueError, match=re.escape(
            "swiglu_gmm: group_sizes must be an integer array of shape (groups,) = (2,), got "
            "float32 (2,)")):
        swiglu_gmm(x, w, jnp.array([8.0, 8.0]))
    with pytest.raises(ValueError, match=re.escape(
            "swiglu_gmm: tiling (tm, tk, tn) = (16, 32, 4) must have tk dividing hidden (32), tn "
            "dividing intermediate (6) and tm a multiple of 8")):
        swiglu_gmm(x, w, jnp.array([8, 8]), tiling=(16, 32, 4))
    with monkeypatch.context() as m:  # on a TPU: whole (8, 128) tiles, or megablox
        m.setattr(jax, "default_backend", lambda: "tpu")
        with pytest.raises(ValueError, match=re.escape(
                "swiglu_gmm: on TPU the kernel's blocks are whole (8, 128) tiles: tn must be a "
                "multiple of 128 (so intermediate, 6, too) and tk one or all of hidden (32), got "
                "tiling (16, 32, 6); implementation='megablox' runs any shape")):
            swiglu_gmm(x, w, jnp.array([8, 8]))
    # the default tiling, clipped: tk and tn divide H and I (multiples of 128), tm the rows
    assert swiglu_tiling(32768, 7168, 2048) == (256, 1024, 1024)
    assert swiglu_tiling(32768, 2560, 1536) == (256, 640, 768)
    assert swiglu_tiling(32768, 2048, 768) == (256, 1024, 768)
    assert swiglu_tiling(20, 7168, 1024, (512, 2048, 512)) == (24, 1792, 512)


def test_megablox_tiling_is_clipped_and_divides_the_rows():
    from ep_comm.gemm import megablox_tiling
    assert megablox_tiling("forward", 32768, 4096, 4096) == (512, 1024, 1024)  # MaxText's
    assert megablox_tiling("forward", 32768, 2048, 2048) == (256, 2048, 1024)  # measured
    assert megablox_tiling("forward", 24, 16, 8) == (8, 16, 8)
    assert megablox_tiling("dlhs", 1000, 4096, 96, (512, 512, 512)) == (8, 512, 96)
    assert megablox_tiling("drhs", 640, 7168, 4096, (512, 1024, 2048)) == (128, 1024, 2048)
    assert megablox_tiling("drhs", 7, 64, 64) == (8, 64, 64)  # rows padded to one tile of 8


def test_grouped_matmul_per_pass_choice(rng):
    sizes = GROUPINGS["rows past the groups"]
    _check_against_ragged_dot(rng, sizes, "float32", {"forward": "xla", "drhs": "auto"},
                              rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_matmul_without_zeroing_the_tail_equals_it_on_the_groups(rng, dtype):
    """zero_past_groups=False (as moe_layer runs its second GEMM): the groups' rows and both
    gradients are those of the zeroing call (tokamax on a GPU, lax.ragged_dot elsewhere)."""
    x, w, gs, cot = _ragged_case(rng, GROUPINGS["rows past the groups"], dtype)
    total = int(np.sum(GROUPINGS["rows past the groups"]))

    def f(zero):
        def run(x, w):
            out, vjp = jax.vjp(lambda x, w: ep_comm.grouped_matmul(
                x, w, gs, zero_past_groups=zero), x, w)
            return (out[:total],) + vjp(cot)
        return jax.jit(run)(x, w)
    for name, g, r in zip(("out", "dx", "dw"), f(False), f(True)):
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(r, np.float64),
                                      err_msg=name)


def _raises(fn, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        fn()


def test_grouped_matmul_on_tpu_auto_is_megablox_from_128_up_and_tokamax_only_when_named(
        monkeypatch):
    """On a TPU (stood in for here: only the choice is checked, and tokamax's Mosaic TPU kernel
    as importable) ``auto`` is megablox for 16-bit inputs where K and N are 128 and up, at any
    number of rows (measured
    faster there than ``lax.ragged_dot`` and tokamax: docs/performance.md), ``lax.ragged_dot``
    below that and for float32; an explicit ``tokamax`` below 128 in any dimension raises, naming
    the shapes."""
    monkeypatch.setattr(gemm.jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(gemm, "tokamax_available", lambda: True)
    x = jnp.ones((6, 4), jnp.bfloat16)
    w = jnp.ones((3, 4, 5), jnp.bfloat16)
    gs = jnp.array([1, 2, 3], jnp.int32)
    assert gemm.resolve_implementation("auto", jnp.bfloat16) == "megablox"
    assert gemm.resolve_implementation("auto", jnp.float32) == "xla"
    assert gemm.resolve_implementation("tokamax", jnp.bfloat16) == "tokamax"
    big = jax.ShapeDtypeStruct((6, 128), jnp.bfloat16), jax.ShapeDtypeStruct((3, 128, 256),
                                                                              jnp.bfloat16)
    assert gemm.pass_implementations("auto", *big) == ("megablox",) * 3
    assert gemm.pass_implementations("auto", x, w) == ("xla",) * 3
    assert gemm.pass_implementations({"dlhs": "megablox"}, x, w) == ("xla", "megablox", "xla")
    want = jax.lax.ragged_dot(x, w, gs)
    np.testing.assert_array_equal(np.asarray(ep_comm.grouped_matmul(x, w, gs), np.float32),
                                  np.asarray(want, np.float32))
    _raises(lambda: ep_comm.grouped_matmul(x, w, gs, implementation="tokamax"),
            "grouped_matmul: implementation='tokamax' on TPU needs every dimension of x and w "
            ">= 128, got x (6, 4) and w (3, 4, 5)")


def test_grouped_matmul_rejects_bad_input():
    x = jnp.zeros((6, 4), jnp.float32)
    w = jnp.zeros((3, 4, 5), jnp.float32)
    gs = jnp.array([1, 2, 3], jnp.int32)
    gmm = ep_comm.grouped_matmul
    _raises(lambda: gmm(x[0], w, gs),
            "grouped_matmul: x must be a floating array of shape (rows, K), got float32 (4,)")
    _raises(lambda: gmm(x.astype(jnp.int32), w, gs),
            "grouped_matmul: x must be a floating array of shape (rows, K), got int32 (6, 4)")
    _raises(lambda: gmm(x, w[:, :3], gs),
            "grouped_matmul: w must be a floating array of shape (groups, K, N) with "
            "K = x.shape[1] = 4, got float32 (3, 3, 5)")
    _raises(lambda: gmm(x, w.astype(jnp.bfloat16), gs),
            "grouped_matmul: w must have x's dtype float32, got bfloat16")
    _raises(lambda: gmm(x, w, gs[:2]),
            "grouped_matmul: group_sizes must be an integer array of shape (groups,) = (3,), "
            "got int32 (2,)")
    _raises(lambda: gmm(x, w, gs.astype(jnp.float32)),
            "grouped_matmul: group_sizes must be an integer array of shape (groups,) = (3,), "
            "got float32 (3,)")
    _raises(lambda: gmm(x, w, gs, implementation="cublas"),
            "grouped_matmul: implementation must be one of ('auto', 'xla', 'tokamax', "
            "'cutlass', 'megablox'), got 'cublas'")
    _raises(lambda: gmm(x, w, gs, implementation={"backward": "xla"}),
            "grouped_matmul: implementation dict keys must be among ('forward', 'dlhs', "
            "'drhs'), got ['backward']")
    _raises(lambda: gmm(x, w, gs, implementation="tokamax"),
            "grouped_matmul: implementation='tokamax' needs tokamax (pip install 'ep_comm[gpu]', "
            f"jax >= 0.11.1, or 'ep_comm[tpu]'), which does not import here "
            f"({gemm.tokamax_unavailable_reason()})"
            if not gemm.tokamax_available() else
            "grouped_matmul: implementation='tokamax' takes bfloat16 or float16 inputs, "
            "got float32")
    _raises(lambda: gmm(x, w, gs, zero_past_groups=1),
            "grouped_matmul: zero_past_groups must be a bool, got int")
    if grouped_gemm.unavailable_reason() is not None:
        _raises(lambda: gmm(x, w, gs, implementation="cutlass"),
                "grouped_matmul: implementation='cutlass' does not run here: "
                + grouped_gemm.unavailable_reason())
    else:
        _raises(lambda: gmm(x, w, gs, implementation="cutlass"),
                "grouped_matmul: implementation='cutlass' takes bfloat16 or float16 inputs, "
                "got float32")
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        _raises(lambda: gmm(xb, wb, gs, implementation={"forward": "cutlass"}),
                "grouped_matmul: implementation='cutlass' (forward) cannot take x bfloat16 "
                "(6, 4) and w (3, 4, 5) with preferred_element_type=bfloat16: the kernel needs "
                "K and N to be multiples of 8, got K=4, N=5")


def test_auto_is_cutlass_per_pass_on_hopper_and_says_once_why_not(monkeypatch, caplog):
    """``"auto"`` on a Hopper GPU with 16-bit dtypes: the CUTLASS kernel for every pass whose
    operands it takes, the fallback for the others with a note, once, that says why; on a GPU
    where the kernel does not run, the fallback and why; with ``EP_COMM_AUTO_CUTLASS=0``, the
    fallback, silently. The layer's fused path runs only when named (``"cutlass-fused"``), and
    says what it cannot take. (The platform is simulated: this checks the choice, not the
    kernels.)"""
    from ep_comm import fused
    monkeypatch.setattr(gemm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gemm, "tokamax_available", lambda: False)
    monkeypatch.setattr(gemm.grouped_gemm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gemm, "_noted", set())
    bf = jnp.bfloat16
    x = jax.ShapeDtypeStruct((64, 16), bf)
    w, w12 = (jax.ShapeDtypeStruct((4, 16, n), bf) for n in (24, 12))
    w_in, w_out, w_out12 = (jax.ShapeDtypeStruct(s, bf)
                            for s in ((4, 16, 48), (4, 24, 16), (4, 12, 16)))
    cfg = ep_comm.EPConfig(axis_name="ep", num_ranks=2, num_experts=8, topk=2,
                           tokens_per_rank=16, capacity_factor=None)
    rows = cfg.expert_rows
    monkeypatch.setenv("EP_COMM_AUTO_CUTLASS", "0")
    with caplog.at_level(logging.WARNING, logger="ep_comm"):
        assert gemm.pass_implementations("auto", x, w) == ("xla",) * 3
    assert not caplog.records
    monkeypatch.setenv("EP_COMM_AUTO_CUTLASS", "yes")
    with pytest.raises(ValueError, match=re.escape(
            "EP_COMM_AUTO_CUTLASS must be 0 or 1, got 'yes'")):
        gemm.pass_implementations("auto", x, w)
    monkeypatch.delenv("EP_COMM_AUTO_CUTLASS")
    with caplog.at_level(logging.WARNING, logger="ep_comm"):
        assert gemm.pass_implementations("auto", x, w) == ("cutlass",) * 3
        assert gemm.pass_implementations({"drhs": "xla"}, x, w) == ("cutlass", "cutlass", "xla")
        f32 = jax.ShapeDtypeStruct((64, 16), jnp.float32)
        assert gemm.pass_implementations("auto", f32, f32) == ("xla",) * 3
        assert not caplog.records
        for _ in range(2):  # the second time: no note
            assert gemm.pass_implementations("auto", x, w12) == ("xla",) * 3
        for impl in ("auto", "cutlass", {"forward": "cutlass"}):  # the fused path: when named
            assert not fused.runs_fused(impl, cfg, 1, bf, w_in, w_out)
        assert fused.runs_fused(fused.FUSED, cfg, 1, bf, w_in, w_out)
        for chunks, other in ((2, {}), (1, dict(recv_capacity=32)),
                              (1, dict(wire_format="e4m3"))):
            c = dataclasses.replace(cfg, **other)
            with pytest.raises(ValueError, match=re.escape(
                    f"moe_layer: implementation='cutlass-fused' runs the layer as one chunk in "
                    f"one round without an FP8 wire (num_chunks=1, capacity_factor=None or a "
                    f"recv_capacity of the worst case, wire_format=None), got {chunks} "
                    f"chunk(s), expert_rows={c.expert_rows} of worst case "
                    f"{c.worst_case_rows}, wire_format={c.wire_format!r}")):
                fused.runs_fused(fused.FUSED, c, chunks, bf, w_in, w_out)
        with pytest.raises(ValueError, match=re.escape(
                f"moe_layer: implementation='cutlass-fused': implementation='cutlass' (forward) "
                f"cannot take x bfloat16 ({rows}, 16) and w (4, 16, 12) with "
                f"preferred_element_type=bfloat16: the kernel needs K and N to be multiples of "
                f"8, got K=16, N=12")):
            fused.runs_fused(fused.FUSED, cfg, 1, bf, w12, jax.ShapeDtypeStruct((4, 6, 16), bf))
        assert gemm.pass_implementations("auto", jax.ShapeDtypeStruct((rows, 12), bf),
                                         w_out12) == ("xla",) * 3  # w_out's K=12: noted
    why = "the kernel needs K and N to be multiples of 8, got K=16, N=12"
    want = [f"ep_comm: implementation='auto' runs 'xla' for the {p} pass of x bfloat16 (64, 16) "
            f"and w (4, 16, 12), not the CUTLASS grouped GEMM: {why}" for p in gemm.PASSES]
    want += [f"ep_comm: implementation='auto' runs 'xla' for the {p} pass of x bfloat16 "
             f"({rows}, 12) and w (4, 12, 16), not the CUTLASS grouped GEMM: the kernel needs K "
             f"and N to be multiples of 8, got K=12, N=16" for p in gemm.PASSES]
    assert [r.getMessage() for r in caplog.records] == want
    caplog.clear()
    why = "its kernels are sm_90a (Hopper), and this GPU's compute capability is 8.0"
    monkeypatch.setattr(gemm.grouped_gemm, "unavailable_reason", lambda: why)
    with caplog.at_level(logging.WARNING, logger="ep_comm"):
        for _ in range(2):
            assert gemm.pass_implementations("auto", x, w) == ("xla",) * 3
    assert [r.getMessage() for r in caplog.records] == [
        f"ep_comm: implementation='auto' does not run ep_comm's CUTLASS grouped GEMM here "
        f"({why}); it runs 'xla'"]


def test_grouped_gemm_rules():
    """The engine's call checks what its kernel takes before asking whether it runs here."""
    a = jax.ShapeDtypeStruct((6, 16), jnp.float32)
    b = jax.ShapeDtypeStruct((3, 16, 8), jnp.float32)
    assert grouped_gemm.unsupported("forward", a, b, jnp.float32) == (
        "the kernel takes bfloat16 or float16 operands of one dtype, got float32 and float32")
    a16, b16 = (jax.ShapeDtypeStruct(v.shape, jnp.bfloat16) for v in (a, b))
    assert grouped_gemm.unsupported("forward", a16, b16, jnp.bfloat16) is None
    assert grouped_gemm.unsupported("forward", a16, b16, jnp.float32) == (
        "the kernel writes the inputs' dtype bfloat16, not float32")
    dy = jax.ShapeDtypeStruct((6, 12), jnp.bfloat16)
    assert grouped_gemm.unsupported("drhs", a16, dy, jnp.bfloat16) == (
        "the kernel needs K and N to be multiples of 8, got K=16, N=12")
    assert grouped_gemm.out_shape("dlhs", (6, 8), (3, 16, 8), 3) == (6, 16)
    assert grouped_gemm.out_shape("drhs", (6, 16), (6, 8), 3) == (3, 16, 8)
    with pytest.raises(ValueError, match=re.escape(
            "grouped_gemm: pass_name must be one of ('forward', 'dlhs', 'drhs'), got 'bwd'")):
        grouped_gemm.grouped_gemm("bwd", jnp.zeros((6, 16), jnp.bfloat16),
                                  jnp.zeros((3, 16, 8), jnp.bfloat16), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=re.escape(
            "grouped_gemm: group_sizes must hold at most 65535 groups, got 65536")):
        grouped_gemm.grouped_gemm("drhs", jnp.zeros((6, 16), jnp.bfloat16),
                                  jnp.zeros((6, 8), jnp.bfloat16), jnp.zeros(65536, jnp.int32))
    with pytest.raises(ValueError, match=re.escape(
            "grouped_gemm: config must be one of (0, 1, 2, 3, 4), got 5")):
        grouped_gemm.grouped_gemm("drhs", jnp.zeros((6, 16), jnp.bfloat16),
                                  jnp.zeros((6, 8), jnp.bfloat16), jnp.zeros(3, jnp.int32),
                                  config=5)
    if grouped_gemm.unavailable_reason() is not None:
        with pytest.raises(RuntimeError, match=re.escape(
                "grouped_gemm: the CUTLASS grouped GEMM does not run here: "
                + grouped_gemm.unavailable_reason())):
            grouped_gemm.grouped_gemm("forward", jnp.zeros((6, 16), jnp.bfloat16),
                                      jnp.zeros((3, 16, 8), jnp.bfloat16), jnp.zeros(3, jnp.int32))


@CUTLASS
@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grouped_matmul_cutlass_equals_ragged_dot_with_gradients(rng, grouping, dtype):
    _check_against_ragged_dot(rng, GROUPINGS[grouping], dtype, "cutlass", rtol=2 ** -7)


@pytest.mark.parametrize("impl", [pytest.param("tokamax", marks=TOKAMAX),
                                  pytest.param("cutlass", marks=CUTLASS), "megablox"])
def test_grouped_matmul_kernels_inside_shard_map_with_gradients(sharded, n, rng, impl):
    """The GPU kernels inside shard_map, where check_vma types every value: values and both
    gradients against lax.ragged_dot in the same shard_map, each device its own groups.
    (tokamax's Mosaic GPU kernel failed there on jax 0.11.2, on an H200, while it was traced
    with the checks off as the TPU kernel is.)"""
    sizes = GROUPINGS["uneven with empty groups"]
    G, M, Kd, N = len(sizes), 24, 16, 8
    bf = lambda a: np.asarray(a, jnp.bfloat16)  # noqa: E731
    x, w = bf(rng.standard_normal((n * M, Kd))), bf(rng.standard_normal((n * G, Kd, N)) / 4)
    cot = rng.standard_normal((n * M, N)).astype(np.float32)
    gs = np.tile(np.asarray(sizes, np.int32), n)

    def run(gemm_fn, dtype):
        def f(x, w, gs, cot):
            loss = lambda x, w: jnp.sum(gemm_fn(x, w, gs).astype(jnp.float32) * cot)  # noqa
            return (gemm_fn(x, w, gs),) + jax.grad(loss, argnums=(0, 1))(x, w)
        return sharded.get(sharded.smap(f)(*sharded.put(
            x.astype(dtype), w.astype(dtype), gs, cot)))

    got = run(functools.partial(ep_comm.grouped_matmul, implementation=impl), jnp.bfloat16)
    want = run(jax.lax.ragged_dot, np.float32)  # the same bf16-rounded inputs
    in_groups = np.arange(n * M) % M < sum(sizes)
    for name, g, r in zip(("out", "dx", "dw"), got, want):
        assert g.dtype == jnp.bfloat16, name
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        rows = slice(None) if name == "dw" else in_groups
        np.testing.assert_allclose(g[rows], r[rows], rtol=2 ** -7,
                                   atol=2 ** -7 * (1 + np.abs(r).max()), err_msg=name)


@CUTLASS
@pytest.mark.parametrize("config", grouped_gemm.CONFIGS)
def test_grouped_gemm_every_tile_config_equals_the_dense_product(rng, config):
    """Each pass with each compiled tile config, at sizes that are not multiples of a tile."""
    sizes = np.array([130, 0, 1, 257], np.int32)  # 388 of 400 rows
    x = jnp.asarray(rng.standard_normal((400, 136)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 136, 264)) / 8, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((400, 264)), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    want = _dense_grouped(x, w, sizes, dy)
    got = (grouped_gemm.grouped_gemm("forward", x, w, gs, config=config),
           grouped_gemm.grouped_gemm("dlhs", dy, w, gs, config=config),
           grouped_gemm.grouped_gemm("drhs", x, dy, gs, config=config))
    for name, g, ref in zip(("forward", "dlhs", "drhs"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=2 ** -7,
                                   atol=2 ** -7 * (1 + np.abs(ref).max()), err_msg=name)


@CUTLASS
@pytest.mark.parametrize("name", ["selftest", "fused_selftest"])
def test_grouped_gemm_cutlass_selftests(name):
    """The kernels on malformed and well-formed group sizes and indices outside XLA (what
    compute-sanitizer runs): compiled into _ep_gemm by test builds only (EP_COMM_SELFTESTS)."""
    from ep_comm.collectives import bootstrap
    run = getattr(bootstrap.load("gemm")[0], name, None)
    if run is None:
        pytest.skip("_ep_gemm was built without its selftests (cmake -DEP_COMM_SELFTESTS=ON)")
    assert run() == 0


@CUTLASS
def test_grouped_gemm_cutlass_determinism(rng):
    """The same inputs giving the same bits twice, at a shape of several tiles and ragged
    groups."""
    sizes = jnp.array([300, 0, 1, 700, 129, 0, 2000], jnp.int32)  # 3130 of 3200 rows
    x = jnp.asarray(rng.standard_normal((3200, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((7, 512, 384)) / 16, jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((3200, 384)), jnp.bfloat16)
    def f(x, w):
        out, vjp = jax.vjp(lambda x, w: ep_comm.grouped_matmul(
            x, w, sizes, implementation="cutlass"), x, w)
        return (out,) + vjp(cot)
    f = jax.jit(f)
    first, second = f(x, w), f(x, w)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    want = _dense_grouped(x, w, np.asarray(sizes), cot)
    for got, ref, name in zip(first, want, ("out", "dx", "dw")):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2 ** -7,
                                   atol=2 ** -7 * (1 + np.abs(ref).max()), err_msg=name)


def _fused_case(rng, sizes, M, X=96, K=200, N=384, dtype=jnp.bfloat16):
    """Operands of the fused forward pass: K and N tails in every tile, indices outside [0, X)."""
    x = jnp.asarray(rng.standard_normal((X, K)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / np.sqrt(K), dtype)
    index = jnp.asarray(rng.integers(-2, X + 2, size=M), jnp.int32)
    scale = jnp.asarray(rng.random(M), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), index, scale


def test_fused_forward_reference_is_the_unfused_passes(rng):
    """The fused pass's reference (what the kernel is checked against) is gather, grouped GEMM,
    then SwiGLU or the row scale, with the kernel's clamping of malformed sizes and indices."""
    sizes = [7, -3, 500, 9]  # a negative size and a total past M: clamped to 7, 0, 143, 0
    x, w, gs, index, scale = _fused_case(rng, sizes, 150, dtype=jnp.float32)
    idx = np.asarray(index)
    rows = np.where(((idx >= 0) & (idx < x.shape[0]))[:, None],
                    np.asarray(x, np.float64)[np.clip(idx, 0, x.shape[0] - 1)], 0)
    acc = np.zeros((150, w.shape[2]))
    w64 = np.asarray(w, np.float64)
    acc[:7] = rows[:7] @ w64[0]
    acc[7:150] = rows[7:150] @ w64[2]
    I = w.shape[2] // 2
    want = {"store": acc, "scale": acc * np.asarray(scale)[:, None],
            "swiglu": acc[:, :I] / (1 + np.exp(-acc[:, :I])) * acc[:, I:]}
    for epilogue in grouped_gemm.EPILOGUES:
        got = grouped_gemm.fused_forward_reference(
            x, w, gs, index=index, epilogue=epilogue,
            scale=scale if epilogue == "scale" else None)
        np.testing.assert_allclose(np.asarray(got, np.float64), want[epilogue], rtol=1e-5,
                                   atol=1e-5, err_msg=epilogue)
    # the gathered weight gradient's reference: the gathered rows' grouped x^T dy
    dy = jnp.asarray(rng.standard_normal((150, 24)), jnp.float32)
    got = grouped_gemm.gathered_drhs_reference(x, dy, gs, index=index)
    dy64 = np.asarray(dy, np.float64)
    want_dw = np.stack([rows[:7].T @ dy64[:7], np.zeros((x.shape[1], 24)),
                        rows[7:150].T @ dy64[7:150], np.zeros((x.shape[1], 24))])
    np.testing.assert_allclose(np.asarray(got, np.float64), want_dw, rtol=1e-5, atol=1e-4)
    # the dSwiGLU dlhs's reference: dh_w = dy . w_out^T, du from u, the weights' gradient
    M, I2 = 150, 16
    dyd = jnp.asarray(rng.standard_normal((M, 24)), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((4, I2, 24)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((M, 2 * I2)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((M, I2)), jnp.float32)
    du, d_scale = grouped_gemm.dswiglu_dlhs_reference(dyd, w_out, gs, u, h, scale)
    dh_w = np.zeros((M, I2))
    w64 = np.asarray(w_out, np.float64)
    dh_w[:7] = np.asarray(dyd, np.float64)[:7] @ w64[0].T
    dh_w[7:] = np.asarray(dyd, np.float64)[7:] @ w64[2].T
    gate, upv = np.asarray(u, np.float64)[:, :I2], np.asarray(u, np.float64)[:, I2:]
    sig = 1 / (1 + np.exp(-gate))
    dh = dh_w * np.asarray(scale, np.float64)[:, None]
    want_du = np.concatenate([dh * upv * sig * (1 + gate * (1 - sig)), dh * gate * sig], 1)
    np.testing.assert_allclose(np.asarray(du, np.float64), want_du, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(d_scale, np.float64),
                               np.sum(dh_w * np.asarray(h, np.float64), 1), rtol=1e-4, atol=1e-4)
    # without an index, row r reads x's row r; rows past the groups are zero
    got = grouped_gemm.fused_forward_reference(x, w, jnp.array([3, 0, 2, 0]))
    np.testing.assert_allclose(np.asarray(got)[5:], 0)
    np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(x)[:3] @ np.asarray(w)[0],
                               rtol=1e-5, atol=1e-5)


def test_fused_forward_rules():
    """The fused pass checks what its kernel takes (naming the argument) before asking whether
    it runs here."""
    xb, wb = jnp.zeros((6, 16), jnp.bfloat16), jnp.zeros((3, 16, 24), jnp.bfloat16)
    gs = jnp.zeros(3, jnp.int32)
    cases = [
        (dict(epilogue="gelu"), ValueError,
         "fused_forward: epilogue must be one of ('store', 'swiglu', 'scale'), got 'gelu'"),
        (dict(epilogue="swiglu", config=1), ValueError,
         "fused_forward: config must be one of (0, 1, 2) (0 or 2 with swiglu), got 1"),
        (dict(epilogue="swiglu"), ValueError,
         "fused_forward: swiglu needs N = 2I with I a multiple of 8, got N=24"),
        (dict(epilogue="scale", index=jnp.zeros(4, jnp.int32)), ValueError,
         "fused_forward: the scale epilogue takes scale of shape (4,), got None"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=re.escape(msg)):
            grouped_gemm.fused_forward(xb, wb, gs, **kw)
    with pytest.raises(ValueError, match=re.escape(
            "fused_forward: x (X, K), w (G, K, N) and group_sizes (G,) must fit, got x (6, 16), "
            "w (3, 8, 24), group_sizes (3,)")):
        grouped_gemm.fused_forward(xb, jnp.zeros((3, 8, 24), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=re.escape(
            "fused_forward: the kernel takes bfloat16 or float16 operands of one dtype, got "
            "float32 and bfloat16")):
        grouped_gemm.fused_forward(xb.astype(jnp.float32), wb, gs)
    if grouped_gemm.unavailable_reason() is not None:
        with pytest.raises(RuntimeError, match=re.escape(
                "fused_forward: the CUTLASS grouped GEMM does not run here: "
                + grouped_gemm.unavailable_reason())):
            grouped_gemm.fused_forward(xb, wb, gs)
    with pytest.raises(ValueError, match=re.escape(
            "gathered_drhs: x (X, K), dy (M, N) and index (M,) must fit, got x (6, 16), dy (5, "
            "24), index (4,)")):
        grouped_gemm.gathered_drhs(xb, jnp.zeros((5, 24), jnp.bfloat16), gs,
                                   index=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=re.escape(
            "gathered_drhs: the kernel needs K and N to be multiples of 8, got K=16, N=12")):
        grouped_gemm.gathered_drhs(xb, jnp.zeros((6, 12), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=re.escape(
            "dswiglu_dlhs: dy (M, H), w_out (G, I, H), u (M, 2I), h (M, I) and scale (M,) must "
            "fit, got dy (6, 16), w_out (3, 8, 16), u (6, 8), h (6, 8), scale (6,)")):
        grouped_gemm.dswiglu_dlhs(xb, jnp.zeros((3, 8, 16), jnp.bfloat16), gs,
                                  jnp.zeros((6, 8), jnp.bfloat16), jnp.zeros((6, 8), jnp.bfloat16),
                                  jnp.zeros(6, jnp.float32))
    with pytest.raises(ValueError, match=re.escape(
            "gathered_drhs: config must be one of (0, 1), got 3")):
        grouped_gemm.gathered_drhs(xb, jnp.zeros((6, 24), jnp.bfloat16), gs, config=3)


@CUTLASS
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fused_forward_kernel_equals_its_reference(rng, dtype):
    """The fused kernel (gathered rows, each epilogue and tile config) and the gathered weight
    gradient against their references at malformed sizes and indices, and the same bits twice.
    The last case has more tiles than an H200 has SMs (the forward's about 200, the weight
    gradient's 160), so a persistent CTA walks on to a second."""
    for sizes, M in (([40, 0, 131, 1, 9], 181), ([7, -3, 500, 9, 2], 150), ([0] * 5, 64),
                     ([3000, 0, 5000, 1, 4000], 12100)):
        x, w, gs, index, scale = _fused_case(rng, sizes, M, dtype=jnp.dtype(dtype))
        for epilogue in grouped_gemm.EPILOGUES:
            kw = dict(index=index, epilogue=epilogue,
                      scale=scale if epilogue == "scale" else None)
            want = np.asarray(grouped_gemm.fused_forward_reference(x, w, gs, **kw), np.float64)
            for config in grouped_gemm.FUSED_CONFIGS if epilogue != "swiglu" else (0, 2):
                run = jax.jit(lambda *a, c=config, kw=kw: grouped_gemm.fused_forward(
                    *a, config=c, **kw))
                got, again = run(x, w, gs), run(x, w, gs)
                np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                              np.asarray(again).view(np.uint16))
                np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7,
                                           atol=2 ** -7 * (1 + np.abs(want).max()),
                                           err_msg=f"{epilogue} config {config} sizes {sizes}")
        # the dSwiGLU dlhs (w: (G, I=192, K=200) as w_out, read K-major)
        I2 = w.shape[2] // 2
        w_out = jnp.asarray(rng.standard_normal((len(sizes), I2, x.shape[1])) / 16,
                            jnp.dtype(dtype))
        dyk = jnp.asarray(rng.standard_normal((M, x.shape[1])), jnp.dtype(dtype))
        u = jnp.asarray(rng.standard_normal((M, 2 * I2)), jnp.dtype(dtype))
        h = jnp.asarray(rng.standard_normal((M, I2)), jnp.dtype(dtype))
        want_du, want_ds = (np.asarray(a, np.float64) for a in
                            grouped_gemm.dswiglu_dlhs_reference(dyk, w_out, gs, u, h, scale))
        rows_in = int(np.minimum(np.cumsum(np.clip(sizes, 0, None)), M)[-1])
        for config in grouped_gemm.FUSED_BACKWARD_CONFIGS:
            du, part = grouped_gemm.dswiglu_dlhs(dyk, w_out, gs, u, h, scale, config=config)
            np.testing.assert_allclose(np.asarray(du, np.float64)[:rows_in], want_du[:rows_in],
                                       rtol=2 ** -6, atol=2 ** -6 * (1 + np.abs(want_du).max()),
                                       err_msg=f"dswiglu du config {config} sizes {sizes}")
            np.testing.assert_allclose(np.asarray(part, np.float64)[:rows_in].sum(1),
                                       want_ds[:rows_in], rtol=2 ** -6,
                                       atol=2 ** -6 * (1 + np.abs(want_ds).max()),
                                       err_msg=f"dswiglu part config {config} sizes {sizes}")
        # (in the last case, 8 x 4 output tiles of 5 groups: more than the SMs)
        xd = x if M < 1000 else jnp.asarray(rng.standard_normal((96, 1024)), jnp.dtype(dtype))
        dy = jnp.asarray(rng.standard_normal((M, 136 if M < 1000 else 1024)), jnp.dtype(dtype))
        want = np.asarray(grouped_gemm.gathered_drhs_reference(xd, dy, gs, index=index),
                          np.float64)
        for config in grouped_gemm.FUSED_BACKWARD_CONFIGS:
            got = grouped_gemm.gathered_drhs(xd, dy, gs, index=index, config=config)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7,
                                       atol=2 ** -7 * (1 + np.abs(want).max()),
                                       err_msg=f"gathered drhs config {config} sizes {sizes}")


# ---- moe_layer -----------------------------------------------------------------------------------

def layer_config(n, **kw):
    return ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=4 * n, topk=K,
                            tokens_per_rank=T, **kw)


def layer_inputs(rng, n, kind, H=H, I=I):
    """The layer's inputs (hidden ``H`` and SwiGLU width ``I``: the module's, or multiples of 8
    where the CUTLASS kernel runs)."""
    E = 4 * n
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    ids = routing(rng, kind, n, T, K, E)
    w = rng.random((n * T, K)).astype(np.float32)
    w_in = (rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    s_in = (rng.standard_normal((H, 2 * I_SHARED)) / np.sqrt(H)).astype(np.float32)
    s_out = (rng.standard_normal((I_SHARED, H)) / np.sqrt(I_SHARED)).astype(np.float32)
    cot = rng.standard_normal((n * T, H)).astype(np.float32)
    return x, ids, w, w_in, w_out, s_in, s_out, cot


@functools.lru_cache(maxsize=None)
def layer_program(sharded, cfg, shared: bool):
    """moe_layer's output and its gradients in x, the router weights and every weight."""
    from jax.sharding import PartitionSpec as P

    def layer(x, ids, w, w_in, w_out, s_in, s_out):
        return ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                                 shared_w_in=s_in if shared else None,
                                 shared_w_out=s_out if shared else None)

    def f(x, ids, w, w_in, w_out, s_in, s_out, cot):
        def loss(x, w, w_in, w_out, s_in, s_out):
            return jax.lax.psum(jnp.sum(layer(x, ids, w, w_in, w_out, s_in, s_out) * cot), "ep")
        grads = jax.grad(loss, argnums=tuple(range(6)))(x, w, w_in, w_out, s_in, s_out)
        return (layer(x, ids, w, w_in, w_out, s_in, s_out),) + grads

    # shared weights are replicated: their gradient is the psum'd loss's, the same on every rank
    specs = (P("ep"),) * 5 + (P(), P(), P("ep"))
    out_specs = (P("ep"),) * 5 + (P(), P())
    return jax.jit(jax.shard_map(f, mesh=sharded.mesh, in_specs=specs, out_specs=out_specs))


def dense_reference(x, ids, w, w_in, w_out, s_in, s_out, cot, shared):
    """Float64: the dense layer's output and gradients (x, w, w_in, w_out, s_in, s_out)."""
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)
        args = [f64(a) for a in (x, w, w_in, w_out, s_in, s_out)]

        def loss(x, w, w_in, w_out, s_in, s_out):
            y = dense_swiglu_moe(x, jnp.asarray(ids), w, w_in, w_out,
                                 s_in if shared else None, s_out if shared else None)
            return jnp.sum(y * f64(cot)), y
        grads, y = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*args)
        return [np.asarray(a) for a in (y, *grads)]


@pytest.mark.parametrize("kind,shared", [
    # under mpirun (scripts/run.sh test) one of them: the cross-process paths are the same
    pytest.param("random", True, marks=pytest.mark.multiprocess), ("skewed", False),
    ("masked", True), ("one_expert", False)])
def test_layer_equals_dense_float64_with_gradients(sharded, n, rng, kind, shared):
    x, ids, w, w_in, w_out, s_in, s_out, cot = layer_inputs(rng, n, kind)
    cfg = layer_config(n)
    rows = sharded.put(x, ids, w, w_in, w_out)
    got = sharded.get(layer_program(sharded, cfg, shared)(
        *rows, sharded.put_replicated(s_in), sharded.put_replicated(s_out), sharded.put(cot)))
    want = dense_reference(x, ids, w, w_in, w_out, s_in, s_out, cot, shared)
    names = ("y", "d x", "d topk_weights", "d w_in", "d w_out", "d shared_w_in",
             "d shared_w_out")
    for name, g, r in zip(names, got, want):
        assert g.shape == r.shape, name
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)
    if not shared:
        np.testing.assert_array_equal(got[5], 0.0)


@INTERPRETED
def test_layer_with_the_swiglu_kernel_equals_dense_float64(sharded, n, rng):
    """``implementation="megablox-swiglu"``: the up projection's forward in the Pallas kernel
    with SwiGLU in its epilogue (interpret mode off TPU), megablox for the down projection; the
    dense layer's values inside shard_map. (Its gradients are the unfused megablox path's VJP:
    test_swiglu_kernel_equals_the_unfused_up_projection_with_gradients.)"""
    from jax.sharding import PartitionSpec as P

    x, ids, w, w_in, w_out = layer_inputs(rng, n, "masked")[:5]
    cfg = layer_config(n)
    f = jax.jit(jax.shard_map(
        lambda x, ids, w, w_in, w_out: ep_comm.moe_layer(
            x, ids, w, cfg, w_in=w_in, w_out=w_out, implementation="megablox-swiglu"),
        mesh=sharded.mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
    got = sharded.get(f(*sharded.put(x, ids, w, w_in, w_out)))
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731
        want = np.asarray(dense_swiglu_moe(f64(x), jnp.asarray(ids), f64(w), f64(w_in),
                                           f64(w_out), None, None))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * (1 + np.abs(want).max()))


@functools.lru_cache(maxsize=None)
def fused_program(sharded, cfg, keep_u=False):
    """The fused path (reference kernels; ``keep_u`` as fused_moe's) and its gradients in x, the
    router weights, w_in and w_out."""
    from jax.sharding import PartitionSpec as P
    from ep_comm import fused

    def f(x, ids, w, w_in, w_out, cot):
        def loss(x, w, w_in, w_out):
            y = fused.fused_moe(x, ids, w, cfg, w_in, w_out, kernel="reference",
                                keep_u=keep_u)[0]
            return jax.lax.psum(jnp.sum(y * cot), "ep"), y
        grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, w_in, w_out)
        return (y,) + grads

    return jax.jit(jax.shard_map(f, mesh=sharded.mesh, in_specs=(P("ep"),) * 6,
                                 out_specs=(P("ep"),) * 5))


@pytest.mark.parametrize("kind,keep_u", [("masked", False), ("one_rank", True)])
def test_fused_path_equals_dense_float64_with_gradients(sharded, n, rng, kind, keep_u):
    """The layer's fused path (dispatch stopping at the receive buffer, the gather and SwiGLU in
    the up projection, the router weights in the down projection, combine summing unit-weight
    rows; its custom VJP, recomputing the up projection or keeping it), run with the fused
    kernel's reference: the dense layer's values and gradients, repeated experts in a token
    ("one_rank") and empty slots ("masked") included."""
    x, ids, w, w_in, w_out, s_in, s_out, cot = layer_inputs(rng, n, kind)
    cfg = layer_config(n, capacity_factor=None)  # one round: the fused path's case
    got = sharded.get(fused_program(sharded, cfg, keep_u)(
        *sharded.put(x, ids, w, w_in, w_out, cot)))
    want = dense_reference(x, ids, w, w_in, w_out, s_in, s_out, cot, False)
    for name, g, r in zip(("y", "d x", "d topk_weights", "d w_in", "d w_out"), got, want):
        assert g.shape == r.shape, name
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * (1 + np.abs(r).max()),
                                   err_msg=name)
    if kind == "masked" and grouped_gemm.unavailable_reason() is not None:
        # moe_layer takes this path with implementation="cutlass-fused", which says where it
        # runs
        def layer(x, ids, w, w_in, w_out):
            return ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                                     implementation="cutlass-fused")
        from jax.sharding import PartitionSpec as P
        with pytest.raises(ValueError, match=re.escape(
                "moe_layer: implementation='cutlass-fused': implementation='cutlass' does not "
                "run here: " + grouped_gemm.unavailable_reason())):
            jax.jit(jax.shard_map(layer, mesh=sharded.mesh, in_specs=(P("ep"),) * 5,
                                  out_specs=P("ep")))(*sharded.put(x, ids, w, w_in, w_out))


def test_fused_moe_names_a_bad_argument(n):
    """fused_moe's own arguments, checked before anything is traced."""
    from ep_comm import fused
    cfg, z = layer_config(n, capacity_factor=None), jnp.zeros((T, H), jnp.bfloat16)
    for kw, msg in ((dict(kernel="tma"), "fused_moe: kernel must be one of ('cutlass', "
                     "'reference'), got 'tma'"),
                    (dict(keep_u=1), "fused_moe: keep_u must be a bool, got 1"),
                    (dict(forward_config=1), "fused_moe: forward_config must be 0 or 2, got 1")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            fused.fused_moe(z, None, None, cfg, None, None, **kw)


@CUTLASS
def test_fused_path_cutlass_equals_its_reference_bf16(sharded, n, rng):
    """moe_layer(implementation="cutlass-fused") runs the fused path on Hopper: the fused kernels'
    values and gradients against the same path with the kernels' plain-JAX reference, bf16; and
    the same with the up projection kept for the backward (``keep_u``) and with w's tiles by
    TMA (forward config 2)."""
    from jax.sharding import PartitionSpec as P
    from ep_comm import fused
    # (H and I multiples of 8, as the kernel takes them; each narrower than one tile)
    x, ids, w, w_in, w_out, _, _, cot = layer_inputs(rng, n, "one_rank", H=16, I=24)
    bf = lambda *a: [jnp.asarray(v, jnp.bfloat16) for v in a]  # noqa: E731
    x, w_in, w_out, cot = bf(x, w_in, w_out, cot)
    cfg = layer_config(n, capacity_factor=None)

    def run(kernel, keep_u=False, forward_config=fused.FORWARD_CONFIG):
        def f(x, ids, w, w_in, w_out, cot):
            def loss(x, w, w_in, w_out):
                if kernel == "cutlass" and not keep_u and forward_config == fused.FORWARD_CONFIG:
                    y = ep_comm.moe_layer(x, ids, w, cfg, w_in=w_in, w_out=w_out,
                                          implementation="cutlass-fused")
                else:
                    y = fused.fused_moe(x, ids, w, cfg, w_in, w_out, kernel=kernel,
                                        keep_u=keep_u, forward_config=forward_config)[0]
                return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * cot), "ep"), y
            grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, w_in, w_out)
            return (y,) + grads
        return sharded.get(jax.jit(jax.shard_map(
            f, mesh=sharded.mesh, in_specs=(P("ep"),) * 6, out_specs=(P("ep"),) * 5))(
                *sharded.put(x, ids, w, w_in, w_out, cot)))

    want = run("reference")
    for keep_u, config in ((False, fused.FORWARD_CONFIG), (True, 0), (False, 2)):
        for name, g, r in zip(("y", "d x", "d topk_weights", "d w_in", "d w_out"),
                              run("cutlass", keep_u, config), want):
            g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
            np.testing.assert_allclose(g, r, rtol=2 ** -6, atol=2 ** -6 * (1 + np.abs(r).max()),
                                       err_msg=f"keep_u={keep_u}, config {config}: {name}")


def test_layer_user_experts_and_handle(sharded, n, rng):
    """experts= gets expert_x and group_sizes; return_handle gives dispatch's handle (one
    worst-case round: capacity_factor=None)."""
    x, ids, w, w_in, w_out, *_ = layer_inputs(rng, n, "random")
    cfg = layer_config(n, capacity_factor=None)
    W = (rng.standard_normal((4 * n, H, H)) / np.sqrt(H)).astype(np.float32)

    def f(x, ids, w, W_local):
        out = ep_comm.moe_layer(
            x, ids, w, cfg, return_handle=True,
            experts=lambda ex, gs: ep_comm.grouped_matmul(ex, W_local, gs))
        return out.y, out.handle.group_sizes, out.handle.num_dropped

    y, gs, dropped = sharded.get(sharded.smap(f)(*sharded.put(x, ids, w, W)))
    with jax.enable_x64(True):
        want = 0.0
        for k in range(K):
            want = want + w[:, k:k + 1].astype(np.float64) * np.einsum(
                "th,thf->tf", x.astype(np.float64), W.astype(np.float64)[ids[:, k]])
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    L = cfg.experts_per_rank
    np.testing.assert_array_equal(gs, np.bincount(ids.reshape(-1), minlength=4 * n).reshape(
        n * L))
    np.testing.assert_array_equal(dropped, 0)


def test_layer_rejects_bad_input(sharded, n):
    cfg = layer_config(n)
    L = cfg.experts_per_rank
    x = jnp.zeros((T, H), jnp.float32)
    ids = jnp.zeros((T, K), jnp.int32)
    w = jnp.zeros((T, K), jnp.float32)
    w_in = jnp.zeros((L, H, 2 * I), jnp.float32)
    w_out = jnp.zeros((L, I, H), jnp.float32)

    def raises(message, **kw):
        args = dict(x=x, w_in=w_in, w_out=w_out) | kw
        f = sharded.smap(lambda *_: ep_comm.moe_layer(args.pop("x"), ids, w, cfg, **args))
        _raises(lambda: f(sharded.put(np.zeros((n * T, H), np.float32))), message)

    raises(f"moe_layer: w_in must have shape (experts_per_rank = num_experts / num_ranks, hidden, "
           f"2 * intermediate) = ({L}, {H}, {2 * I}), got ({L + 1}, {H}, {2 * I})",
           w_in=jnp.zeros((L + 1, H, 2 * I), jnp.float32))
    raises(f"moe_layer: w_in must have shape (experts_per_rank = num_experts / num_ranks, hidden, "
           f"2 * intermediate) = ({L}, {H}, {2 * I}), got ({L}, {H + 1}, {2 * I})",
           w_in=jnp.zeros((L, H + 1, 2 * I), jnp.float32))
    raises("moe_layer: w_in must have shape (experts_per_rank, hidden, 2 * intermediate), "
           f"got ({L}, {H}, 7)", w_in=jnp.zeros((L, H, 7), jnp.float32))
    raises(f"moe_layer: w_out must have shape (experts_per_rank, intermediate, hidden) = "
           f"({L}, {I}, {H}), got ({L}, {I}, {H - 1})", w_out=jnp.zeros((L, I, H - 1), jnp.float32))
    raises("moe_layer: w_in must have x's dtype float32, got bfloat16",
           w_in=w_in.astype(jnp.bfloat16))
    raises("moe_layer: w_out must have x's dtype float32, got float16",
           w_out=w_out.astype(jnp.float16))
    raises("moe_layer: x must be a floating array of shape (tokens_per_rank, hidden), "
           f"got int32 ({T}, {H})", x=x.astype(jnp.int32))
    raises(f"moe_layer: x must have shape (tokens_per_rank, hidden) = ({T}, {H}) (hidden as "
           f"w_in and w_out have it), got ({T}, {H + 3})", x=jnp.zeros((T, H + 3), jnp.float32))
    raises("moe_layer: pass the SwiGLU weights w_in and w_out, or experts=; got w_in=set, "
           "w_out=None", w_out=None)
    raises("moe_layer: pass either experts= or the SwiGLU weights w_in/w_out, not both",
           experts=lambda ex, gs: ex)
    rows = ep_comm.pipeline.chunk_config(cfg, 1).expert_rows  # the layer's buffer
    raises("moe_layer: experts must return expert_y of shape (expert_rows, hidden) = "
           f"({rows}, {H}), got ({rows}, {H + 1})", w_in=None, w_out=None,
           experts=lambda ex, gs: jnp.zeros((ex.shape[0], H + 1), ex.dtype))
    raises("moe_layer: the shared expert needs both shared_w_in and shared_w_out",
           shared_w_in=jnp.zeros((H, 2 * I), jnp.float32))
    raises(f"moe_layer: shared_w_out must have shape (intermediate, hidden) = ({I}, {H}), "
           f"got ({I}, {H + 2})", shared_w_in=jnp.zeros((H, 2 * I), jnp.float32),
           shared_w_out=jnp.zeros((I, H + 2), jnp.float32))
    with pytest.raises(TypeError, match=re.escape(
            "moe_layer: config must be an ep_comm.EPConfig, got dict")):
        ep_comm.moe_layer(x, ids, w, {}, w_in=w_in, w_out=w_out)


# ---- the Flax NNX module -------------------------------------------------------------------------

@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_nnx_module_equals_dense_float64_with_gradients(n, rng, axis_type):
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE

    if jax.process_count() > 1:
        pytest.skip("the dense reference reads every parameter on this process")
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    m = MoE(H, I, 4 * n, K, mesh=mesh, shared_intermediate=I_SHARED,
            rngs=nnx.Rngs(int(rng.integers(2**31))))
    x = rng.standard_normal((2, 4 * n, H)).astype(np.float32)  # (batch, seq, hidden)
    cot = rng.standard_normal(x.shape).astype(np.float32)

    @nnx.jit
    def value_and_grads(m, x):
        return m(x), nnx.grad(lambda m: jnp.sum(m(x) * cot))(m)

    y, g = value_and_grads(m, x)
    check_nnx_against_dense(m, x, cot, y, g, K)


def test_nnx_module_rejects_bad_input(n):
    nnx = pytest.importorskip("flax.nnx", reason="the NNX module needs flax")
    from ep_comm.nnx import MoE

    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rngs = nnx.Rngs(0)
    if n > 1:  # one device divides every expert count
        with pytest.raises(ValueError, match=re.escape(
                f"ep_comm.nnx.MoE: num_experts={4 * n + 1} must be divisible by the {n} devices "
                f"of mesh axis 'ep'")):
            MoE(H, I, 4 * n + 1, K, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match=re.escape(
            "ep_comm.nnx.MoE: mesh must be a jax.sharding.Mesh with axis 'experts'")):
        MoE(H, I, 4 * n, K, mesh=mesh, axis_name="experts", rngs=rngs)
    with pytest.raises(ValueError, match=re.escape(
            "ep_comm.nnx.MoE: extra keyword arguments must be EPConfig fields other than "
            "axis_name, num_ranks, num_experts, topk and tokens_per_rank; got ['capacity']")):
        MoE(H, I, 4 * n, K, mesh=mesh, rngs=rngs, capacity=3)
    m = MoE(H, I, 4 * n, K, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match=re.escape(
            f"ep_comm.nnx.MoE: x must have shape (..., hidden) = (..., {H}), got (4, {H + 1})")):
        m(jnp.zeros((4, H + 1)))
    if n > 1:
        with pytest.raises(ValueError, match=re.escape(
                f"ep_comm.nnx.MoE: the {n + 1} tokens of x must be divisible by the {n} devices "
                f"of mesh axes ('ep',)")):
            m(jnp.zeros((n + 1, H)))


def test_kernel_outputs_take_the_inputs_varying_axes(sharded, n):
    """A kernel (Pallas) output carries no varying-axes type inside shard_map; a custom VJP that
    returns one for a varying input fails JAX's check unless match_vma marks it (what gemm does
    with tokamax's outputs)."""
    from ep_comm.topology._jax_compat import match_vma

    def grad_with(mark):
        @jax.custom_vjp
        def f(x):
            return x

        def bwd(x, g):
            out = jnp.ones(g.shape, g.dtype)  # made without x: no varying axes, like a kernel's
            return (match_vma(out, x) if mark else out),

        f.defvjp(lambda x: (x, x), bwd)
        return sharded.smap(jax.grad(lambda v: jnp.sum(f(v))))

    x = sharded.put(np.zeros((2 * n, 3), np.float32))
    np.testing.assert_array_equal(sharded.get(grad_with(True)(x)), 1.0)
    with pytest.raises(ValueError, match="manual axis types do not match"):
        grad_with(False)(x)
