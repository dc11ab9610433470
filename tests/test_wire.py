"""ep_comm.wire: FP8 row quantization (e4m3 with float32 block scales, OCP MXFP8), against bounds
derived from the formats and a numpy reference of the MX rules."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ep_comm
from ep_comm import topology
from conftest import BACKENDS
from ep_comm import wire

FORMATS = ["e4m3", "mxfp8"]


def _rows(rng, T, H, heavy=False):
    x = rng.standard_normal((T, H))
    if heavy:  # heavy-tailed activations: Student t with 2 degrees of freedom, a few outliers
        x = rng.standard_t(2, (T, H))
        x[rng.random((T, H)) < 1e-3] *= 1e3
    return x.astype(np.float32)


def _block_scales(x, fmt):
    """The scale each element's block uses, as float32 (numpy reference of the module's rule)."""
    T, H = x.shape
    b = wire.BLOCK[fmt]
    nb = -(-H // b)
    xb = np.pad(x, ((0, 0), (0, nb * b - H))).reshape(T, nb, b)
    amax = np.abs(xb).max(2)
    if fmt == "e4m3":
        s = np.where(amax > 0, amax / 448.0, 1.0)
    else:
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8, -127)
        s = np.exp2(np.clip(e, np.where(amax > 0, -126, -127), 127))
    return np.repeat(s, b, axis=1)[:, :H].astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("H", [7168, 100])  # 100: a partial last block
def test_error_within_the_format_bound(fmt, heavy, H):
    x = _rows(np.random.default_rng(0), 64, H, heavy)
    v, s = wire.quantize(jnp.asarray(x), fmt)
    assert v.dtype == jnp.float8_e4m3fn and v.shape == x.shape
    assert s.shape == (64, -(-H // wire.BLOCK[fmt]))
    y = np.asarray(wire.dequantize(v, s, fmt, jnp.float32))
    scale = _block_scales(x, fmt)
    err = np.abs(y - x)
    normal = np.abs(x) >= scale * 2.0 ** -6
    # half an ulp of 3 mantissa bits for normals, half the subnormal spacing below
    bound = np.where(normal, 2.0 ** -4 * np.abs(x), scale * 2.0 ** -10)
    if fmt == "mxfp8":  # saturation at 448 * scale: less than 1/8 of the value
        sat = np.abs(x) > 448 * scale
        bound = np.where(sat, 2.0 ** -3 * np.abs(x), bound)
    assert np.all(err <= bound * (1 + 1e-6)), float(np.max(err / bound))
    # and a table-style summary stays sane: mean relative error per block well under the bound
    rel = err[normal] / np.abs(x[normal])
    assert rel.mean() < 2.0 ** -5


def test_mxfp8_scales_are_powers_of_two_and_exact_values_round_trip():
    rng = np.random.default_rng(1)
    # values already representable: e4m3 numbers times a power of two per block
    e4m3 = rng.choice(np.arange(-448, 449, dtype=np.float32), (8, 64)).astype(
        ml_dtypes.float8_e4m3fn).astype(np.float32)
    pow2 = np.exp2(rng.integers(-20, 20, (8, 2))).astype(np.float32)
    x = e4m3 * np.repeat(pow2, 32, axis=1)
    x[:, 0] = 448 * np.repeat(pow2, 32, axis=1)[:, 0]  # blocks whose max is exactly 448 * 2**k
    x[:, 32] = 448 * pow2[:, 1]
    v, s = wire.quantize(jnp.asarray(x), "mxfp8")
    assert s.dtype == jnp.uint8
    scales = np.asarray(wire.scale_values(s, "mxfp8"))
    m, e = np.frexp(scales)
    assert np.all(m == 0.5), "MX scales must be exact powers of two"
    np.testing.assert_array_equal(np.asarray(wire.dequantize(v, s, "mxfp8", jnp.float32)), x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_blocks_become_nan_and_zero_rows_stay_zero(fmt):
    b = wire.BLOCK[fmt]
    x = np.ones((4, 2 * b), np.float32)
    x[0, 3] = np.inf
    x[1, b + 1] = -np.inf
    x[2, 5] = np.nan
    x[3] = 0.0
    y = np.asarray(wire.dequantize(*wire.quantize(jnp.asarray(x), fmt), fmt, jnp.float32))
    assert np.all(np.isnan(y[0, :b])) and np.all(y[0, b:] == 1.0)  # only the Inf's block
    assert np.all(np.isnan(y[1, b:])) and np.all(y[1, :b] == 1.0)
    assert np.all(np.isnan(y[2, :b])) and np.all(y[2, b:] == 1.0)
    np.testing.assert_array_equal(y[3], 0.0)  # exact zeros
    assert not np.any(np.isfinite(y[:3][np.isnan(y[:3])]))  # never clamped to finite


def test_wire_bytes():
    tb = topology.token_bytes
    assert tb(7168, jnp.bfloat16) == 14336
    assert tb(7168, jnp.bfloat16, "e4m3") == 7168 + 56 * 4  # 0.516x of bf16
    assert tb(7168, jnp.bfloat16, "mxfp8") == 7168 + 224
    assert tb(7168, jnp.bfloat16, "e4m3") / tb(7168, jnp.bfloat16) <= 0.53
    # the packed rows dispatch sends are exactly that long
    for fmt in FORMATS:
        rows = wire.pack_rows(jnp.ones((2, 7168), jnp.bfloat16), fmt)
        assert rows.dtype == jnp.uint8 and rows.shape == (2, tb(7168, jnp.bfloat16, fmt))
        v, s = wire.unpack_rows(rows, 7168, fmt)
        np.testing.assert_array_equal(wire.dequantize(v, s, fmt, jnp.float32), 1.0)


def test_fake_quantize_is_straight_through():
    x = jnp.asarray(_rows(np.random.default_rng(2), 8, 256))
    for fmt in FORMATS:
        y, vjp = jax.vjp(lambda a, f=fmt: wire.fake_quantize(a, f), x)
        np.testing.assert_allclose(y, x, rtol=2.0 ** -3, atol=1e-2)
        # rounded in one program as in two (no compiler may fold e4m3 -> float32 away)
        v, sc = wire.quantize(x, fmt)
        np.testing.assert_array_equal(jax.jit(wire.fake_quantize, static_argnums=1)(x, fmt),
                                      wire.dequantize(v, sc, fmt, jnp.float32))
        assert np.any(np.asarray(y) != np.asarray(x))
        g = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), jnp.float32)
        np.testing.assert_array_equal(vjp(g)[0], g)


def test_bad_input():
    with pytest.raises(ValueError, match=re.escape(
            "pack_rows: wire_format must be one of ('e4m3', 'mxfp8'), got None")):
        wire.pack_rows(jnp.ones((2, 4)), None)
    with pytest.raises(ValueError, match=re.escape(
            "quantize: wire_format must be one of ('e4m3', 'mxfp8'), got 'fp4'")):
        wire.quantize(jnp.ones((2, 4)), "fp4")
    with pytest.raises(ValueError, match=re.escape(
            "quantize: x must be a floating array of shape (tokens, hidden), got int32 (4,)")):
        wire.quantize(jnp.ones((4,), jnp.int32), "e4m3")
    with pytest.raises(ValueError, match=re.escape(
            "token_bytes: wire_format must be one of (None, 'e4m3', 'mxfp8'), got 'bf8'")):
        topology.token_bytes(16, jnp.bfloat16, "bf8")
    with pytest.raises(TypeError, match=re.escape(
            "row_bytes: combine_dtype must be a dtype, got 'nonsense'")):
        topology.row_bytes(16, jnp.bfloat16, 2, "nonsense")


# ---- FP8 rows through dispatch (EPConfig.wire_format) ---------------------------------------------

def _cfg(n, fmt, backend="portable", **kw):
    return ep_comm.EPConfig(axis_name="ep", num_ranks=n, num_experts=4 * n, topk=4,
                            tokens_per_rank=16, backend=backend, wire_format=fmt, **kw)


def _inputs(n, seed=0, H=160):
    from moe_reference import routing
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n * 16, H)) * np.exp(rng.standard_normal((n * 16, 1)))).astype(
        np.float32)
    ids = routing(rng, "random", n, 16, 4, 4 * n)
    w = rng.random((n * 16, 4)).astype(np.float32)
    return x, ids, w


@pytest.mark.parametrize("fmt,backend", [  # mxfp8 through dispatch: the hierarchical test below
    ("e4m3", "portable")] + ([pytest.param("e4m3", "mpi", marks=pytest.mark.multiprocess)]
                             if "mpi" in BACKENDS else []))
def test_fp8_dispatch_equals_dispatch_of_the_quantized_rows(sharded, n, fmt, backend):
    """expert_x through an FP8 wire is, bit for bit, the full-precision dispatch of the rows as
    the wire quantizes them; combine and every handle field agree too; the gradients are the
    straight-through ones (the full-precision dispatch's transpose)."""
    cfg = _cfg(n, fmt, backend)
    ref_cfg = dataclasses.replace(cfg, wire_format=None)
    x, ids, w = _inputs(n)
    cot = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def program(c, pre):
        def f(x, ids, w, cot):
            def loss(x, w):
                ex, h = ep_comm.dispatch(pre(x), ids, w, c)
                return jnp.sum(ep_comm.combine(ex * 1.5, h) * cot), (ex, h)
            (_, (ex, h)), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            return ex, h.group_sizes, g
        return sharded.smap(f)

    got = sharded.get(program(cfg, lambda a: a)(*sharded.put(x, ids, w, cot)))
    want = sharded.get(program(ref_cfg, lambda a: wire.fake_quantize(a, fmt))(
        *sharded.put(x, ids, w, cot)))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2][0], want[2][0], rtol=1e-6, atol=1e-6)  # d x
    np.testing.assert_allclose(got[2][1], want[2][1], rtol=1e-6, atol=1e-6)  # d weights


def test_fp8_hierarchical_equals_flat(n):
    from ep_comm import topology
    if n < 4 or n % 2:
        pytest.skip("the hierarchical plan needs 2 nodes of 2+ devices")
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    x, ids, w = _inputs(n, seed=3)
    outs = []
    for plan in ("flat", "hierarchical"):
        cfg = _cfg(n, "mxfp8", plan=plan, topology=topology.simulated(2, n // 2))
        f = jax.jit(jax.shard_map(lambda x, ids, w, c=cfg: ep_comm.dispatch(x, ids, w, c)[0],
                                  mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        outs.append(np.asarray(f(x, ids, w)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_return_quantized_values_and_bytes_counted(sharded, n):
    cfg = _cfg(n, "e4m3")
    x, ids, w = _inputs(n, seed=2)

    def f(x, ids, w):
        (v, s), h = ep_comm.dispatch(x, ids, w, cfg, return_quantized=True)
        ex, _ = ep_comm.dispatch(x, ids, w, cfg)
        return v, s, ex, ep_comm.link_bytes(h, x.shape[1], x.dtype), h.link_rows
    v, s, ex, nbytes, rows = sharded.get(sharded.smap(f)(*sharded.put(x, ids, w)))
    assert v.dtype == jnp.float8_e4m3fn and s.dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(wire.dequantize(jnp.asarray(v), jnp.asarray(s), "e4m3", jnp.float32)), ex)
    row = 160 + 2 * 4 + 8 * 4  # 160 e4m3 values, 2 float32 scales, routing (weights and ids)
    np.testing.assert_array_equal(nbytes.reshape(n, 2, -1)[:, 0], rows.reshape(n, 2, -1)[:, 0]
                                  * row)


def test_return_quantized_is_not_differentiable(sharded, n):
    cfg = _cfg(n, "mxfp8")
    x, ids, w = _inputs(n)

    def f(x, ids, w):
        def loss(x):
            (v, _), _ = ep_comm.dispatch(x, ids, w, cfg, return_quantized=True)
            return jnp.sum(v.astype(jnp.float32))
        return jax.grad(loss)(x)
    with pytest.raises(NotImplementedError, match=re.escape(
            "dispatch(return_quantized=True) is not differentiable in x")):
        sharded.smap(f)(*sharded.put(x, ids, w))


def test_fp8_layer_close_to_bf16(sharded, n):
    """The whole layer with an e4m3 wire: outputs within the quantization's bound of the bf16
    wire's, gradients straight-through (the dequantized rows' error only)."""
    cfg = _cfg(n, "e4m3")
    x, ids, w = _inputs(n, seed=4, H=64)
    rng = np.random.default_rng(5)
    L = cfg.experts_per_rank
    w_in = (rng.standard_normal((4 * n, 64, 32)) / 8).astype(np.float32)
    w_out = (rng.standard_normal((4 * n, 16, 64)) / 4).astype(np.float32)

    def program(c):
        def f(x, ids, w, wi, wo):
            def loss(x, wi):
                y = ep_comm.moe_layer(x, ids, w, c, w_in=wi, w_out=wo)
                return jnp.sum(y ** 2), y
            (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, wi)
            return y, g[0], g[1]
        return sharded.smap(f)
    args = sharded.put(x, ids, w, w_in, w_out)
    y8, gx8, gw8 = sharded.get(program(cfg)(*args))
    y, gx, gw = sharded.get(program(dataclasses.replace(cfg, wire_format=None))(*args))
    assert L == 4
    scale = np.abs(y).max()
    np.testing.assert_allclose(y8, y, atol=2.0 ** -4 * 4 * scale)
    np.testing.assert_allclose(gx8, gx, atol=2.0 ** -3 * np.abs(gx).max())
    np.testing.assert_allclose(gw8, gw, atol=2.0 ** -3 * np.abs(gw).max())


def test_wire_format_is_validated():
    with pytest.raises(ValueError, match=re.escape(
            "EPConfig: wire_format must be one of (None, 'e4m3', 'mxfp8'), got 'fp8'")):
        ep_comm.EPConfig("ep", 1, 4, 2, 8, wire_format="fp8")
    cfg = ep_comm.EPConfig("ep", 1, 4, 2, 8)
    with pytest.raises(ValueError, match=re.escape(
            "dispatch: return_quantized=True needs config.wire_format ('e4m3' or 'mxfp8'), "
            "got None")):
        jax.shard_map(lambda x, i, w: ep_comm.dispatch(x, i, w, cfg, return_quantized=True)[0],
                      mesh=jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                                         axis_types=(jax.sharding.AxisType.Auto,)),
                      in_specs=P("ep"), out_specs=P("ep"))(
            jnp.ones((8, 4)), jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2)))


def test_quantize_on_the_accelerator_equals_the_cpu_reference():
    """The kernels that run on the GPU (today the same XLA functions, compiled for it) give the
    CPU reference's bytes exactly."""
    if jax.default_backend() == "cpu":
        pytest.skip("needs a GPU: the CPU run is the reference")
    x = _rows(np.random.default_rng(6), 256, 7168, heavy=True)
    x[3, 10] = np.nan
    for fmt in FORMATS:
        on_gpu = np.asarray(jax.jit(wire.pack_rows, static_argnums=1)(jnp.asarray(x), fmt))
        with jax.default_device(jax.devices("cpu")[0]):
            on_cpu = np.asarray(jax.jit(wire.pack_rows, static_argnums=1)(jnp.asarray(x), fmt))
        np.testing.assert_array_equal(on_gpu, on_cpu)


def test_error_table_and_bench_rows():
    from ep_comm.benchmarks import dispatch as dispatch_bench, wire as wire_bench

    rows = wire_bench.main(["--tokens", "64", "--hidden", "256"])
    assert {(r["activations"], r["format"]) for r in rows} == {
        (a, f) for a in ("normal", "heavy-tailed") for f in FORMATS}
    assert all(r["max_rel"] <= (2.0 ** -4 if r["format"] == "e4m3" else 2.0 ** -3) for r in rows)
    # the dispatch benchmark's FP8 rows, on a 2-device mesh (its programs are the costly part)
    rep = dispatch_bench.run(dispatch_bench.BenchConfig(8, 64, 2, 8, "float32", "uniform"), warmup=0, iters=1,
                    capacity_factors=(), backends=["portable"], wire_formats=(None, "e4m3"),
                    devices=jax.devices()[:2])
    disp = {r["impl"]: r for r in rep["results"]
            if r["phase"] == "dispatch" and r["impl"].startswith("ep_comm/")}
    assert set(disp) == {"ep_comm/portable", "ep_comm/portable e4m3"}
    assert all(r["wrong"] == 0 for r in disp.values())
    assert "0.266x the bytes per token row" in dispatch_bench.table(rep)  # (64 + 4) / (64 * 4)
