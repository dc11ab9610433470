"""What this platform's lax.ragged_dot does with the rows past the groups (docs/performance.md:
XLA:CPU and XLA:GPU write zeros there; XLA:TPU leaves them unwritten), and whether a NaN in a row
past the groups reaches any pass. Prints one line per pass: ``python tools/ragged_dot_probe.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ep_comm import gemm

M, K, N, SIZES = 256, 128, 128, [40, 0, 70, 30]  # 140 of 256 rows in the groups
total = sum(SIZES)
rng = np.random.default_rng(0)
x = rng.standard_normal((M, K)).astype(np.float32)
x[total:] = np.nan  # poison past the groups
w = rng.standard_normal((len(SIZES), K, N)).astype(np.float32)
dy = rng.standard_normal((M, N)).astype(np.float32)
dy[total:] = np.nan
gs = jnp.array(SIZES, jnp.int32)
for dtype in (jnp.float32, jnp.bfloat16):
    a, b, c = (jnp.asarray(v, dtype) for v in (x, w, dy))
    fwd = jax.jit(lambda a, b: lax.ragged_dot(a, b, gs, precision=lax.Precision.DEFAULT))(a, b)
    drhs = jax.jit(lambda a, c: gemm.pass_kernel("drhs", "xla")(a, c, gs, jnp.float32))(a, c)
    clean = jnp.asarray(np.where(np.arange(M)[:, None] < total, x, 1.0), dtype)
    tail = np.asarray(jax.jit(lambda a, b: lax.ragged_dot(a, b, gs, precision=lax.Precision.DEFAULT))(
        clean, b), np.float32)[total:]
    print(f"{jax.default_backend()} {jnp.dtype(dtype).name}: forward rows past the groups "
          f"{'all zero' if not tail.any() else 'NOT zero (unwritten)'}; NaN past the groups "
          f"reaches forward's groups: {bool(np.isnan(np.asarray(fwd, np.float32)[:total]).any())}"
          f", drhs: {bool(np.isnan(np.asarray(drhs)).any())}; ours past the groups zero: "
          f"{not np.asarray(gemm.pass_kernel('forward', 'xla')(clean, b, gs, dtype), np.float32)[total:].any()}")
