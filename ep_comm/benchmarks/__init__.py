"""ep_comm's benchmarks, nccl-tests style (a warm-up, the median of many runs, time / algbw /
busbw / #wrong, the hardware named, JSON with ``--json``, ratios against a ceiling measured in the
same run). Each measures one thing and runs as a module:

- ``python -m ep_comm.benchmarks.exchange``: the ragged exchange itself, per transport, against
  a device copy of the same bytes (:mod:`~ep_comm.benchmarks.exchange`);
- ``python -m ep_comm.benchmarks.dispatch``: dispatch + combine, against plain JAX's permute and
  unpermute and capacity-padded dispatch (:mod:`~ep_comm.benchmarks.dispatch`);
- ``python -m ep_comm.benchmarks.layer``: the MoE layer against the dense einsums of the same
  FLOPs and the plain JAX layer; its grouped GEMM sweep (:mod:`~ep_comm.benchmarks.gemm_sweep`),
  rounds, and the chunked pipeline's overlap (:mod:`~ep_comm.benchmarks.overlap`);
- ``python -m ep_comm.benchmarks.wire``: the FP8 wire formats' error.

What they share: :mod:`~ep_comm.benchmarks.timing` (timers, profiler traces, the report's JSON
and hardware line), :mod:`~ep_comm.benchmarks.plain` (the plain JAX peers) and
:mod:`~ep_comm.benchmarks.reference` (the dense layer, also the tests' reference).
"""
