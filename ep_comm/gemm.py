"""``grouped_matmul``: the experts' GEMM, ``jax.lax.ragged_dot`` semantics, the fastest correct
kernel per platform and per pass.

``out[r] = x[r] @ w[g]`` for the rows ``r`` of group ``g`` (groups are contiguous from row 0, in
order, ``group_sizes[g]`` rows each); rows past ``sum(group_sizes)`` are zero.

Three passes, each with its own kernel choice (:data:`PASSES`): the forward product, ``dlhs``
(``dy @ w[g].T`` per group, a grouped GEMM again) and ``drhs`` (``x[rows of g].T @ dy[rows of g]``,
a GEMM whose contracting dimension is ragged). Implementations:

- ``"xla"``: ``jax.lax.ragged_dot`` / ``ragged_dot_general``. Exact on every platform; on GPU XLA
  lowers it to a dense masked matmul over ``[groups, rows, K]`` (about 30x off the GPU, and out of
  memory at a few hundred groups), so it is the CPU choice.
- ``"tokamax"``: tokamax's Pallas kernels: Mosaic GPU on GPUs (Hopper; bf16/f16 inputs), with
  the tile configs measured on an H200 in :data:`TOKAMAX_CONFIGS`, needs ``pip install
  ep_comm[gpu]`` (tokamax, jax >= 0.11.1); Mosaic TPU on TPUs (the megablox kernel; every
  dimension at least 128; tokamax's heuristics), ``pip install ep_comm[tpu]``. These kernels do
  not write rows past the groups; ``grouped_matmul`` zeroes them (a select that XLA fuses into the
  next elementwise op), so results never depend on which kernel ran and no uninitialised row
  reaches a later ``drhs``.
- ``"cutlass"``: ep_comm's own grouped GEMM on Hopper (:mod:`ep_comm.collectives.grouped_gemm`: CUTLASS
  3.x pointer-array kernels, sm_90a, built when the ``nvidia-cutlass`` headers are present),
  bf16/f16 with K and N multiples of 8, every pass in the layout it is given (``dlhs`` reads ``w``
  K-major in place, ``drhs`` reads ``x`` M-major in place: no transposes).
- ``"megablox"``: JAX's Pallas TPU grouped GEMM (``jax.experimental.pallas.ops.tpu.megablox``,
  what MaxText runs on TPUs): ``gmm`` for the forward and ``dlhs``, ``tgmm`` for ``drhs``, with
  tiles per pass and shape from a measured table (:func:`megablox_tiling`). Every float dtype;
  off TPU it runs in Pallas's interpret mode (for tests).
- ``"auto"`` (default): on a Hopper GPU with 16-bit dtypes, ``"cutlass"`` for each pass whose
  operands its kernel takes (on an H200 at the DeepSeek-V3 EP8 rank shape its forward and dlhs
  ran at 1.09x the dense einsum of the same FLOPs, tokamax's at 1.12x and 1.71x:
  ``docs/performance.md``; ``EP_COMM_AUTO_CUTLASS=0`` opts out); otherwise on a GPU backend
  with 16-bit dtypes ``"tokamax"`` when its kernel imports, else ``"xla"``. Where a GPU with
  16-bit dtypes falls back from ``"cutlass"`` (not Hopper, the module not built, a shape it does
  not take), ep_comm's logger says why, once per reason. On TPUs with 16-bit dtypes ``"auto"``
  is ``"megablox"`` for each pass whose ``K`` and ``N`` (``w``'s last two dimensions) are at
  least 128, else ``"xla"``: on a v5e, T=4096, top-8 of 32, ``moe_layer`` on megablox ran 1.47x
  (H=2048, I=1024) and 1.48x (H=7168, I=2048) the dense einsums of the same FLOPs forward,
  1.74x and 1.75x forward+backward, where on XLA:TPU's ragged dot it ran 1.99x and 2.19x
  forward, 2.14x and 2.26x forward+backward (``docs/bench/tpu_v5e/``: ``megablox/`` and
  ``layer_*ragged_dot.txt``, each ratio against the dense einsums of its own run). tokamax
  0.0.12's Mosaic TPU kernel with its untuned heuristics ran the layer 6.6x slower than the
  ragged dot (``layer_tokamax.txt``), so it is there only when named.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ep_comm.collectives import grouped_gemm
from ep_comm.topology._jax_compat import cotangent_like, match_vma, vma_unchecked

PASSES = ("forward", "dlhs", "drhs")
IMPLEMENTATIONS = ("auto", "xla", "tokamax", "cutlass", "megablox")

# ragged over the rows of lhs, rhs grouped over its leading axis: (M, K) x (G, K, N) -> (M, N)
_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# ragged contracting dimension: (M, K) x (M, N) -> (G, K, N), group g summing its own rows
_RAGGED_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])

# Tile configs of tokamax's Mosaic GPU kernels per pass on Hopper (sm90), measured on one H200 (bf16,
# the DeepSeek-V3 EP8 per-rank shape; table and command in docs/bench/h200x1_layer/). Any other GPU
# generation: tokamax's heuristics.
# "heuristics" as a config: tokamax's own choice. Measured: forward/dlhs at 1.0-1.25x a dense
# einsum of the same FLOPs with 128x128x64 tiles walking M first in strips of 8; drhs at 1.8-2.0x
# with 128x128x128 tiles, 3 stages (its heuristics: 3.0-3.4x). drhs with block_k=64 gave WRONG
# results there (tokamax 0.0.17), so block_k stays 128.
_SM90_GEMM = dict(block_m=128, block_n=128, block_k=64, num_stages=4, split_k=1,
                 persistent=False, grid_minor_dim=0, grid_tile_width=8)
TOKAMAX_CONFIGS: dict[str, dict[str, Any] | str] = {
    "forward": _SM90_GEMM,
    "dlhs": _SM90_GEMM,
    "drhs": dict(block_m=128, block_n=128, block_k=128, num_stages=3, split_k=1,
                 persistent=False),
}


def tokamax_available() -> bool:
    """Whether tokamax's ragged dot for this backend imports here (GPU: Mosaic GPU, which needs
    jax >= 0.11.1; TPU: Mosaic TPU)."""
    return _tokamax_op()[0] is not None


def tokamax_unavailable_reason() -> str | None:
    """Why :func:`tokamax_available` is False here (the import's error), or None."""
    return _tokamax_op()[1]


@functools.lru_cache(maxsize=None)
def _tokamax_op():
    """``((module, kernel class), None)`` of tokamax's ragged dot for the default backend, or
    ``(None, why)``."""
    try:
        if jax.default_backend() == "tpu":
            from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as mod
            op = mod, mod.PallasMosaicTpuRaggedDot
        else:
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as mod
            op = mod, mod.PallasMosaicGpuRaggedDot
        # tokamax reads its options from absl flags, parsing the whole sys.argv the first time
        # unless a program already did: any other command-line option (a benchmark's, a
        # user's) would then raise. Parse them here, taking only the flags absl knows.
        from absl import flags
        if not flags.FLAGS.is_parsed():
            flags.FLAGS(sys.argv or ["ep_comm"], known_only=True)
        return op, None
    except Exception as e:  # not installed, or a jax it does not support: the "xla" path stays
        return None, f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def _tokamax_kernel(config: tuple | None):
    mod, kernel = _tokamax_op()[0]
    config = None if config is None else mod.Config(**dict(config))
    return kernel(config=config)


# megablox (jax.experimental.pallas.ops.tpu.megablox: the Pallas TPU grouped GEMM MaxText runs):
# tiles (tm, tk, tn) per pass and per (K, N) of that pass's product, picked by a sweep on a TPU v5e
# (docs/bench/tpu_v5e/megablox/: tools/tpu_megablox.py). Elsewhere MaxText's default.
MEGABLOX_DEFAULT_TILING = (512, 1024, 1024)
MEGABLOX_TILINGS: dict[tuple[str, int, int], tuple[int, int, int]] = {
    # T=4096, top-8 of 32 on one rank (32768 rows in 32 routed groups), H=2048, I=1024: the up
    # projection (K=2048, N=2I=2048) and the down one (K=1024, N=2048), keyed (pass, K, N) as
    # each pass's kernel sees them; 0.87-0.99x of MaxText's tiling per pass (sweep_H2048_run1.txt)
    ("forward", 2048, 2048): (256, 2048, 1024),
    ("dlhs", 2048, 2048): (256, 2048, 1024),
    ("drhs", 2048, 2048): (256, 1024, 1024),
    ("forward", 1024, 2048): (256, 1024, 2048),
    ("dlhs", 2048, 1024): (256, 2048, 1024),
    ("drhs", 1024, 2048): (512, 512, 2048),
    # the same at H=7168, I=2048 (a DeepSeek-V3-like rank): up K=7168, N=4096; down K=2048,
    # N=7168; 0.84-1.00x of MaxText's tiling per pass (megablox_H7168.txt)
    ("forward", 7168, 4096): (256, 1024, 2048),
    ("dlhs", 4096, 7168): (512, 1024, 1024),
    ("drhs", 7168, 4096): (256, 1024, 1024),
    ("forward", 2048, 7168): (256, 2048, 1024),
    ("dlhs", 7168, 2048): (256, 1024, 2048),
    ("drhs", 2048, 7168): (256, 1024, 1024),
}


def megablox_tiling(pass_name: str, m: int, k: int, n: int,
                    tiling: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """The megablox tiles of one pass over ``(M, K) -> (M, N)`` (``drhs``: ``M`` the ragged
    contracting rows): ``tiling``, or :data:`MEGABLOX_TILINGS`' entry, or
    :data:`MEGABLOX_DEFAULT_TILING`, each clipped to its dimension (``tk`` and ``tn`` may leave a
    remainder, which the kernel masks; ``tm`` is halved until it divides ``M``, to 8 at least:
    the rows are padded to a multiple of it below that)."""
    tm, tk, tn = tiling or MEGABLOX_TILINGS.get((pass_name, k, n), MEGABLOX_DEFAULT_TILING)
    tm = max(8, min(tm, 1 << max(3, (m - 1).bit_length())))
    while m % tm and tm > 8:
        tm //= 2
    return tm, min(tk, k), min(tn, n)


TPU_MIN_DIM = 128  # tokamax's Mosaic TPU kernel takes no dimension below this


def _tpu_too_small(x, w) -> bool:
    return jax.default_backend() == "tpu" and min(*x.shape, *w.shape[1:]) < TPU_MIN_DIM


def resolve_implementation(implementation: str, dtype, api: str = "grouped_matmul") -> str:
    """The implementation ``"auto"`` means here for inputs of ``dtype``; checks the name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{api}: implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    sixteen_bit = _sixteen_bit(dtype)
    if implementation == "auto":
        if jax.default_backend() == "tpu" and sixteen_bit:
            return "megablox"  # (each pass's shapes: pass_implementations)
        if jax.default_backend() == "gpu" and sixteen_bit and auto_cutlass():
            why = grouped_gemm.unavailable_reason()
            if why is None:
                return "cutlass"  # (each pass's shapes: pass_implementations)
            note_once(f"ep_comm: implementation='auto' does not run ep_comm's CUTLASS grouped "
                      f"GEMM here ({why}); it runs {_fallback(dtype)!r}")
        return _fallback(dtype)
    if implementation == "cutlass":
        why = grouped_gemm.unavailable_reason()
        if why is not None:
            raise ValueError(f"{api}: implementation='cutlass' does not run here: {why}")
        if not sixteen_bit:
            raise ValueError(f"{api}: implementation='cutlass' takes bfloat16 or float16 inputs, "
                             f"got {jnp.dtype(dtype).name}")
    if implementation == "tokamax":
        if not tokamax_available():
            raise ValueError(f"{api}: implementation='tokamax' needs tokamax (pip install "
                             f"'ep_comm[gpu]', jax >= 0.11.1, or 'ep_comm[tpu]'), which does "
                             f"not import here ({tokamax_unavailable_reason()})")
        if not sixteen_bit:
            raise ValueError(f"{api}: implementation='tokamax' takes bfloat16 or float16 "
                             f"inputs, got {jnp.dtype(dtype).name}")
    return implementation


def auto_cutlass() -> bool:
    """Whether ``"auto"`` may pick the CUTLASS kernel: unless ``EP_COMM_AUTO_CUTLASS=0`` (read
    at each call; module docstring)."""
    flag = os.environ.get("EP_COMM_AUTO_CUTLASS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"EP_COMM_AUTO_CUTLASS must be 0 or 1, got {flag!r}")
    return flag == "1"


def _fallback(dtype) -> str:
    """What ``"auto"`` runs where the CUTLASS kernel does not: tokamax on a GPU backend with
    16-bit dtypes where it imports, else XLA's ragged dot (on TPUs too, measured faster than
    tokamax's kernel there: module docstring)."""
    gpu = jax.default_backend() == "gpu"
    return "tokamax" if gpu and _sixteen_bit(dtype) and tokamax_available() else "xla"


_noted: set[str] = set()


def note_once(message: str) -> None:
    """``message`` on ep_comm's logger (WARNING), once per process."""
    if message not in _noted:
        _noted.add(message)
        logging.getLogger("ep_comm").warning(message)


def _sixteen_bit(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _hopper() -> bool:
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def _zero_past_groups(out, group_sizes):
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def pass_kernel(pass_name: str, impl: str, config: dict | None = None):
    """The kernel of one pass as ``f(a, b, group_sizes, out_dtype)``; ``impl`` is ``"xla"``,
    ``"tokamax"`` or ``"cutlass"`` (resolved), ``config`` a tokamax tile config or
    ``"heuristics"`` (tokamax's own; default: :data:`TOKAMAX_CONFIGS` on Hopper, heuristics
    elsewhere), or for ``"cutlass"`` one of ``ep_comm.collectives.grouped_gemm.CONFIGS``.

    ``forward``: ``(M, K) x (G, K, N) -> (M, N)`` grouped over the rows, zero past the
    groups; ``dlhs``: ``(M, N) x (G, K, N) -> (M, K)``, ``dy @ w[g].T`` (``w`` as the forward
    took it); ``drhs``: ``(M, K) x (M, N) -> (G, K, N)``, group ``g`` contracting its own rows."""
    if pass_name not in PASSES:
        raise ValueError(f"pass_kernel: pass_name must be one of {PASSES}, got {pass_name!r}")
    dims = _RAGGED_CONTRACTING if pass_name == "drhs" else _RAGGED_ROWS
    if impl == "megablox":  # config: a tiling (tm, tk, tn), default megablox_tiling's
        return functools.partial(_megablox, pass_name, config)
    if impl == "cutlass":  # config: a tile config of collectives.grouped_gemm.CONFIGS
        def cutlass(a, b, group_sizes, out_dtype, zero_tail=True):
            return grouped_gemm.grouped_gemm(pass_name, a, b, group_sizes, zero_tail=zero_tail,
                                             config=config)
        return cutlass
    # the other kernels take dlhs's w transposed, (G, N, K): a copy XLA makes
    prepare = (lambda b: jnp.swapaxes(b, 1, 2)) if pass_name == "dlhs" else (lambda b: b)
    if impl == "xla":
        def xla(a, b, group_sizes, out_dtype, zero_tail=True):
            b = prepare(b)
            # 16-bit inputs: every precision is the same product; explicit, since XLA:TPU's
            # ragged dot fails to compile bf16 at a global jax_default_matmul_precision="highest"
            precision = lax.Precision.DEFAULT if _sixteen_bit(a.dtype) else None
            out = lax.ragged_dot_general(a, b, group_sizes, dims, precision=precision,
                                         preferred_element_type=out_dtype)
            if pass_name == "drhs" or not zero_tail:
                return out
            # XLA:CPU and XLA:GPU zero the rows past the groups; XLA:TPU leaves them unwritten
            return lax.platform_dependent(out, group_sizes, tpu=_zero_past_groups,
                                          default=lambda o, g: o)
        return xla
    if config is None:
        config = TOKAMAX_CONFIGS.get(pass_name, "heuristics") if _hopper() else "heuristics"
    kernel = _tokamax_kernel(None if config == "heuristics" else tuple(sorted(config.items())))
    # Inside shard_map, the Mosaic TPU kernel's Pallas outputs declare no varying axes, which
    # jax 0.10 rejects under check_vma: that kernel is traced unchecked, then typed as its
    # inputs. Only that one: the Mosaic GPU kernel traces and runs checked (the H200 layer
    # rows before the TPU fix), while in that context jax 0.11.2 met its group-size arithmetic
    # with mixed types ("Primitive max requires varying manual axes to match", on an H200).
    unchecked = (vma_unchecked if _tokamax_op()[0][0].__name__.endswith("pallas_mosaic_tpu")
                 else contextlib.nullcontext)

    def tokamax(a, b, group_sizes, out_dtype, zero_tail=True):
        b = prepare(b)
        # 16-bit inputs: every precision is the same product (explicit, so that a global
        # jax_default_matmul_precision does not make the kernel decline)
        with unchecked():
            out = kernel(a, b, group_sizes=group_sizes, ragged_dot_dimension_numbers=dims,
                         precision=lax.Precision.DEFAULT, preferred_element_type=out_dtype)
        out = match_vma(match_vma(out, a), b)
        # The drhs kernel masks rows outside a group by multiplying with 0, so the rows past the
        # groups it reads must be finite: they are, since the row passes zero them here.
        if pass_name == "drhs" or not zero_tail:
            return out
        return _zero_past_groups(out, group_sizes)
    return tokamax


@contextlib.contextmanager
def pallas_trace(dtype):
    """How ep_comm traces a Pallas TPU kernel (megablox's, :mod:`ep_comm.swiglu_gmm`'s) of
    inputs of ``dtype``; the caller types its output as its inputs with ``match_vma``.

    16-bit inputs: every precision is the same product, so the kernel is traced at the default
    one, since Mosaic fails to compile a bf16 dot at a global
    ``jax_default_matmul_precision="highest"`` ("Bad lhs type", as XLA:TPU's ragged dot does
    above). Pallas outputs declare no varying axes inside ``shard_map``: traced unchecked."""
    precision = (jax.default_matmul_precision("default") if _sixteen_bit(dtype)
                 else contextlib.nullcontext())
    with vma_unchecked(), precision:
        yield


def _megablox(pass_name, tiling, a, b, group_sizes, out_dtype, zero_tail=True):
    """One pass on megablox: ``gmm`` for the forward and ``dlhs`` (``w`` read transposed in
    place), ``tgmm`` for ``drhs`` (``x`` transposed: an XLA copy). Off TPU in Pallas's interpret
    mode (slow: for tests). Rows past the groups: ``gmm`` leaves them unwritten (zeroed here
    when ``zero_tail``), ``tgmm`` masks them with a select (any values there are safe)."""
    # the module (the package's own `gmm` name is ops.gmm, a custom_vjp of the kernel)
    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    m = a.shape[0]
    k = a.shape[1]
    n = b.shape[1] if pass_name in ("dlhs", "drhs") else b.shape[2]
    tm, tk, tn = megablox_tiling(pass_name, m, k, n, tiling)
    rows = -(-m // tm) * tm  # padded to whole row tiles (past the groups: never read)
    pad = lambda v: v if rows == m else jnp.pad(v, ((0, rows - m), (0, 0)))  # noqa: E731
    interpret = jax.default_backend() != "tpu"
    with pallas_trace(a.dtype):
        if pass_name == "drhs":
            out = megablox.tgmm(pad(a).T, pad(b), group_sizes, out_dtype, tiling=(tm, tk, tn),
                                interpret=interpret)
        else:
            out = megablox.gmm(pad(a), b, group_sizes, out_dtype, tiling=(tm, tk, tn),
                               transpose_rhs=pass_name == "dlhs", interpret=interpret)[:m]
    out = match_vma(match_vma(out, a), b)
    if pass_name == "drhs" or not zero_tail:
        return out
    return _zero_past_groups(out, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, impls, out_dtype, zero_tail):
    out = pass_kernel("forward", impls[0])(x, w, group_sizes, out_dtype, zero_tail)
    return match_vma(match_vma(out, x), w)


def _grouped_fwd(x, w, group_sizes, impls, out_dtype, zero_tail):
    return _grouped(x, w, group_sizes, impls, out_dtype, zero_tail), (x, w, group_sizes)


def _grouped_bwd(impls, out_dtype, zero_tail, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)  # kernels take one input dtype; they accumulate in float32
    if "tokamax" in impls[1:]:  # rows past the groups: zero, as the output's are (fused select)
        dy = _zero_past_groups(dy, group_sizes)
    dx = pass_kernel("dlhs", impls[1])(dy, w, group_sizes, x.dtype)
    dw = pass_kernel("drhs", impls[2])(x, dy, group_sizes, w.dtype)
    gs_cot = np.zeros(group_sizes.shape, jax.dtypes.float0)
    # (a weight replicated over a data axis: its gradient summed over that axis)
    return cotangent_like(dx, x), cotangent_like(dw, w), gs_cot


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def pass_implementations(implementation, x, w, out_dtype=None, api: str = "grouped_matmul"):
    """The kernel each pass of ``grouped_matmul(x, w, ..., implementation=implementation)`` runs:
    a tuple over :data:`PASSES` of resolved names (``x`` and ``w`` may be shape structs).
    Raises ``ValueError`` for a choice these operands cannot take."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if isinstance(implementation, dict):
        unknown = set(implementation) - set(PASSES)
        if unknown:
            raise ValueError(f"{api}: implementation dict keys must be among {PASSES}, "
                             f"got {sorted(unknown)}")
        choice = [implementation.get(p, "auto") for p in PASSES]
    else:
        choice = [implementation] * len(PASSES)
    impls = [resolve_implementation(c, x.dtype, api) for c in choice]
    for i, impl in enumerate(impls):  # auto's megablox takes K and N of 128 and up
        if impl == "megablox" and choice[i] == "auto" and min(w.shape[1:]) < TPU_MIN_DIM:
            impls[i] = "xla"
    if "tokamax" in impls and _tpu_too_small(x, w):  # (only when named: auto is not tokamax)
        raise ValueError(f"{api}: implementation='tokamax' on TPU needs every dimension of x "
                         f"and w >= {TPU_MIN_DIM}, got x {tuple(x.shape)} and w "
                         f"{tuple(w.shape)}")
    if "cutlass" in impls:  # what each pass's kernel would take (the backward's in x's dtype)
        dy = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), x.dtype)
        operands = {"forward": (x, w, out_dtype), "dlhs": (dy, w, x.dtype),
                    "drhs": (x, dy, x.dtype)}
        for i, (p, impl) in enumerate(zip(PASSES, impls)):
            why = impl == "cutlass" and grouped_gemm.unsupported(p, *operands[p])
            if why and choice[i] == "auto":  # the fallback, and why, once
                impls[i] = _fallback(x.dtype)
                note_once(f"ep_comm: implementation='auto' runs {impls[i]!r} for the {p} pass "
                          f"of x {x.dtype} {tuple(x.shape)} and w {tuple(w.shape)}, not the "
                          f"CUTLASS grouped GEMM: {why}")
            elif why:
                raise ValueError(f"{api}: implementation='cutlass' ({p}) cannot take x "
                                 f"{x.dtype} {tuple(x.shape)} and w {tuple(w.shape)} with "
                                 f"preferred_element_type={out_dtype}: {why}")
    return tuple(impls)


def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None,
                   implementation: str | dict = "auto", zero_past_groups: bool = True):
    """Grouped GEMM with ``jax.lax.ragged_dot`` semantics; differentiable in ``x`` and ``w``.

    Args:
      x: ``(M, K)`` floating; rows grouped contiguously from row 0 (``expert_x`` from
        :func:`ep_comm.dispatch`). Rows past ``sum(group_sizes)`` do not change the result; with
        tokamax they must be finite under ``grad`` (its weight-gradient kernel masks rows by
        multiplying with zero; it reads at most one tile past the last group). ``dispatch``
        writes zeros in the first ``ep_comm.expand.ZERO_TAIL_ROWS`` rows there.
      w: ``(G, K, N)`` floating, the same dtype as ``x``; one matrix per group (local expert).
      group_sizes: ``(G,)`` integer; rows per group, ``sum(group_sizes) <= M`` (the rows past
        ``M`` of a larger sum are not computed, as in ``ragged_dot``).
      preferred_element_type: output dtype (default ``x.dtype``); kernels accumulate in float32.
      implementation: ``"auto"``, ``"xla"``, ``"tokamax"``, ``"cutlass"`` or ``"megablox"`` for
        every pass
        (module docstring), or a dict
        ``{"forward": ..., "dlhs": ..., "drhs": ...}`` choosing per pass (missing passes: auto).
      zero_past_groups: ``True`` (default): the output's rows past the groups are zero.
        ``False``: they are unspecified (tokamax does not write them; this saves a pass over the
        whole ``(M, N)`` output, which XLA cannot fuse into a consumer that is a custom call,
        such as :func:`ep_comm.combine`'s row kernels). For a consumer that reads only the
        groups' rows.

    Returns:
      ``(M, N)``: ``out[r] = x[r] @ w[g]`` for row ``r`` of group ``g``; past the groups as
      ``zero_past_groups`` says.
    """
    api = "grouped_matmul"
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{api}: x must be a floating array of shape (rows, K), "
                         f"got {x.dtype} {tuple(x.shape)}")
    if w.ndim != 3 or not jnp.issubdtype(w.dtype, jnp.floating) or w.shape[1] != x.shape[1]:
        raise ValueError(f"{api}: w must be a floating array of shape (groups, K, N) with "
                         f"K = x.shape[1] = {x.shape[1]}, got {w.dtype} {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"{api}: w must have x's dtype {x.dtype}, got {w.dtype}")
    if (group_sizes.ndim != 1 or group_sizes.shape[0] != w.shape[0]
            or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
        raise ValueError(f"{api}: group_sizes must be an integer array of shape (groups,) = "
                         f"({w.shape[0]},), got {group_sizes.dtype} {tuple(group_sizes.shape)}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    impls = pass_implementations(implementation, x, w, out_dtype, api)
    if not isinstance(zero_past_groups, bool):
        raise TypeError(f"{api}: zero_past_groups must be a bool, got "
                        f"{type(zero_past_groups).__name__}")
    return _grouped(x, w, group_sizes.astype(jnp.int32), impls, out_dtype, zero_past_groups)
