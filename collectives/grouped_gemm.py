"""The experts' grouped GEMM of ep_comm's own on Hopper: CUTLASS 3.x kernels (sm_90a) behind the
XLA FFI (``collectives/csrc/grouped_gemm/passes.cu``, the module ``_ep_gemm``).

One call runs one pass over ``G`` groups of rows (group ``g``: rows ``[off_g, off_g + s_g)``,
``s_g = group_sizes[g]``, contiguous from row 0), float32 accumulation, the result in the inputs'
dtype (bfloat16 or float16), in the layouts CUTLASS's Hopper mainloop reads natively, so that no
operand is transposed in memory:

- ``"forward"``: ``a (M, K)``, ``b (G, K, N)`` -> ``(M, N)``, ``out[r] = a[r] @ b[g]``;
- ``"dlhs"``: ``a (M, N)``, ``b (G, K, N)`` -> ``(M, K)``, ``out[r] = a[r] @ b[g].T`` (``b`` read
  K-major where it lies);
- ``"drhs"``: ``a (M, K)``, ``b (M, N)`` -> ``(G, K, N)``, ``out[g] = a[rows of g].T @ b[rows of
  g]`` (``a`` read M-major where it lies), zero for an empty group.

The group sizes stay on the device (a setup kernel writes CUTLASS's per-group problems, pointers
and strides; the persistent scheduler reads them there). Rows past the groups of ``forward`` and
``dlhs`` are zero with ``zero_tail=True``, else unwritten. Malformed sizes are clamped (a negative
size is 0; the groups end at row ``M``), so no kernel reaches outside its buffers.

:func:`ep_comm.grouped_matmul` (``implementation="cutlass"``) is the user-facing entry point; this
module is the engine's call and its rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ep_comm.collectives import bootstrap

PASSES = ("forward", "dlhs", "drhs")
# The tile configs compiled in (collectives/csrc/grouped_gemm/impl.cuh): 0 cooperative (two
# warpgroups on a 128x256 tile), 1 ping-pong (a 128x128 tile per warpgroup, one's epilogue under
# the other's mainloop), 2 cooperative 256x128 in 1x2 clusters (A multicast), 3 cooperative
# 128x256 in 2x1 clusters (B multicast), 4 cooperative 128x256 in 1x2 clusters (A multicast;
# groups rounded to 128 rows, not 256 as in 2 and 3). The defaults per pass (DEFAULT_CONFIGS)
# are the configs fastest over the up and down GEMMs of the pass in layer_bench's GEMM rows on
# an H200 at the DeepSeek-V3 rank shape (docs/performance.md: every pass 0.95x-1.12x its dense
# einsum).
CONFIGS = (0, 1, 2, 3, 4)
# The fused kernels' configs (cp.async, no clusters): fused_forward's FUSED_CONFIGS are 0
# cooperative 128x256, 1 one warpgroup on 128x128, 2 as 0 with w's tiles loaded by TMA (the
# producer's cp.async copies only the gathered rows); gathered_drhs and dswiglu_dlhs take
# FUSED_BACKWARD_CONFIGS (0, 1). TILE_N is each one's tile width (the dswiglu pass's column
# tiles: its handler checks the count it is given against its grid).
FUSED_CONFIGS = (0, 1, 2)
FUSED_BACKWARD_CONFIGS = (0, 1)
TILE_N = {0: 256, 1: 128}
DEFAULT_CONFIGS = {"forward": 3, "dlhs": 0, "drhs": 2}
# Per shape, over DEFAULT_CONFIGS: the config of one pass of a GEMM whose weight is (K, N), keyed
# (pass, K, N) (the up projection's (H, 2I), the down one's (I, H)), measured on the layer's own
# routed groups: `python -m ep_comm.benchmarks.layer --groups routed --tune` prints the entries
# (its JSON's "best_cutlass_by_shape"). None measured yet: every shape takes DEFAULT_CONFIGS.
SHAPE_CONFIGS: dict[tuple[str, int, int], int] = {}
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGN = 8  # K and N in elements: 16-byte rows for TMA
MAX_GROUPS = 65535  # the kernel's grids


def unavailable_reason() -> str | None:
    """None when the CUTLASS grouped GEMM runs here (built, a CUDA backend, a Hopper GPU), else
    why not."""
    reason = bootstrap.load("gemm")[1]
    if reason is not None:
        return reason
    if jax.default_backend() != "gpu":
        return f"it runs on CUDA GPUs, and the default backend is {jax.default_backend()}"
    cc = str(getattr(jax.devices()[0], "compute_capability", "unknown"))
    if not cc.startswith("9"):
        return f"its kernels are sm_90a (Hopper), and this GPU's compute capability is {cc}"
    return None


def _ready(api: str) -> None:
    """Raise ``RuntimeError`` naming ``api`` where the kernels do not run (:func:`available`),
    else register their FFI targets."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"{api}: the CUTLASS grouped GEMM does not run here: {why}")
    bootstrap.register_targets("gemm")


def weight_dims(pass_name: str, a_shape, b_shape) -> tuple[int, int]:
    """``(K, N)`` of the weight of the GEMM a pass belongs to (``b`` is that weight in the forward
    and ``dlhs``; ``drhs`` computes it from ``a`` ``(M, K)`` and ``dy`` ``(M, N)``)."""
    if pass_name == "drhs":
        return int(a_shape[1]), int(b_shape[1])
    return int(b_shape[1]), int(b_shape[2])


def config_for(pass_name: str, k: int, n: int) -> int:
    """The tile config a pass runs by default on a weight ``(k, n)``: :data:`SHAPE_CONFIGS`'
    entry, else :data:`DEFAULT_CONFIGS`'."""
    if pass_name not in PASSES:
        raise ValueError(f"config_for: pass_name must be one of {PASSES}, got {pass_name!r}")
    return SHAPE_CONFIGS.get((pass_name, int(k), int(n)), DEFAULT_CONFIGS[pass_name])


def out_shape(pass_name: str, a_shape, b_shape, groups: int) -> tuple:
    if pass_name == "forward":
        return (a_shape[0], b_shape[2])
    if pass_name == "dlhs":
        return (a_shape[0], b_shape[1])
    return (groups, a_shape[1], b_shape[1])


def unsupported(pass_name: str, a, b, out_dtype) -> str | None:
    """Why the kernel does not take these operands (None when it does): the dtypes, and K and N
    as multiples of :data:`ALIGN`."""
    if jnp.dtype(a.dtype) not in DTYPES or b.dtype != a.dtype:
        return (f"the kernel takes bfloat16 or float16 operands of one dtype, got {a.dtype} and "
                f"{b.dtype}")
    if jnp.dtype(out_dtype) != jnp.dtype(a.dtype):
        return f"the kernel writes the inputs' dtype {a.dtype}, not {jnp.dtype(out_dtype)}"
    if pass_name == "forward":  # (K, N) of the operands
        dims = (a.shape[1], b.shape[2])
    elif pass_name == "dlhs":
        dims = (b.shape[1], a.shape[1])
    else:
        dims = (a.shape[1], b.shape[1])
    if any(d % ALIGN for d in dims):
        return f"the kernel needs K and N to be multiples of {ALIGN}, got K={dims[0]}, N={dims[1]}"
    return None


def grouped_gemm(pass_name: str, a, b, group_sizes, *, zero_tail: bool = True,
                 config: int | None = None):
    """One pass of the grouped GEMM (module docstring) with tile config ``config`` (one of
    :data:`CONFIGS`; default :func:`config_for` the weight's shape); raises ``ValueError`` for
    operands the kernel does not take and ``RuntimeError`` where it does not run
    (:func:`available`)."""
    if pass_name not in PASSES:
        raise ValueError(f"grouped_gemm: pass_name must be one of {PASSES}, got {pass_name!r}")
    if config is None:
        config = config_for(pass_name, *weight_dims(pass_name, a.shape, b.shape))
    if config not in CONFIGS:
        raise ValueError(f"grouped_gemm: config must be one of {CONFIGS}, got {config!r}")
    why = unsupported(pass_name, a, b, a.dtype)
    if why is not None:
        raise ValueError(f"grouped_gemm: {why}")
    if group_sizes.shape[0] > MAX_GROUPS:
        raise ValueError(f"grouped_gemm: group_sizes must hold at most {MAX_GROUPS} groups, got "
                         f"{group_sizes.shape[0]}")
    _ready("grouped_gemm")
    index, groups = PASSES.index(pass_name), group_sizes.shape[0]
    shape = out_shape(pass_name, a.shape, b.shape, groups)
    # the workspace (group arguments, CUTLASS's tensor maps) as a second result: XLA allocates
    # it with the program's buffers, so it lives as long as the kernels that use it
    call = jax.ffi.ffi_call("ep_comm_grouped_gemm", (
        jax.ShapeDtypeStruct(shape, a.dtype),
        jax.ShapeDtypeStruct((workspace_bytes(index, config, groups),), jnp.uint8)))
    attrs = {"pass": np.int64(index), "zero_tail": np.int64(bool(zero_tail)),
             "config": np.int64(config)}
    return call(a, b, group_sizes.astype(jnp.int32), **attrs)[0]


@functools.lru_cache(maxsize=None)
def workspace_bytes(pass_index: int, config: int, groups: int) -> int:
    """Bytes of the workspace one call takes (asks the module, which asks the GPU)."""
    return int(bootstrap.load("gemm")[0].workspace_bytes(pass_index, config, groups))


EPILOGUES = ("store", "swiglu", "scale")


def fused_forward(x, w, group_sizes, *, index=None, epilogue: str = "store", scale=None,
                  zero_tail: bool = True, config: int = 0):
    """The fused forward pass (``collectives/csrc/grouped_gemm/gather.cu``): for the rows ``r``
    of group ``g``, ``acc = x[index[r]] @ w[g]`` (``x[r]`` without ``index``), float32, then

    - ``"store"``: ``out[r] = acc`` (``(M, N)``);
    - ``"swiglu"``: ``out[r] = silu(acc[:I]) * acc[I:]`` (``(M, I)``, ``I = N / 2``: ``w``'s first
      ``I`` columns the gate projection, its last ``I`` the up projection; tile config 0 or 2);
    - ``"scale"``: ``out[r] = acc * scale[r]`` (``scale`` float32 ``(M,)``: the pairs' router
      weights).

    ``x`` ``(X, K)`` and ``w`` ``(G, K, N)`` bfloat16 or float16; ``index`` int32 ``(M,)`` (an
    entry outside ``[0, X)`` reads a zero row); ``M`` is ``index``'s length, else ``X``. Rows past
    the groups are zero with ``zero_tail``. Raises ``ValueError`` for operands the kernel does
    not take and ``RuntimeError`` where it does not run (:func:`available`)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"fused_forward: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if config not in FUSED_CONFIGS or (epilogue == "swiglu" and config == 1):
        raise ValueError(f"fused_forward: config must be one of {FUSED_CONFIGS} (0 or 2 with "
                         f"swiglu), got {config!r}")
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"fused_forward: x (X, K), w (G, K, N) and group_sizes (G,) must fit, got "
                         f"x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
    why = unsupported("forward", x, w, x.dtype)
    if why is None and epilogue == "swiglu" and w.shape[2] % 16:
        why = f"swiglu needs N = 2I with I a multiple of 8, got N={w.shape[2]}"
    if why is not None:
        raise ValueError(f"fused_forward: {why}")
    M = x.shape[0] if index is None else index.shape[0]
    if epilogue == "scale" and (scale is None or scale.shape != (M,)):
        raise ValueError(f"fused_forward: the scale epilogue takes scale of shape ({M},), got "
                         f"{None if scale is None else scale.shape}")
    _ready("fused_forward")
    N = w.shape[2] // 2 if epilogue == "swiglu" else w.shape[2]
    none_i, none_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call("ep_comm_grouped_gemm_fused", jax.ShapeDtypeStruct((M, N), x.dtype))
    return call(x, none_i if index is None else index.astype(jnp.int32), w,
                group_sizes.astype(jnp.int32),
                none_f if scale is None else scale.astype(jnp.float32),
                epilogue=np.int64(EPILOGUES.index(epilogue)), config=np.int64(config),
                zero_tail=np.int64(bool(zero_tail)))


def fused_forward_reference(x, w, group_sizes, *, index=None, epilogue: str = "store",
                            scale=None):
    """:func:`fused_forward` in plain JAX (any platform; float32 products, rows past the groups
    zero): what the kernel is checked against."""
    M = x.shape[0] if index is None else index.shape[0]
    rows = _gathered_rows(x, index)
    clamped = _clamped_sizes(group_sizes, M)
    acc = jax.lax.ragged_dot(rows.astype(jnp.float32), w.astype(jnp.float32), clamped)
    total = jnp.sum(clamped)
    if epilogue == "swiglu":
        I = w.shape[2] // 2
        acc = jax.nn.silu(acc[:, :I]) * acc[:, I:]
    elif epilogue == "scale":
        acc = acc * scale[:, None]
    return jnp.where((jnp.arange(M) < total)[:, None], acc, 0).astype(x.dtype)


def gathered_drhs(x, dy, group_sizes, *, index=None, config: int = 0):
    """The weight gradient with ``x``'s rows gathered in the prologue
    (``collectives/csrc/grouped_gemm/gather.cu``): ``out[g] = sum_r x[index[r]]^T dy[r]`` over
    the rows ``r`` of group ``g`` (``(G, K, N)``, float32 sums; zero for an empty group), so the
    pairs' rows are not written for the backward either. ``x`` ``(X, K)``, ``dy`` ``(M, N)``,
    ``index`` int32 ``(M,)`` (outside ``[0, X)``: a zero row; none: ``x``'s row ``r``, ``X ==
    M``); bfloat16 or float16, K and N multiples of 8. Raises as :func:`fused_forward`."""
    if config not in FUSED_BACKWARD_CONFIGS:
        raise ValueError(f"gathered_drhs: config must be one of {FUSED_BACKWARD_CONFIGS}, got "
                         f"{config!r}")
    if x.ndim != 2 or dy.ndim != 2 or (index is None and x.shape[0] != dy.shape[0]) or (
            index is not None and index.shape != (dy.shape[0],)):
        raise ValueError(f"gathered_drhs: x (X, K), dy (M, N) and index (M,) must fit, got x "
                         f"{x.shape}, dy {dy.shape}, index {None if index is None else index.shape}")
    why = unsupported("drhs", x, dy, x.dtype)
    if why is not None:
        raise ValueError(f"gathered_drhs: {why}")
    _ready("gathered_drhs")
    G = group_sizes.shape[0]
    call = jax.ffi.ffi_call("ep_comm_grouped_gemm_drhs_gather",
                            jax.ShapeDtypeStruct((G, x.shape[1], dy.shape[1]), x.dtype))
    return call(x, jnp.zeros((0,), jnp.int32) if index is None else index.astype(jnp.int32), dy,
                group_sizes.astype(jnp.int32), config=np.int64(config))


def _gathered_rows(x, index):
    """``x``'s rows by ``index`` (outside ``[0, X)``: zero rows), or ``x``."""
    if index is None:
        return x
    ok = (index >= 0) & (index < x.shape[0])
    return jnp.where(ok[:, None], jnp.take(x, jnp.clip(index, 0, x.shape[0] - 1), axis=0), 0)


def _clamped_sizes(group_sizes, M):
    """The group sizes as the kernels clamp them (a negative size is 0, the groups end at M)."""
    ends = jnp.minimum(jnp.cumsum(jnp.clip(jnp.asarray(group_sizes, jnp.int32), 0)), M)
    return ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def gathered_drhs_reference(x, dy, group_sizes, *, index=None):
    """:func:`gathered_drhs` in plain JAX (float32 products, in ``x``'s dtype)."""
    rows = _gathered_rows(x, index).astype(jnp.float32)
    sizes = _clamped_sizes(group_sizes, dy.shape[0])
    out = jax.lax.ragged_dot_general(
        rows, dy.astype(jnp.float32), sizes, jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[]))
    return out.astype(x.dtype)


def dswiglu_dlhs(dy, w_out, group_sizes, u, h, scale, *, config: int = 0):
    """The down projection's ``dlhs`` with SwiGLU's derivative in its epilogue
    (``collectives/csrc/grouped_gemm/gather.cu``), for the rows ``r`` of group ``g``:
    ``dh_w = dy[r] @ w_out[g].T`` (``w_out`` ``(G, I, H)`` read K-major in place), ``dh = dh_w *
    scale[r]``, and with ``gate, up = u[r, :I], u[r, I:]``, ``s = sigmoid(gate)``:

    - ``du`` ``(M, 2I)``: ``[dh * up * s * (1 + gate * (1 - s)), dh * gate * s]``;
    - ``part`` ``(M, I / BN)`` float32: each column tile's ``sum dh_w * h[r]``, whose row sums
      are the router weights' gradient (``h`` ``(M, I)``: the forward's ``silu(gate) * up``).

    Rows past the groups are left unwritten. Raises as :func:`fused_forward`."""
    if config not in FUSED_BACKWARD_CONFIGS:
        raise ValueError(f"dswiglu_dlhs: config must be one of {FUSED_BACKWARD_CONFIGS}, got "
                         f"{config!r}")
    M, I = h.shape
    if (dy.ndim != 2 or dy.shape[0] != M or w_out.shape != (group_sizes.shape[0], I, dy.shape[1])
            or u.shape != (M, 2 * I) or scale.shape != (M,)):
        raise ValueError(f"dswiglu_dlhs: dy (M, H), w_out (G, I, H), u (M, 2I), h (M, I) and "
                         f"scale (M,) must fit, got dy {dy.shape}, w_out {w_out.shape}, u "
                         f"{u.shape}, h {h.shape}, scale {scale.shape}")
    why = unsupported("dlhs", dy, w_out, dy.dtype)
    if why is None and (u.dtype != dy.dtype or h.dtype != dy.dtype):
        why = f"u and h must have dy's dtype {dy.dtype}, got {u.dtype} and {h.dtype}"
    if why is not None:
        raise ValueError(f"dswiglu_dlhs: {why}")
    _ready("dswiglu_dlhs")
    tiles = -(-I // TILE_N[config])
    call = jax.ffi.ffi_call("ep_comm_grouped_gemm_dswiglu", (
        jax.ShapeDtypeStruct((M, 2 * I), dy.dtype), jax.ShapeDtypeStruct((M, tiles), jnp.float32)))
    return call(dy, w_out, group_sizes.astype(jnp.int32), u, h, scale.astype(jnp.float32),
                config=np.int64(config))


def dswiglu_dlhs_reference(dy, w_out, group_sizes, u, h, scale):
    """:func:`dswiglu_dlhs` in plain JAX: ``(du, d_scale)`` with the router weights' gradient
    ``d_scale`` ``(M,)`` already summed over the columns (zero past the groups)."""
    M, I = h.shape
    sizes = _clamped_sizes(group_sizes, M)
    dh_w = jax.lax.ragged_dot(dy.astype(jnp.float32),
                              jnp.swapaxes(w_out, 1, 2).astype(jnp.float32), sizes)
    grouped = jnp.arange(M) < jnp.sum(sizes)
    d_scale = jnp.where(grouped, jnp.sum(dh_w * h.astype(jnp.float32), 1), 0.0)
    dh = dh_w * scale[:, None]
    gate, up = u[:, :I].astype(jnp.float32), u[:, I:].astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    du = jnp.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], axis=1)
    return jnp.where(grouped[:, None], du, 0).astype(dy.dtype), d_scale
