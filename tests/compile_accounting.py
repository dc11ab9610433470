"""Which test files a run's time goes to, and how much of it is XLA compiling.

Every test's XLA compilations (programs and seconds, from JAX's monitoring events) and its wall
time are summed per test file and per test; the run ends (process 0; pytest-xdist workers'
counts added up) with the table per file and the ``EP_COMM_TEST_SLOWEST`` (15) slowest tests.
``EP_COMM_TEST_PROFILE=file.json`` also writes both tables. Compiled programs are what the suite's
time goes to (docs/testing.md); a program shared by several tests counts in the first that ran it.
The hooks are imported into ``conftest.py``.
"""

from __future__ import annotations

import collections
import json
import os
import time

import jax
import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_LOWER_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration")


def _row():
    return {"tests": 0, "programs": 0, "compile_s": 0.0, "trace_lower_s": 0.0, "wall_s": 0.0}


_PER_TEST = collections.defaultdict(_row)  # per test id; per file is their sum
_NOW = {"test": "(collection)"}
_SLOWEST = int(os.environ.get("EP_COMM_TEST_SLOWEST", "15"))


def _on_duration(event, duration, **_):
    row = _PER_TEST[_NOW["test"]]
    if event == _COMPILE_EVENT:
        row["programs"] += 1
        row["compile_s"] += duration
    elif event in _LOWER_EVENTS:
        row["trace_lower_s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _NOW["test"] = item.nodeid
    t0 = time.perf_counter()
    yield
    row = _PER_TEST[item.nodeid]
    row["tests"] += 1
    row["wall_s"] += time.perf_counter() - t0
    _NOW["test"] = "(between tests)"


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand the counts over
        session.config.workeroutput["ep_comm_account"] = json.dumps(_PER_TEST)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # the pytest-xdist controller: add up its workers'
    got = json.loads(getattr(node, "workeroutput", {}).get("ep_comm_account", "{}"))
    for name, row in got.items():
        for k, v in row.items():
            _PER_TEST[name][k] += v


def pytest_terminal_summary(terminalreporter):
    if jax.process_index() != 0 or not _PER_TEST:
        return
    files = collections.defaultdict(_row)
    for name, r in _PER_TEST.items():
        for k, v in r.items():
            files[name.split("::")[0]][k] += v
    rows = sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])
    tr = terminalreporter
    tr.section("time per test file (XLA compiles: programs and seconds)")
    tr.write_line(f"{'file':<36} {'tests':>6} {'wall s':>8} {'programs':>9} {'compile s':>10} "
                  f"{'trace+lower s':>14}")
    total = collections.Counter()
    for name, r in rows:
        tr.write_line(f"{name:<36} {r['tests']:>6} {r['wall_s']:>8.1f} {r['programs']:>9} "
                      f"{r['compile_s']:>10.1f} {r['trace_lower_s']:>14.1f}")
        total.update(r)
    tr.write_line(f"{'total':<36} {total['tests']:>6} {total['wall_s']:>8.1f} "
                  f"{total['programs']:>9} {total['compile_s']:>10.1f} "
                  f"{total['trace_lower_s']:>14.1f}")
    slowest = sorted(_PER_TEST.items(), key=lambda kv: -kv[1]["wall_s"])[:_SLOWEST]
    if slowest:
        tr.section(f"slowest {len(slowest)} tests (wall s, programs compiled)")
        for name, r in slowest:
            tr.write_line(f"{r['wall_s']:8.2f} {r['programs']:5d}  {name}")
    if path := os.environ.get("EP_COMM_TEST_PROFILE"):
        with open(path, "w") as f:
            json.dump({"full": os.environ.get("EP_COMM_TEST_FULL", "0"),
                       "devices": jax.device_count(), "processes": jax.process_count(),
                       "files": dict(rows), "tests": dict(_PER_TEST)}, f, indent=1)
