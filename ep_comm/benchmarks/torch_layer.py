"""PyTorch's MoE layer, the peer a PyTorch user would bring: ``python -m ep_comm.benchmarks.torch_layer``.

One rank's SwiGLU MoE layer in eager PyTorch, as torchtitan and the PyTorch MoE tutorials write
it: a stable ``argsort`` of the flattened top-k ids (the permute), a gather of the tokens,
``torch._grouped_mm`` over the experts' row groups for the up projection (gate and up halves in one
GEMM, as ep_comm's ``w_in``), SwiGLU, ``torch._grouped_mm`` for the down projection, and the
unpermute: the rows back in token order, summed over each token's top-k with the router weights in
float32. Forward (``torch.no_grad``) and forward+backward (autograd: the loss ``sum(y**2)`` in
float32, gradients in ``x``, the router weights and both expert weights, as the JAX layer bench's),
timed with CUDA events: ``--warmup`` calls, then the median of ``--iters``.

Beside it, in the same run, the dense ceiling in PyTorch: ``torch.bmm`` over equal groups of the
same FLOPs (``x torch dense``). ``--jax-json`` takes ``python -m ep_comm.benchmarks.layer``'s JSON
from the same machine and run (same shape, same seed: the same inputs) and adds each row's ratio
to JAX's dense einsums (``x_dense``, as the layer bench's rows) and to ``moe_layer``'s time.

The inputs are the layer bench's (``numpy.random.default_rng(1)``: ids, router weights, ``x``,
``w_in``, ``w_out`` drawn in the same order), so ``#wrong`` counts the first 64 tokens' outputs off
the same float64 reference by more than the dtype's tolerance.

``torch._grouped_mm`` runs on CUDA GPUs of compute capability 9.0 and up; elsewhere (``--device
cpu``, the tests) each group is a ``torch.matmul`` of its rows, so the layer's logic is checked
anywhere torch is installed. torch is not a dependency of ep_comm: this module imports it when run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from ep_comm.benchmarks.gemm_sweep import layer_inputs, wrong_count
from ep_comm.benchmarks.reference import layer_reference
from ep_comm.benchmarks.timing import layer_shape_arguments, save_json


def inputs(tokens, hidden, inter, experts, topk):
    """The layer bench's draws at one rank (its seed and order: :func:`layer_inputs`):
    ``ids``, ``w``, ``x``, ``w_in`` ``(E, H, 2I)``, ``w_out`` ``(E, I, H)``, float32 numpy."""
    return layer_inputs(np.random.default_rng(1), tokens, hidden, inter, experts, topk)


def grouped_mm(torch, a, b_t, offs):
    """``a`` ``(M, K)`` rows grouped by ``offs`` (each group's end row, int32) times ``b_t[g]``
    ``(K, N)``, a transposed view of a contiguous ``(G, N, K)`` weight, as ``torch._grouped_mm``
    takes it: that kernel on a CUDA GPU, a matmul per group elsewhere."""
    if a.is_cuda:
        return torch._grouped_mm(a, b_t, offs=offs)
    starts = [0] + offs[:-1].tolist()
    return torch.cat([a[s:e] @ b_t[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


def moe_layer(torch, x, ids, w, w_in_t, w_out_t):
    """The layer: ``x`` ``(T, H)``, ``ids`` ``(T, K)`` int64, ``w`` ``(T, K)`` float32,
    ``w_in_t`` ``(E, H, 2I)`` and ``w_out_t`` ``(E, I, H)`` transposed views of contiguous
    ``(E, 2I, H)`` and ``(E, H, I)`` weights."""
    T, K = ids.shape
    E, inter = w_out_t.shape[0], w_out_t.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    u = grouped_mm(torch, x[order // K], w_in_t, offs)
    g = u[:, :inter].float()
    h = (torch.nn.functional.silu(g) * u[:, inter:].float()).to(x.dtype)
    y = grouped_mm(torch, h, w_out_t, offs)
    back = torch.empty_like(y).index_copy_(0, order, y)  # pair (t, k) at row t * K + k
    return (back.view(T, K, -1).float() * w[:, :, None]).sum(1).to(x.dtype)


def dense(torch, xg, w_in_t, w_out_t):
    """The same FLOPs as equal groups: ``xg`` ``(E, M, H)`` through two ``torch.bmm``."""
    inter = w_out_t.shape[1]
    u = torch.bmm(xg, w_in_t)
    h = (torch.nn.functional.silu(u[..., :inter].float()) * u[..., inter:].float()).to(xg.dtype)
    return torch.bmm(h, w_out_t)


def time_us(torch, fn, warmup, iters, cuda):
    """Median microseconds of ``fn()`` over ``iters`` calls after ``warmup``: CUDA events around
    each call when ``cuda`` (its work on the GPU), the host clock otherwise."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def report(tokens, hidden, inter, experts, topk, dtype="bfloat16", device=None, warmup=3,
           iters=20, jax_report=None):
    """The rows (PyTorch's layer forward and fwd+bwd, its dense ceiling), as a dict."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tdt = getattr(torch, dtype)
    T, H, I, E, K = tokens, hidden, inter, experts, topk
    ids_np, w_np, x_np, w_in_np, w_out_np = inputs(T, H, I, E, K)
    on = lambda a, dt=tdt: torch.as_tensor(a).to(device=device, dtype=dt)  # noqa: E731
    ids, w, x = on(ids_np, torch.int64), on(w_np, torch.float32), on(x_np)
    # the weights stored as a PyTorch layer stores them, (E, out, in), and used transposed
    w_in_t = on(np.ascontiguousarray(w_in_np.transpose(0, 2, 1))).transpose(1, 2)
    w_out_t = on(np.ascontiguousarray(w_out_np.transpose(0, 2, 1))).transpose(1, 2)
    fwd_flops = 2.0 * T * K * (H * 2 * I + I * H)

    check = min(T, 64)
    ref = layer_reference(x_np[:check], ids_np[:check], w_np[:check], w_in_np, w_out_np,
                          _ml_dtype(dtype))
    with torch.no_grad():
        y = moe_layer(torch, x, ids, w, w_in_t, w_out_t)
    wrong = wrong_count(y[:check].float().cpu().numpy(), ref, np.dtype(_ml_dtype(dtype)), H)

    params = [t.detach().clone().requires_grad_(True) for t in (x, w, w_in_t, w_out_t)]

    def forward():
        with torch.no_grad():
            moe_layer(torch, x, ids, w, w_in_t, w_out_t)

    def fwd_bwd():
        for p in params:
            p.grad = None
        y = moe_layer(torch, params[0], ids, *params[1:])
        (y.float() ** 2).sum().backward()

    m_g = T * K // E
    xg = on((np.random.default_rng(2).standard_normal((E, m_g, H)) * 0.5).astype(np.float32))
    dense_params = [t.detach().clone().requires_grad_(True) for t in (xg, w_in_t, w_out_t)]

    def dense_forward():
        with torch.no_grad():
            dense(torch, xg, w_in_t, w_out_t)

    def dense_fwd_bwd():
        for p in dense_params:
            p.grad = None
        (dense(torch, *dense_params).float() ** 2).sum().backward()

    t = {name: time_us(torch, fn, warmup, iters, device == "cuda") for name, fn in (
        ("dense forward", dense_forward), ("dense fwd+bwd", dense_fwd_bwd),
        ("forward", forward), ("fwd+bwd", fwd_bwd))}
    jax_dense, jax_layer = _jax_times(jax_report)
    rows = []
    for impl, key, p in (("torch dense bmm (ceiling)", "dense ", "forward"),
                         ("torch dense bmm (ceiling)", "dense ", "fwd+bwd"),
                         ("torch layer (argsort, _grouped_mm)", "", "forward"),
                         ("torch layer (argsort, _grouped_mm)", "", "fwd+bwd")):
        us = t[key + p]
        row = dict(impl=impl, pass_=p, time_us=us,
                   tflops=(fwd_flops if p == "forward" else 3 * fwd_flops) / us / 1e6,
                   x_torch_dense=us / t["dense " + p])
        if p in jax_dense:
            row["x_dense"] = us / jax_dense[p]
        if p in jax_layer:
            row["x_moe_layer"] = us / jax_layer[p][1]
            row["moe_layer_impl"] = jax_layer[p][0]
        if impl.startswith("torch layer") and p == "forward":
            row["wrong"] = wrong
        rows.append(row)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return dict(kind="torch_layer", config=dict(tokens_per_rank=T, hidden=H, intermediate=I,
                                                experts=E, topk=K, dtype=dtype),
                hardware=f"{gpu}; torch {torch.__version__}", warmup=warmup, iters=iters,
                grouped_mm="torch._grouped_mm" if device == "cuda" else "a matmul per group",
                results=rows)


def _ml_dtype(name):
    """The numpy dtype of ``name`` (bfloat16 from ml_dtypes, which jax brings)."""
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _jax_times(rep):
    """From a layer bench report: the dense einsums' time per pass, and the first ``moe_layer``
    row's ``(label, time)`` per pass."""
    dense, layer = {}, {}
    for r in (rep or {}).get("results", []):
        if "time_us" not in r:
            continue
        if r["impl"].startswith("dense einsum"):
            dense[r["pass_"]] = r["time_us"]
        elif r["impl"].startswith("moe_layer") and r["pass_"] not in layer:
            layer[r["pass_"]] = (r["impl"], r["time_us"])
    return dense, layer


def table(rep) -> str:
    c = rep["config"]
    lines = [f"# {rep['hardware']}; grouped GEMM: {rep['grouped_mm']}; median of {rep['iters']} "
             f"after {rep['warmup']} warm-up",
             f"# T={c['tokens_per_rank']}, top-{c['topk']} of {c['experts']}, H={c['hidden']}, "
             f"I={c['intermediate']}, {c['dtype']}; x dense = / JAX's dense einsums (layer "
             f"bench, same run); x torch dense = / torch.bmm of the same FLOPs",
             f"{'impl':<38}{'pass':<9}{'time(us)':>10}{'TFLOP/s':>9}{'x dense':>9}"
             f"{'x torch dense':>14}{'x moe_layer':>12}{'#wrong':>8}"]
    fmt = lambda r, k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    for r in rep["results"]:
        lines.append(f"{r['impl']:<38}{r['pass_']:<9}{r['time_us']:>10.1f}{r['tflops']:>9.1f}"
                     f"{fmt(r, 'x_dense', '.2f'):>9}{r['x_torch_dense']:>14.2f}"
                     f"{fmt(r, 'x_moe_layer', '.2f'):>12}{fmt(r, 'wrong', 'd'):>8}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    layer_shape_arguments(ap, hidden=7168, intermediate=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--jax-json", default=None,
                    help="the layer bench's JSON of the same shape, for x dense and x moe_layer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("tokens", "hidden", "intermediate", "experts", "topk", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.tokens * args.topk % args.experts:
        ap.error(f"--tokens x --topk ({args.tokens * args.topk}) must be divisible by --experts "
                 f"({args.experts}): the dense ceiling's equal groups")
    jax_report = None
    if args.jax_json:
        with open(args.jax_json) as f:
            reps = json.load(f)
        jax_report = next((r for r in (reps if isinstance(reps, list) else [reps])
                           if r.get("kind") == "layer"), None)
        if jax_report is None:
            ap.error(f"--jax-json: {args.jax_json} holds no layer report")
    # JAX only rounds the reference's inputs: on the host, leaving the GPU's memory to torch
    import jax
    jax.config.update("jax_platforms", "cpu")
    rep = report(args.tokens, args.hidden, args.intermediate, args.experts, args.topk,
                 args.dtype, args.device, args.warmup, args.iters, jax_report)
    print(table(rep), flush=True)
    return save_json(rep, args.json)


if __name__ == "__main__":
    main()
