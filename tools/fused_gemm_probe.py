"""The fused forward grouped GEMM (collectives.grouped_gemm.fused_forward) on a Hopper GPU:
values against the plain-JAX reference at small shapes (every epilogue, malformed indices and
sizes), then times at one rank of DeepSeek-V3 at EP8, beside the dense einsum of the same FLOPs
and the unfused passes (gather, then the grouped GEMM, then SwiGLU) in the same run.

    python tools/fused_gemm_probe.py [--pairs 32768 --tokens 8192 --hidden 7168 --inter 2048]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm.collectives import grouped_gemm as gg
from ep_comm.benchmarks.timing import hardware, median_us


def check(rng) -> list[str]:
    """Wrong values of each epilogue and config at small, malformed shapes."""
    lines = []
    X, K, N, G = 96, 200, 384, 5  # K and N tails in every tile
    x = jnp.asarray(rng.standard_normal((X, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16)
    for sizes, M in (([40, 0, 131, 1, 9], 181), ([7, -3, 500, 9, 2], 150), ([0] * G, 64)):
        index = rng.integers(-2, X + 2, size=M).astype(np.int32)  # some outside [0, X)
        scale = jnp.asarray(rng.random(M), jnp.float32)
        gs = jnp.asarray(sizes, jnp.int32)
        for epilogue in gg.EPILOGUES:
            for config in gg.FUSED_CONFIGS:
                if epilogue == "swiglu" and config == 1:
                    continue
                kw = dict(index=jnp.asarray(index), epilogue=epilogue,
                          scale=scale if epilogue == "scale" else None)
                got = np.asarray(gg.fused_forward(x, w, gs, config=config, **kw), np.float32)
                want = np.asarray(gg.fused_forward_reference(x, w, gs, **kw), np.float32)
                bad = int(np.sum(~np.isclose(got, want, rtol=2 ** -7, atol=2 ** -7)))
                lines.append(f"check sizes={sizes} M={M} {epilogue:6s} config {config}: "
                             f"{bad} wrong of {got.size}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the gathered buffer")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("#", hardware())
    for line in check(rng):
        print(line)
    M, X, H, I, G = a.pairs, a.tokens, a.hidden, a.inter, a.experts
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((X, H)), bf)
    index = jnp.asarray(rng.integers(0, X, size=M), jnp.int32)
    w_in = jnp.asarray(rng.standard_normal((G, H, 2 * I)) / np.sqrt(H), bf)
    w_out = jnp.asarray(rng.standard_normal((G, I, H)) / np.sqrt(I), bf)
    gs = jnp.full((G,), M // G, jnp.int32)
    h = jnp.asarray(rng.standard_normal((M, I)), bf)
    scale = jnp.asarray(rng.random(M), jnp.float32)
    dense_in = jnp.asarray(rng.standard_normal((H, 2 * I)), bf)
    dense_out = jnp.asarray(rng.standard_normal((I, H)), bf)
    gathered = jnp.take(x, index, axis=0)
    rows = []

    def row(name, fn, *args, flops):
        t = median_us(jax.jit(fn), args, 2, a.iters)
        rows.append(dict(name=name, us=t, tflops=flops / t / 1e6))

    up, down = 2 * M * H * 2 * I, 2 * M * I * H
    row("dense up (M,H)@(H,2I)", lambda u, v: u @ v, gathered, dense_in, flops=up)
    row("gather + cutlass up", lambda u, i, v, g: gg.grouped_gemm("forward", jnp.take(u, i, axis=0), v, g),
        x, index, w_in, gs, flops=up)
    row("cutlass up (pre-gathered)", lambda u, v, g: gg.grouped_gemm("forward", u, v, g),
        gathered, w_in, gs, flops=up)
    for config in gg.FUSED_CONFIGS:
        row(f"fused gather up, store, config {config}",
            lambda u, v, g, i, c=config: gg.fused_forward(u, v, g, index=i, config=c),
            x, w_in, gs, index, flops=up)
    for config in (0, 2):  # (the 256-wide tiles)
        row(f"fused gather up + swiglu, config {config}",
            lambda u, v, g, i, c=config: gg.fused_forward(u, v, g, index=i, epilogue="swiglu",
                                                          config=c),
            x, w_in, gs, index, flops=up)
    du = jnp.asarray(rng.standard_normal((M, 2 * I)), bf)
    row("dense drhs up (H,M)@(M,2I)", lambda u, v: u.T @ v, gathered, du, flops=up)
    row("gather + cutlass drhs up", lambda u, i, v, g: gg.grouped_gemm(
        "drhs", jnp.take(u, i, axis=0), v, g), x, index, du, gs, flops=up)
    for config in gg.FUSED_BACKWARD_CONFIGS:
        row(f"gathered drhs up, config {config}",
            lambda u, v, g, i, c=config: gg.gathered_drhs(u, v, g, index=i, config=c),
            x, du, gs, index, flops=up)
    row("dense down (M,I)@(I,H)", lambda u, v: u @ v, h, dense_out, flops=down)
    row("cutlass down", lambda u, v, g: gg.grouped_gemm("forward", u, v, g), h, w_out, gs,
        flops=down)
    for config in gg.FUSED_CONFIGS:
        row(f"fused down + scale, config {config}",
            lambda u, v, g, s, c=config: gg.fused_forward(u, v, g, epilogue="scale", scale=s, config=c),
            h, w_out, gs, scale, flops=down)
    print(f"# M={M} pairs gathered from X={X} rows, H={H}, I={I}, G={G}, bf16; median of {a.iters}")
    dense = {k: next(r["us"] for r in rows if r["name"].startswith(f"dense {k}"))
             for k in ("up", "drhs", "down")}
    for r in rows:
        ref = dense[next((k for k in ("drhs", "down") if k in r["name"]), "up")]
        print(f"{r['name']:40s} {r['us']:10.1f} us {r['tflops']:7.1f} TFLOP/s  {r['us'] / ref:5.2f}x dense")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(hardware=hardware(), rows=rows, args=vars(a)), f, indent=1)


if __name__ == "__main__":
    main()
