"""The FP8 wire formats' error against bf16 rows (``python -m ep_comm.benchmarks.wire``): per format,
on normal and heavy-tailed activations, the max and mean relative error per block. The time and
bytes of FP8 dispatch are in ``python -m ep_comm.benchmarks.dispatch --wire-formats none,e4m3,mxfp8``."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm import wire
from ep_comm.benchmarks.timing import save_json



def error_table(tokens: int = 4096, hidden: int = 7168, seed: int = 0) -> list[dict]:
    """Quantization error of each format against the bf16 rows, on normal and heavy-tailed
    (Student t, 2 degrees of freedom, one element in 1000 scaled by 1000) activations: the max
    and mean over blocks of each block's max and mean relative error (elements that are e4m3
    normals once scaled; the rest are bounded absolutely, see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for dist in ("normal", "heavy-tailed"):
        if dist == "normal":
            x = rng.standard_normal((tokens, hidden))
        else:
            x = rng.standard_t(2, (tokens, hidden))
            x[rng.random((tokens, hidden)) < 1e-3] *= 1e3
        xb = jnp.asarray(x, jnp.bfloat16)
        ref = np.asarray(xb, np.float32)
        for fmt in wire.WIRE_FORMATS[1:]:
            y = np.asarray(wire.dequantize(*wire.quantize(xb, fmt), fmt, jnp.float32))
            b = wire.BLOCK[fmt]
            nb = -(-hidden // b)
            pad = ((0, 0), (0, nb * b - hidden))
            r = np.pad(ref, pad).reshape(tokens, nb, b)
            e = np.abs(np.pad(y, pad).reshape(tokens, nb, b) - r)
            amax = np.abs(r).max(2, keepdims=True)
            scale = amax / wire.E4M3_MAX if fmt == "e4m3" else np.exp2(
                np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8)  # e4m3's top exponent
            normal = np.abs(r) >= scale * 2.0 ** -6
            rel = np.where(normal, e / np.where(normal, np.abs(r), 1), np.nan)
            block_max, block_mean = np.nanmax(rel, 2), np.nanmean(rel, 2)
            out.append(dict(activations=dist, format=fmt, max_rel=float(np.nanmax(block_max)),
                            mean_of_block_max=float(np.nanmean(block_max)),
                            mean_rel=float(np.nanmean(block_mean)),
                            normal_fraction=float(normal.mean())))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ep_comm.benchmarks.wire",
                                 description="FP8 wire formats: quantization error table")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = error_table(args.tokens, args.hidden)
    print(f"# relative error of each format against bf16 rows, {args.tokens} x {args.hidden}, "
          f"per block of the format (e4m3: 128, mxfp8: 32), over elements that are e4m3 "
          f"normals once scaled; {jax.devices()[0].platform}")
    print(f"{'activations':<14}{'format':<8}{'max':>10}{'mean blk max':>14}{'mean':>10}"
          f"{'normals':>9}")
    for r in rows:
        print(f"{r['activations']:<14}{r['format']:<8}{r['max_rel']:>10.4f}"
              f"{r['mean_of_block_max']:>14.4f}{r['mean_rel']:>10.4f}{r['normal_fraction']:>9.3f}")
    return save_json(rows, args.json)


if __name__ == "__main__":
    main()
