"""What every benchmark here shares, after nccl-tests' conventions: the median of timed runs after
a warm-up, the hardware line every report carries, and printing/saving reports."""

from __future__ import annotations

import glob
import gzip
import json
import os
import platform
import time

import jax
import numpy as np


def median_us(fn, args, warmup: int, iters: int) -> float:
    """Median wall time in microseconds of ``fn(*args)`` (waited for) over ``iters`` runs after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def interleaved_us(calls, warmup: int, iters: int) -> list[float]:
    """Median wall time in microseconds of each ``(fn, args)`` in ``calls``, timed in turn within
    every round (A, B, A, B, ...), after ``warmup`` untimed rounds: what drifts over a run (another
    process, the clock, the allocator) lands on every call alike, so their ratio is steadier than
    that of medians timed one after the other."""
    for _ in range(warmup):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for _ in range(iters):
        for (fn, args), t in zip(calls, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - t0)
    return [float(np.median(t) * 1e6) for t in times]


def pipelined_us(fn, args, warmup: int, iters: int, reps: int = 5) -> float:
    """Time per call of ``fn(*args)`` issued ``iters`` times back to back and waited for once
    (nccl-tests' loop: the host enqueues while the device works, so a per-call host round trip
    does not count), the median over ``reps`` such loops, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    loops = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):  # (only the last result held: calls with large outputs fit too)
            out = fn(*args)
        jax.block_until_ready(out)
        loops.append((time.perf_counter() - t0) / iters)
    return float(np.median(loops) * 1e6)


def hardware() -> str:
    """Devices, processes, host CPU and jax version, for the report header."""
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{jax.device_count()} x {dev.device_kind} ({dev.platform}), "
            f"{jax.process_count()} process(es); host CPU: {cpu}; jax {jax.__version__}")


def save_json(report, json_path=None):
    """Writes ``report`` to ``json_path`` (when given) and returns it: a probe's last step."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def emit(reports, table_fn, json_path=None) -> list:
    """Run the (lazy) ``reports``, printing each as a table on process 0 as it completes and
    rewriting ``json_path`` with those done so far (a run cut short by a time limit keeps what it
    measured); returns them. A report that carries ``partial=True`` is one still being measured:
    it is saved after those done, not printed, and the next report replaces it."""
    done, main = [], jax.process_index() == 0

    def save(pending=()):
        if json_path and main:
            with open(json_path, "w") as f:
                json.dump(done + list(pending), f, indent=1)
    save()
    for rep in reports:
        if rep.get("partial"):
            save([rep])
            continue
        done.append(rep)
        if main:
            print(table_fn(rep), flush=True)
        save()
    return done


def trace_kernels(folder):
    """The device kernels of the newest JAX profiler trace under ``folder`` (a GPU's streams, a
    TPU's "XLA Ops" line): a list of dicts with ``name``, ``ts``, ``dur`` (us) and ``stream`` (the
    trace's thread name), or ``None`` when there is no trace there."""
    files = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        return None
    with gzip.open(files[-1]) as f:
        events = json.load(f).get("traceEvents", [])
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [dict(name=e["name"], ts=e["ts"], dur=e["dur"], stream=names[(e["pid"], e["tid"])],
                 file=os.path.relpath(files[-1], folder))
            for e in events if e.get("ph") == "X"
            and _device_lane(names.get((e.get("pid"), e.get("tid")), ""))]


def _device_lane(thread: str) -> bool:
    return "Stream" in thread or thread == "XLA Ops"


def temp_bytes(fn, args):
    """The compiled program's temporary memory (XLA's memory analysis), or None where the backend
    gives none."""
    mem = fn.lower(*args).compile().memory_analysis()
    return getattr(mem, "temp_size_in_bytes", None)

def gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"

def is_gemm_kernel(k):
    return any(s in k["name"].lower() for s in (
        "ragged", "gemm", "nvjet", "cutlass", "matmul", "sm90", "wgmma", "dot", "gmm",
        "convolution"))

def traced_kernels(folder, fn, args):
    """The GPU kernels of 3 calls of ``fn`` (after one untraced call), from a profiler trace
    written under ``folder``; ``None`` when no trace was written."""
    os.makedirs(folder, exist_ok=True)
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(folder):
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    return trace_kernels(folder)

def profile_split(folder, fn, args, label):
    """Device kernel time of one call from a profiler trace: GEMM kernels (megablox's gmm and
    tgmm, XLA's convolutions on a TPU) vs the rest (the eight longest others by name), printed
    under ``label``."""
    kernels = traced_kernels(folder, fn, args)
    if kernels is None:
        print(f"  {label}: no trace under {folder}", flush=True)
        return {"error": f"no trace under {folder}"}
    total = sum(k["dur"] for k in kernels) / 3
    gemm = sum(k["dur"] for k in kernels if is_gemm_kernel(k)) / 3
    top = {}
    for k in kernels:
        if not is_gemm_kernel(k):
            top[k["name"][:50]] = top.get(k["name"][:50], 0) + k["dur"] / 3
    top = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    print(f"  {label}: device kernels {total:.0f} us, GEMMs {gemm:.0f} us, the rest "
          f"{total - gemm:.0f} us: " + ", ".join(f"{k} {v:.0f}" for k, v in top), flush=True)
    return dict(kernel_us=total, gemm_us=gemm, other_us=total - gemm,
                top_other={k: round(v, 1) for k, v in top})


def layer_shape_arguments(ap, tokens=4096, hidden=2048, intermediate=1024, experts=32, topk=8):
    """The MoE layer's shape options on ``ap`` (an ``argparse`` parser): ``--tokens`` (one
    rank's), ``--hidden``, ``--intermediate`` (each expert's SwiGLU width), ``--experts``,
    ``--topk``, with these defaults."""
    ap.add_argument("--tokens", type=int, default=tokens, help="tokens (one rank)")
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--intermediate", type=int, default=intermediate,
                    help="SwiGLU width I per expert")
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--topk", type=int, default=topk)
