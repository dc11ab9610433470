"""ep_comm.wire: FP8 row quantization (e4m3 with float32 block scales, OCP MXFP8), against bounds
derived from the formats and a numpy reference of the MX rules."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

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
        s = np.exp2(np.clip(e, -127, 127))
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
    assert wire.row_bytes(7168, None) == 14336
    assert wire.row_bytes(7168, "e4m3") == 7168 + 56 * 4  # 0.516x of bf16
    assert wire.row_bytes(7168, "mxfp8") == 7168 + 224
    assert wire.row_bytes(7168, "e4m3") / wire.row_bytes(7168, None) <= 0.53


def test_fake_quantize_is_straight_through():
    x = jnp.asarray(_rows(np.random.default_rng(2), 8, 256))
    for fmt in FORMATS:
        y, vjp = jax.vjp(lambda a, f=fmt: wire.fake_quantize(a, f), x)
        np.testing.assert_allclose(y, x, rtol=2.0 ** -3, atol=1e-2)
        g = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), jnp.float32)
        np.testing.assert_array_equal(vjp(g)[0], g)


def test_bad_input():
    with pytest.raises(ValueError, match=re.escape(
            "quantize: wire_format must be one of ('e4m3', 'mxfp8'), got 'fp4'")):
        wire.quantize(jnp.ones((2, 4)), "fp4")
    with pytest.raises(ValueError, match=re.escape(
            "quantize: x must be a floating array of shape (tokens, hidden), got int32 (4,)")):
        wire.quantize(jnp.ones((4,), jnp.int32), "e4m3")
    with pytest.raises(ValueError, match=re.escape(
            "row_bytes: wire_format must be one of (None, 'e4m3', 'mxfp8'), got 'bf8'")):
        wire.row_bytes(16, "bf8")
