#!/usr/bin/env bash
# Flakiness sweep over the full matrices (EP_COMM_TEST_FULL=1, as scripts/run.sh test-full): the
# single-process suite (8 CPU devices) under SINGLE seeds and the tests marked multiprocess under
# `mpirun -n 2` (one device per process: the MPI engine runs; XLA flags as in scripts/run.sh test)
# under MPI seeds,
# each run with EP_COMM_TEST_SEED = FIRST, FIRST+1, ... Every run's summary line goes to stdout and
# to ${OUT:-sweep}/summary.txt, the whole output of a failing run to ${OUT}/fail_<phase>_<seed>.txt;
# the exit status is the number of failing runs (0: none). Programs do not change with the seed,
# so runs share JAX's persistent compilation cache (${OUT}/jax_cache) and skip recompiling.
# Usage: scripts/seed_sweep.sh [SINGLE=30] [MPI=10] [FIRST=1] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
SINGLE="${1:-30}" MPI="${2:-10}" FIRST="${3:-1}"; shift $(( $# < 3 ? $# : 3 ))
OUT="${OUT:-sweep}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
scripts/run.sh setup >/dev/null || { echo "set-up failed (scripts/run.sh setup)"; exit 1; }
PY="${EP_COMM_VENV:-.venv}/bin/python"
export JAX_PLATFORMS=cpu EP_COMM_TEST_COMPILE_CACHE="$OUT/jax_cache" EP_COMM_TEST_FULL=1
CPU_XLA="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
failed=0
one() {  # one PHASE SEED COMMAND...
  local phase=$1 seed=$2 log t0=$SECONDS; shift 2
  log=$(mktemp)
  EP_COMM_TEST_SEED=$seed timeout 1200 "$@" >"$log" 2>&1
  local rc=$?
  local line; line=$(grep -aoE '[0-9]+ (passed|failed)[^=]*' "$log" | tail -1)
  printf '%-8s seed %-6s exit %-3s %4ss  %s\n' "$phase" "$seed" "$rc" "$(( SECONDS - t0 ))" \
    "$line" | tee -a "$OUT/summary.txt"
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1)); cp "$log" "$OUT/fail_${phase}_${seed}.txt"
    grep -a "^FAILED\|^ERROR" "$log" | sort -u | tee -a "$OUT/summary.txt"
  fi
  rm -f "$log"
}
for ((s = FIRST; s < FIRST + SINGLE; s++)); do
  one single "$s" env XLA_FLAGS="--xla_force_host_platform_device_count=8 $CPU_XLA" \
    "$PY" -m pytest -q -p no:cacheprovider --timeout 600 tests "$@"
done
for ((s = FIRST; s < FIRST + MPI; s++)); do
  one mpi2 "$s" env XLA_FLAGS="$CPU_XLA" EP_COMM_CPU_DEVICES=1 mpirun -n 2 --oversubscribe \
    "$PY" -m pytest --with-mpi -q -p no:cacheprovider --timeout 300 -m multiprocess tests "$@"
done
echo "$failed failing run(s) of $((SINGLE + MPI))" | tee -a "$OUT/summary.txt"
exit "$failed"
