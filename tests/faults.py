"""Fault injection under ``mpirun`` (CPU): what ep_comm survives, and how fast it says so.

For each backend (the engine's ``mpi`` transport, ``portable``), rank count and fault of
``tests/fault_worker.py``, launch the worker on every rank with ``EP_COMM_TIMEOUT_S`` set, read
its output as it comes, and record what the survivors got and when:

- ``diagnostic``: every survivor raised with a message (seconds from the start of its failing call
  to the error, and whether the message names the operation and a peer);
- ``mpirun ended the job``: a process exited and mpirun terminated the others (its message names
  the rank);
- ``hang``: nothing within ``timeout + 10 s`` after the run's own start-up; the run is killed.

    python tests/faults.py [--timeout 10] [--ranks 2,4] [--backends mpi,portable] [--json F]

Prints a table (fault x phase -> outcome, time to diagnostic) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_worker.py")
FAULTS = [  # (fault, the phase it hits)
    ("none", "-"),
    ("exit_before_bootstrap", "before bootstrap"),
    ("exit_in_metadata", "metadata"),
    ("one_call_fewer", "metadata"),
    ("exit_after_metadata", "payload"),
    ("stall_after_metadata", "payload"),
    ("other_config", "metadata"),
    ("raise_between", "between calls"),
]
_DIAG, _OK = r"DIAG [0-9.]+ rank \d+", r"OK rank \d+"
ENGINE_ONLY = {"exit_after_metadata", "stall_after_metadata"}  # hooks inside the native engine


def run_one(backend: str, n: int, fault: str, timeout: float, startup: float) -> dict:
    # (a process that initialized MPI as a singleton, e.g. a pytest-xdist worker, carries
    # OMPI_MCA_ess=singleton & co., which make a child mpirun exit at once)
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(("OMPI_MCA_", "OMPI_APP_CTX", "OMPI_COMM_WORLD", "PMIX_"))}
    env = dict(inherited, EP_COMM_TIMEOUT_S=str(timeout), EP_COMM_CPU_DEVICES="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
               JAX_PLATFORMS="cpu")
    env.pop("EP_COMM_FAULT", None)
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", sys.executable, WORKER, "--fault", fault,
           "--backend", backend]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True, text=True, errors="replace")
    lines = []

    def read():
        for line in p.stdout:
            lines.append((time.monotonic() - t0, line.rstrip()))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    limit = startup + timeout + 10
    survivors = n - 1 if fault != "none" else n
    # processes share the pipe: a line may start with another process's output
    # (every match: two processes' "OK rank r" can share a line)
    find = lambda pat: [l[m.start():] for _, l in list(lines)  # noqa: E731
                        for m in re.finditer(pat, l)]
    while p.poll() is None and time.monotonic() - t0 < limit:
        diags, oks = find(_DIAG), find(_OK)
        if len(diags) >= survivors or len(oks) >= n:
            break
        time.sleep(0.2)
    wall = time.monotonic() - t0
    hung = p.poll() is None and wall >= limit
    if p.poll() is None:  # the victim may linger (one_call_fewer); survivors are done
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    reader.join(timeout=5)
    text = [l for _, l in lines]
    diags, oks = find(_DIAG), find(_OK)
    mpirun = [l for l in text if re.search(r"mpirun (noticed|detected)|exited on signal|"
                                            r"Primary job\s+terminated", l)]
    if fault == "none":
        outcome = "ok" if len(oks) == n else ("hang" if hung else "FAILED")
    elif len(diags) >= survivors:
        outcome = "diagnostic"
    elif hung:
        outcome = "hang"
    elif mpirun or diags:
        outcome = "mpirun ended the job"
    else:
        outcome = "exited"
    secs = [float(d.split()[1]) for d in diags]
    msg = diags[0].split(" ", 2)[2] if diags else (mpirun[0] if mpirun else "")
    names_op = bool(re.search(r"dispatch|combine|ragged", msg))
    names_peer = bool(re.search(r"peer|rank \d", msg))
    return dict(backend=backend, ranks=n, fault=fault, outcome=outcome, wall_s=round(wall, 1),
                diag_s=max(secs) if secs else None, names_operation=names_op,
                names_peer=names_peer, message=msg[:400], hung=hung,
                **({"output_tail": text[-20:]} if outcome == "FAILED" else {}))


def table(rows, timeout) -> str:
    out = [f"# fault injection under mpirun (CPU, one device per process), EP_COMM_TIMEOUT_S="
           f"{timeout}; diag = seconds from the start of the survivor's failing call to its error",
           f"{'backend':<9}{'ranks':>6}  {'fault':<23}{'phase':<17}{'outcome':<22}{'diag(s)':>8}"
           f"{'wall(s)':>8}  names op/peer"]
    phase = dict(FAULTS)
    for r in rows:
        d = f"{r['diag_s']:.1f}" if r["diag_s"] is not None else "-"
        out.append(f"{r['backend']:<9}{r['ranks']:>6}  {r['fault']:<23}{phase[r['fault']]:<17}"
                   f"{r['outcome']:<22}{d:>8}{r['wall_s']:>8.1f}  "
                   f"{'yes' if r['names_operation'] else 'no'}/{'yes' if r['names_peer'] else 'no'}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=10.0, help="EP_COMM_TIMEOUT_S for the runs")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--backends", default="mpi,portable")
    ap.add_argument("--faults", default=",".join(f for f, _ in FAULTS))
    ap.add_argument("--startup", type=float, default=60.0,
                    help="seconds a run may take to start (processes, jax, compile)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for backend in args.backends.split(","):
        for n in map(int, args.ranks.split(",")):
            for fault in args.faults.split(","):
                if backend != "mpi" and fault in ENGINE_ONLY:
                    continue
                r = run_one(backend, n, fault, args.timeout, args.startup)
                rows.append(r)
                print(table([r], args.timeout).splitlines()[-1], "|", r["message"][:160],
                      flush=True)
    print(table(rows, args.timeout))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(timeout_s=args.timeout, runs=rows), f, indent=1)
    bad = [r for r in rows if r["outcome"] in ("hang", "FAILED")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
