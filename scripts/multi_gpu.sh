#!/usr/bin/env bash
# The engine on N GPUs of one host, in both launch modes (for issue 5 / a multi-GPU device kind):
#   A. one process driving every local GPU (one NCCL communicator per GPU, created in one group);
#   B. mpirun -n N, one process per GPU (CUDA_VISIBLE_DEVICES from the local rank).
# Each mode: build (as gpu_check.sh), the test suite (nccl == portable == xla, gradients, errors),
# the exchange benchmark and the dispatch/combine benchmark at DeepSeek-V3 sizes.
# Usage: scripts/multi_gpu.sh [N]   (default: every visible GPU). Results land in ${OUT:-out}/.
# On one GPU it is a dry run of both paths (N=1: single-rank communicators).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
. scripts/source_tree.sh  # the installed layout of the source tree on PYTHONPATH
export PYTHONUNBUFFERED=1
# the GPU machines run every transport: the suite's full matrices (docs/testing.md)
export EP_COMM_TEST_FULL="${EP_COMM_TEST_FULL:-1}"
N="${1:-$(nvidia-smi -L | wc -l)}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ ! -e collectives/_ep_nccl*.so ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
    > "$OUT/build.txt" 2>&1 && cmake --build build >> "$OUT/build.txt" 2>&1 \
    && cp build/collectives/csrc/_ep_*.so collectives/ || { tail -30 "$OUT/build.txt"; exit 1; }
fi
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
BENCH_X=(-m ep_comm.benchmarks.exchange --rows "${EP_COMM_BENCH_ROWS:-4096,32768}" --hidden 7168)
BENCH_D=(-m ep_comm.benchmarks.dispatch --tokens 4096 --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 --routing "${EP_COMM_BENCH_ROUTING:-uniform,skewed}")
visible=$(seq -s, 0 $((N - 1)))

echo "== A. one process, $N GPU(s)"
CUDA_VISIBLE_DEVICES=$visible "$PY" -m pytest -q -p no:cacheprovider --timeout 600 \
  ${EP_COMM_TESTS:-tests} 2>&1 | tail -15 | tee "$OUT/tests_1proc_${N}gpu.txt"
CUDA_VISIBLE_DEVICES=$visible "$PY" "${BENCH_X[@]}" --json "$OUT/exchange_1proc_${N}gpu.json" \
  | tee "$OUT/exchange_1proc_${N}gpu.txt"
CUDA_VISIBLE_DEVICES=$visible "$PY" "${BENCH_D[@]}" --json "$OUT/bench_1proc_${N}gpu.json" \
  | tee "$OUT/bench_1proc_${N}gpu.txt"

echo "== B. mpirun -n $N, one GPU per process"
with_mpi=""; "$PY" -c "import pytest_mpi" 2>/dev/null && with_mpi="--with-mpi"
one_gpu='export CUDA_VISIBLE_DEVICES=${OMPI_COMM_WORLD_LOCAL_RANK:-${PMI_RANK:-0}}; exec "$0" "$@"'
mpirun -n "$N" --oversubscribe bash -c "$one_gpu" "$PY" -m pytest $with_mpi -q -p no:cacheprovider \
  --timeout 600 ${EP_COMM_TESTS:-tests} 2>&1 | tail -15 | tee "$OUT/tests_mpi_${N}gpu.txt"
mpirun -n "$N" --oversubscribe bash -c "$one_gpu" "$PY" "${BENCH_X[@]}" \
  --json "$OUT/exchange_mpi_${N}gpu.json" | tee "$OUT/exchange_mpi_${N}gpu.txt"
mpirun -n "$N" --oversubscribe bash -c "$one_gpu" "$PY" "${BENCH_D[@]}" \
  --json "$OUT/bench_mpi_${N}gpu.json" | tee "$OUT/bench_mpi_${N}gpu.txt"
