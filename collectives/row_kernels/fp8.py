"""The FP8 wire's codecs: the formats' math in XLA (:func:`quantize_blocks`,
:func:`dequantize_blocks`) and the scatters that quantize or dequantize rows on the way
(:func:`scatter_dequant`, :func:`scatter_fake_quant`, :func:`scatter_quant`;
``collectives/csrc/row_kernels/fp8.cu``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm.collectives.row_kernels.primitive import constant_jvp, lowering, primitive, same_vma
from ep_comm.collectives.row_kernels.moves import scatter_fast, scatter_reference


# --- scatter_dequant (the FP8 wire's receive side) ------------------------------------------------

def e8m0_scales(exponents):
    """Float32 ``2 ** (e - 127)`` of E8M0 biased exponents (uint8), NaN for 255 (E8M0's NaN)."""
    e = exponents.astype(jnp.int32) - 127
    return jnp.where(exponents == 255, jnp.nan, jnp.ldexp(jnp.float32(1.0), e))


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
_E4M3_EMAX = 8  # 448 = 1.75 * 2**8
_E8M0_BIAS = 127
_E8M0_NAN = 255
_F32_TINY = np.float32(2.0 ** -126)  # float32's smallest normal


def quantize_blocks(x, block: int, mx: bool):
    """``(values, scales)`` of ``(T, H)`` floating ``x`` per block of ``block`` elements along the
    last axis (``ep_comm.wire``'s formats: its docstring has the rounding, saturation and
    non-finite policy): ``values`` ``(T, H)`` float8_e4m3fn, ``scales`` ``(T, ceil(H / block))``
    float32 (``amax / 448``) or, with ``mx``, uint8 E8M0 exponents."""
    T, H = x.shape
    nb = -(-H // block)
    xb = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - H))).reshape(T, nb, block)
    # subnormal inputs count as (signed) zero and no scale is subnormal: no step depends on
    # whether a platform flushes subnormals (XLA's CPU backend does, IEEE GPU code does not)
    xb = jnp.where(jnp.abs(xb) < _F32_TINY, jnp.copysign(np.float32(0.0), xb), xb)
    finite = jnp.all(jnp.isfinite(xb), axis=2, keepdims=True)
    amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0), axis=2, keepdims=True)
    if not mx:
        # amax / 448 and x / scale written as the multiplications XLA's simplifier makes of them
        # anyway (float32, each rounded to nearest), so the math is explicit wherever it runs
        scale = jnp.where(amax > 0, jnp.maximum(amax * np.float32(1.0 / E4M3_MAX), _F32_TINY),
                          1.0)
        scale = jnp.where(finite, scale, jnp.nan)
        q = xb * (np.float32(1.0) / scale)
        stored = scale[..., 0]
    else:
        # power-of-two scale: 2**(floor(log2(amax)) - 8), exponent clamped to e8m0's range;
        # frexp and ldexp keep every step exact (amax = m * 2**k, m in [0.5, 1))
        # (at least 2**-126 but for an all-zero block: no scale is subnormal either)
        _, k = jnp.frexp(jnp.where(amax > 0, amax, 1.0))
        e = jnp.where(amax > 0, jnp.maximum(k - 1 - _E4M3_EMAX, 1 - _E8M0_BIAS), -_E8M0_BIAS)
        e = jnp.minimum(e, _E8M0_BIAS).astype(jnp.int32)
        q = jnp.ldexp(xb, -e)
        stored = jnp.where(finite, e + _E8M0_BIAS, _E8M0_NAN)[..., 0].astype(jnp.uint8)
        q = jnp.where(finite, q, jnp.nan)
    q = jnp.where(jnp.isnan(q), q, jnp.clip(q, -E4M3_MAX, E4M3_MAX))  # saturate, keep NaN
    values = q.reshape(T, -1)[:, :H].astype(jnp.float8_e4m3fn)
    return values, stored


def dequantize_blocks(values, scales, block: int, dtype):
    """``values * scale`` per block of ``block`` elements along the last axis, in float32 (NaN
    everywhere in a block whose scale is NaN; a product below ``2**-126`` in magnitude is signed
    zero, on every platform), rounded once to ``dtype``. ``values``: ``(T, H)`` FP8; ``scales``:
    ``(T, ceil(H / block))`` float32."""
    T, H = values.shape
    nb = -(-H // block)
    # (a barrier: in one program with the quantization, XLA's GPU simplifier, allowed excess
    # precision, folds float32 -> e4m3 -> float32 into nothing and skips the rounding)
    values = jax.lax.optimization_barrier(values)
    vb = jnp.pad(values.astype(jnp.float32), ((0, 0), (0, nb * block - H))).reshape(T, nb, block)
    s = scales.astype(jnp.float32)[..., None]
    r = vb * s
    r = jnp.where(jnp.abs(r) < _F32_TINY, jnp.copysign(np.float32(0.0), r), r)
    return jnp.where(jnp.isnan(s), jnp.nan, r).reshape(T, -1)[:, :H].astype(dtype)


def scale_bytes(hidden: int, block: int, mx: bool) -> int:
    """Bytes of an FP8 wire row's scales: one E8M0 byte (``mx``) or float32 per block."""
    return -(-hidden // block) * (1 if mx else 4)


def fp8_from_bytes(values, scales, mx: bool):
    """``(values, scales)`` typed (float8_e4m3fn; uint8 E8M0 with ``mx``, else float32) from
    their wire bytes ``(M, H)`` and ``(M, scale bytes)`` uint8 (bitcasts: no pass over rows)."""
    values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    if mx:
        return values, scales
    return values, jax.lax.bitcast_convert_type(scales.reshape(scales.shape[0], -1, 4),
                                                jnp.float32)


def split_fp8_rows(rows, hidden: int, block: int, mx: bool):
    """``(values, scales)`` of FP8 wire rows (``hidden`` e4m3 bytes, then the block scales:
    E8M0 bytes with ``mx``, else float32 as 4 bytes each); scales as stored (uint8 or float32)."""
    return fp8_from_bytes(rows[:, :hidden], rows[:, hidden:hidden + scale_bytes(hidden, block, mx)],
                          mx)


def fp8_rows(x, block: int, mx: bool):
    """``(T, H)`` rows as FP8 wire rows: the e4m3 values, then the row's block scales (float32 as
    4 bytes each, or E8M0 bytes), uint8 ``(T, H + scale bytes)`` (:func:`split_fp8_rows` is the
    inverse)."""
    values, scales = quantize_blocks(x, block, mx)
    tail = scales if mx else jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(
        values.shape[0], -1)
    return jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8), tail], axis=1)


def scatter_dequant(table, pos, fill, rows: int, *, hidden: int, block: int, mx: bool, dtype):
    """FP8 wire rows (uint8 ``(N, row bytes)``, see :func:`split_fp8_rows`) dequantized into
    ``(rows, hidden)`` ``dtype`` and placed as :func:`scatter` places rows (row ``pos[n, k]``:
    ``table[n]`` dequantized; ``fill``: zero; others unspecified), each FP8 row read and
    dequantized once. Not differentiable (bytes)."""
    table = jnp.asarray(table)
    pos = jnp.asarray(pos).astype(jnp.int32)
    fill = jnp.asarray(fill).astype(jnp.int32)
    need = hidden + scale_bytes(hidden, block, mx)
    if (table.dtype != jnp.uint8 or table.ndim != 2 or table.shape[1] < need or pos.ndim != 2
            or pos.shape[0] != table.shape[0] or fill.ndim != 1):
        raise ValueError(f"row_kernels.scatter_dequant: table must be uint8 (N, >= {need}), pos "
                         f"(N, K) and fill 1-D, got table {table.dtype} {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)} and fill {tuple(fill.shape)}")
    if int(rows) < 0:
        raise ValueError(f"row_kernels.scatter_dequant: rows must be >= 0, got {rows}")
    table, pos, fill = same_vma(table, pos, fill)
    return scatter_dequant_p.bind(table, pos, fill, rows=int(rows), hidden=int(hidden),
                                  block=int(block), mx=bool(mx), dtype=np.dtype(dtype),
                                  kernel=lowering())


def _scatter_dequant_reference(table, pos, fill, *, rows, hidden, block, mx, dtype, kernel=None,
                               place=scatter_reference):
    # (place: how rows are placed; the fast lowering passes scatter_fast)
    raw = place(table, pos, fill, rows=rows)
    values, scales = split_fp8_rows(raw, hidden, block, mx)
    return dequantize_blocks(values, e8m0_scales(scales) if mx else scales, block, dtype)


scatter_dequant_p = primitive(
    "ep_comm_rows_scatter_dequant", _scatter_dequant_reference,
    lambda table, pos, fill, *, rows, hidden, block, mx, dtype, kernel: table.update(
        shape=(rows, hidden), dtype=dtype, weak_type=False),
    ("rows", "hidden", "block", "mx", "dtype", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    fast=functools.partial(_scatter_dequant_reference, place=scatter_fast))
constant_jvp(scatter_dequant_p)


def scatter_fake_quant(table, pos, fill, rows: int, *, block: int, mx: bool):
    """Rows of ``table`` ``(N, H)`` after the FP8 wire's round trip (:func:`quantize_blocks`, then
    :func:`dequantize_blocks` to the table's dtype), placed as :func:`scatter` places rows: the
    values dispatch delivers with a wire format when nothing crosses a wire (one rank), each row
    read once and quantized in registers (no FP8 buffer). The bytes never exist, so no gradient
    flows through them: the result is constant in ``table`` (dispatch attaches the
    straight-through gradient)."""
    table, pos, fill = _quantizing_scatter_args("scatter_fake_quant", table, pos, fill, rows,
                                                block)
    return scatter_fake_quant_p.bind(table, pos, fill, rows=int(rows), block=int(block),
                                     mx=bool(mx), kernel=lowering())


def _quantizing_scatter_args(api, table, pos, fill, rows, block):
    """The checked operands of :func:`scatter_fake_quant` and :func:`scatter_quant` (the table
    behind a stop_gradient: bytes carry no gradient)."""
    table = jnp.asarray(table)
    pos = jnp.asarray(pos).astype(jnp.int32)
    fill = jnp.asarray(fill).astype(jnp.int32)
    if (table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating) or pos.ndim != 2
            or pos.shape[0] != table.shape[0] or fill.ndim != 1):
        raise ValueError(f"row_kernels.{api}: table must be floating (N, H), pos (N, K) and fill "
                         f"1-D, got table {table.dtype} {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)} and fill {tuple(fill.shape)}")
    if int(rows) < 0 or int(block) < 1:
        raise ValueError(f"row_kernels.{api}: rows must be >= 0 and block >= 1, got rows={rows} "
                         f"and block={block}")
    return same_vma(jax.lax.stop_gradient(table), pos, fill)


def _scatter_fake_quant_reference(table, pos, fill, *, rows, block, mx, kernel=None,
                                  place=scatter_reference):
    # the wire's path itself: the rows as wire rows, scattered, then dequantized
    return _scatter_dequant_reference(fp8_rows(table, block, mx), pos, fill, rows=rows,
                                      hidden=table.shape[1], block=block, mx=mx,
                                      dtype=table.dtype, place=place)


def _fake_quant_fits(ctx, *, block, **_):
    """The kernel's shapes: 16-bit or float32 rows of whole blocks of 1-32 16-byte pieces."""
    table = ctx.avals_in[0]
    v = 16 // table.dtype.itemsize
    g = block // v if block % v == 0 else 0
    return (table.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) and 1 <= g <= 32
            and g & (g - 1) == 0 and table.shape[1] % block == 0)


scatter_fake_quant_p = primitive(
    "ep_comm_rows_scatter_fake_quant", _scatter_fake_quant_reference,
    lambda table, pos, fill, *, rows, block, mx, kernel: table.update(
        shape=(rows, table.shape[1]), weak_type=False),
    ("rows", "block", "mx", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    kernel_fits=_fake_quant_fits,
    fast=functools.partial(_scatter_fake_quant_reference, place=scatter_fast))


constant_jvp(scatter_fake_quant_p)


def scatter_quant(table, pos, fill, rows: int, *, block: int, mx: bool):
    """:func:`scatter_fake_quant`'s rows kept quantized: ``(values, scales)`` uint8 ``(rows, H)``
    and ``(rows, scale bytes)``, the two byte ranges of each FP8 wire row (:func:`fp8_rows`)
    placed as :func:`scatter` places rows (zero rows: both zero); each table row read once and
    quantized in registers. Not differentiable (bytes)."""
    table, pos, fill = _quantizing_scatter_args("scatter_quant", table, pos, fill, rows, block)
    values, scales = scatter_quant_p.bind(table, pos, fill, rows=int(rows), block=int(block),
                                          mx=bool(mx), kernel=lowering())
    return values, scales


def _scatter_quant_reference(table, pos, fill, *, rows, block, mx, kernel=None,
                             place=scatter_reference):
    H = table.shape[1]
    wire_rows = fp8_rows(table, block, mx)
    return [place(wire_rows, pos, fill, rows=rows, columns=c)
            for c in ((0, H), (H, H + scale_bytes(H, block, mx)))]


def _scatter_quant_abstract(table, pos, fill, *, rows, block, mx, kernel):
    u8 = lambda *shape: table.update(shape=shape, dtype=jnp.uint8, weak_type=False)  # noqa: E731
    H = table.shape[1]
    return [u8(rows, H), u8(rows, scale_bytes(H, block, mx))]


scatter_quant_p = primitive(
    "ep_comm_rows_scatter_quant", _scatter_quant_reference, _scatter_quant_abstract,
    ("rows", "block", "mx", "kernel"),
    ffi_attrs=lambda *, block, mx, **_: dict(block=np.int64(block), mx=np.int64(mx)),
    kernel_fits=_fake_quant_fits, multiple_results=True,
    fast=functools.partial(_scatter_quant_reference, place=scatter_fast))
constant_jvp(scatter_quant_p)


