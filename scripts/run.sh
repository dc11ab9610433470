#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (and OpenMPI for the multi-process tests),
# then runs what was asked.
#   scripts/run.sh demo    # the MoE transformer example on 8 virtual CPU devices
#   scripts/run.sh test    # the whole suite: single process (8 devices), mpirun -n 2 and -n 4
#   scripts/run.sh bench   # the dispatch/combine benchmark on 8 virtual CPU devices
# Environment: PYTHON (default python3), EP_COMM_VENV (default .venv), EP_COMM_TEST_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"; shift || true
PY="${PYTHON:-python3}"
VENV="${EP_COMM_VENV:-.venv}"

need_mpi() {
  command -v mpirun >/dev/null && return
  echo "== installing OpenMPI (apt)"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  echo "== installing ep_comm[$1] into $VENV (with its native engine: MPI if found, CUDA/NCCL if nvcc)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The native build reads the XLA FFI headers from the installed jax and NCCL's headers from the
  # nvidia-nccl wheel, so it builds inside the venv (no isolated build env to download jax into).
  local build_deps=("scikit-build-core>=0.10" "nanobind>=2" "jax>=0.10" "mpi4py>=4.0")
  command -v ninja >/dev/null || build_deps+=(ninja)
  if command -v nvcc >/dev/null; then
    local cu; cu=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    build_deps+=("nvidia-nccl-cu${cu:-13}")
  fi
  "$VENV/bin/python" -m pip install -q "${build_deps[@]}"
  "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[$1]"
  "$VENV/bin/python" -c "import collectives; print('   transports:', collectives.available())"
}

export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
case "$what" in
  demo)
    setup examples
    exec "$VENV/bin/python" examples/moe_transformer.py "$@"
    ;;
  bench)
    setup examples
    exec "$VENV/bin/python" -m ep_comm.bench "$@"
    ;;
  test)
    need_mpi
    setup test,examples
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    PYTEST_ARGS=("$@")
    echo "== single process, 8 CPU devices"
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 600 tests "$@"
    # XLA_FLAGS would give every process 8 devices; each process takes EP_COMM_CPU_DEVICES.
    # One device per process runs the MPI transport (the native engine) next to the others; two
    # per process covers processes that drive several devices.
    for run in "2 1" "4 1" "2 2"; do
      set -- $run; np_=$1; dev=$2; shift 2
      echo "== mpirun -n $np_ ($dev CPU device(s) per process)"
      XLA_FLAGS= EP_COMM_CPU_DEVICES=$dev timeout 1800 mpirun -n "$np_" --oversubscribe \
        "$VENV/bin/python" -m pytest --with-mpi -q -p no:cacheprovider --timeout 600 --color=no \
        tests "${PYTEST_ARGS[@]}" 2>&1 | grep -a -v '^\[Gloo\]'
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "mpirun -n $np_ ($dev device(s) each) failed"; exit 1; }
    done
    ;;
  *)
    echo "usage: scripts/run.sh {demo|test|bench} [args...]" >&2; exit 2 ;;
esac
