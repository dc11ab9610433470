"""FP8 wire formats for dispatch: token rows quantized per block, with their scales.

Two formats (``WIRE_FORMATS``), both e4m3 values (``float8_e4m3fn``: 3 mantissa bits, largest
finite 448, no infinity):

- ``"e4m3"``: one float32 scale per 128 elements (DeepEP's layout). ``scale = amax / 448`` of the
  block, values ``x / scale`` rounded to nearest even (in float32 as ``amax * fl(1/448)`` and
  ``x * (1 / scale)``, the operations XLA makes of the divisions); a row of ``H`` elements costs
  ``H + 4 * ceil(H / 128)`` bytes (0.52x of bf16 at H = 7168).
- ``"mxfp8"``: the OCP Microscaling (MX) v1.0 format: one E8M0 scale per 32 elements, a power of two
  ``X = 2 ** (floor(log2(amax)) - 8)`` (8 = the exponent of e4m3's largest normal; at least
  ``2**-126``, and ``2**-127`` for an all-zero block), stored as its biased exponent (``uint8``,
  bias 127; 255 = NaN); values ``x / X`` rounded to nearest even and
  saturated at +-448 (the spec's saturating conversion: ``amax / X`` can reach just under 512).
  ``H + ceil(H / 32)`` bytes per row.

Policy for non-finite input (both formats): a block holding an Inf or a NaN dequantizes to NaN in
every element. Nothing is ever clamped silently to a finite value: a non-finite activation stays
visible after the exchange. All-zero blocks round-trip to exact zeros. Subnormal inputs
(``|x| < 2**-126``) count as (signed) zero, no scale of a nonzero block is below ``2**-126``, and a
dequantized float32 product below ``2**-126`` is (signed) zero: no step depends on whether a
platform flushes subnormals (every platform sends the same bytes and delivers the same values;
one exception seen: XLA's GPU compiler rounded exact e4m3 ties of float16 and float32 rows to the
odd neighbour on the H200, where the row kernels and the CPU lowering round to even).

Error bound per element (``tests/test_wire.py`` asserts it), ``s`` the block's scale: a value
with ``|x| >= s * 2**-6`` (an e4m3 normal once scaled) is off by at most ``2**-4 * |x|`` (half a unit
in the last of 3 mantissa bits); a smaller one by at most ``s * 2**-10`` (half the subnormal
spacing ``2**-9``), and by ``2**-126`` more where the value delivered would be subnormal. MXFP8
values beyond ``448 * s`` saturate to it: off by less than ``2**-3 * |x|`` (a block's largest
value scales to just under 512).

The math lives in :mod:`ep_comm.collectives.row_kernels` (``quantize_blocks``, ``dequantize_blocks``), in
XLA: the sender's quantization runs as XLA fusions on every platform (a one-kernel version
measured slower on the H200: 92 us against XLA's 64 us for 4096 x 7168 bf16 rows in e4m3), and the
receiver's scatter with dequantization as one kernel on GPUs
(:func:`ep_comm.collectives.row_kernels.scatter_dequant`), equal to the XLA math bit for bit. With one
rank nothing crosses a wire: dispatch quantizes and dequantizes each row in registers as it
scatters it (:func:`ep_comm.collectives.row_kernels.scatter_fake_quant`), the same values in one pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ep_comm.collectives import row_kernels

WIRE_FORMATS = (None, "e4m3", "mxfp8")
BLOCK = {"e4m3": 128, "mxfp8": 32}
E4M3_MAX = row_kernels.E4M3_MAX


def check_format(api: str, wire_format) -> None:
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"{api}: wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")


def pack_rows(x, wire_format: str):
    """``(T, H)`` rows as the bytes dispatch sends: the e4m3 values, then the row's scales
    (float32 as 4 bytes each, or e8m0 bytes); ``(T, topology.token_bytes(H, ..., wire_format))``
    uint8 (XLA fuses the quantization and the packing). No gradient flows through bytes: dispatch
    attaches the straight-through one."""
    x = _checked("pack_rows", x, wire_format)
    return row_kernels.fp8_rows(x, BLOCK[wire_format], wire_format == "mxfp8")


def unpack_rows(rows, hidden: int, wire_format: str):
    """``(values, scales)`` of rows :func:`pack_rows` made (all-zero rows give zeros)."""
    return row_kernels.split_fp8_rows(rows, hidden, BLOCK[wire_format], wire_format == "mxfp8")


def from_bytes(values, scales, wire_format: str):
    """``(values, scales)`` typed (float8_e4m3fn; float32 or uint8 E8M0) from their wire bytes
    ``(M, H)`` and ``(M, scale bytes)`` uint8 (bitcasts: no pass over the rows)."""
    return row_kernels.fp8_from_bytes(values, scales, wire_format == "mxfp8")


def quantize(x, wire_format: str):
    """``(values, scales)`` of a ``(T, H)`` floating array: ``values`` ``(T, H)`` float8_e4m3fn,
    ``scales`` ``(T, ceil(H / block))``: float32 (``"e4m3"``) or uint8 biased exponents
    (``"mxfp8"``). See the module docstring for rounding, saturation and non-finite input."""
    x = _checked("quantize", x, wire_format)
    return row_kernels.quantize_blocks(x, BLOCK[wire_format], wire_format == "mxfp8")


def _checked(api: str, x, wire_format):
    """``x`` as a jax array, after checking it is ``(tokens, hidden)`` floating and
    ``wire_format`` one of the FP8 formats."""
    if wire_format not in WIRE_FORMATS[1:]:
        raise ValueError(f"{api}: wire_format must be one of {WIRE_FORMATS[1:]}, "
                         f"got {wire_format!r}")
    x = jnp.asarray(x)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (tokens, hidden), got "
                         f"{x.dtype} {tuple(x.shape)}")
    return x


def scale_values(scales, wire_format: str):
    """The float32 scale of each block (``2**(e - 127)`` for MX, NaN for e8m0's NaN)."""
    if wire_format == "e4m3":
        return scales.astype(jnp.float32)
    return row_kernels.e8m0_scales(scales)


def dequantize(values, scales, wire_format: str, dtype=jnp.bfloat16):
    """``values * scale`` of each block, in ``dtype`` (the inverse of :func:`quantize` up to
    its rounding); NaN everywhere in a block whose scale is NaN."""
    check_format("dequantize", wire_format)
    if wire_format is None:
        raise ValueError("dequantize: wire_format must be 'e4m3' or 'mxfp8', got None")
    return row_kernels.dequantize_blocks(values, scale_values(scales, wire_format),
                                         BLOCK[wire_format], dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quantize(x, wire_format: str):
    """``dequantize(quantize(x))`` in ``x.dtype`` with a straight-through gradient (the identity):
    what a row looks like after crossing the wire, with the backward in full precision."""
    return dequantize(*quantize(x, wire_format), wire_format, x.dtype)


def _fake_fwd(x, wire_format):
    return fake_quantize(x, wire_format), None


def _fake_bwd(wire_format, _, g):
    return (g,)


fake_quantize.defvjp(_fake_fwd, _fake_bwd)

