"""GPU kernel time by kernel name and stream, per call, in JAX profiler traces.

    python3 tools/kernel_summary.py FOLDER [FOLDER ...] [--calls 3] [--top 22]

Each FOLDER holds one trace (the newest is read) of ``--calls`` calls, as
``ep_comm.benchmarks.layer --profile`` writes them (one folder per chunk count:
``chunks{C}_{chunk_by}``).
"""

from __future__ import annotations

import argparse

from ep_comm.benchmarks.timing import trace_kernels


def summary(folder: str, calls: int = 3, top: int = 22) -> str:
    kernels = trace_kernels(folder)
    if kernels is None:
        return f"== {folder}: no trace"
    by = {}
    for k in kernels:
        entry = by.setdefault((k["name"][:60], k["stream"]), [0.0, 0])
        entry[0] += k["dur"] / calls
        entry[1] += 1
    total = sum(t for t, _ in by.values())
    lines = [f"== {folder}: kernel time per call {total:.0f} us, "
             f"kernels per call {len(kernels) // calls}"]
    for (name, stream), (t, count) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t:8.1f} us {count // calls:4d}x  {stream[:18]:<18} {name}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--calls", type=int, default=3, help="calls in each trace")
    ap.add_argument("--top", type=int, default=22, help="kernels listed per trace")
    args = ap.parse_args(argv)
    for folder in args.folders:
        print(summary(folder, args.calls, args.top))


if __name__ == "__main__":
    main()
