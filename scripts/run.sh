#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (and OpenMPI for the multi-process tests),
# then runs what was asked.
#   scripts/run.sh demo    # the MoE transformer example on 8 virtual CPU devices
#   scripts/run.sh test    # the whole suite on 8 devices, then the multiprocess tests under mpirun
#   scripts/run.sh bench   # the dispatch/combine benchmark on 8 virtual CPU devices
#   scripts/run.sh setup   # only the test set-up (.venv, OpenMPI), as `test` makes it
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
  setup)
    need_mpi
    setup test,examples
    ;;
  test)
    need_mpi
    setup test,examples
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    # One seed for every phase and worker (printed; EP_COMM_TEST_SEED=... replays the run).
    export EP_COMM_TEST_SEED="${EP_COMM_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
    echo "== EP_COMM_TEST_SEED=$EP_COMM_TEST_SEED"
    PYTEST_ARGS=("$@")
    phase() {  # phase NAME COMMAND...: run, time, and stop the script on failure
      local name=$1 t0=$SECONDS rc=0; shift
      echo "== $name"
      "$@" || rc=$?
      echo "== $name: $(( SECONDS - t0 )) s, exit $rc"
      # 5: the arguments selected no test of this phase (e.g. -k naming a single-process test)
      [ "$rc" = 0 ] || [ "$rc" = 5 ] || { echo "FAILED: $name"; exit 1; }
    }
    # The whole suite once, on 8 CPU devices. (One process: the tests share compiled programs;
    # pytest-xdist over 2 cores measured slower, 179 s against 142 s.) XLA's CPU backend compiles
    # at LLVM -O0 here as in the mpirun phases: the tests check ep_comm's logic, not LLVM's code,
    # and compiling dominates them (322 s at the default level, 202 s at -O0, with the layer
    # tests); scripts/gpu_check.sh runs the suite at XLA's defaults on the GPU.
    XLA_FLAGS="$XLA_FLAGS --xla_backend_optimization_level=0" \
      phase "single process, 8 CPU devices" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
      --timeout 600 tests "${PYTEST_ARGS[@]}"
    # Under mpirun, the tests marked multiprocess: the MPI engine, bootstrap and launch helpers, and
    # the exchange and dispatch/combine equalities across processes and at 2 and 4 ranks. Each
    # process takes EP_COMM_CPU_DEVICES devices (not XLA_FLAGS' 8): one device per process runs the
    # MPI transport (the native engine) next to the others; two per process covers processes that
    # drive several devices. XLA's backend optimisation level is 0 there: these phases are about
    # what crosses processes, and LLVM at -O0 compiles their programs in about 60% of the time
    # (measured). The tests of the MoE layer above dispatch and combine (marked layer: the
    # pipeline, rounds, moe_layer, the example model) compose what the other tests check across
    # processes at every rank count; under mpirun they run in the 2 x 2 phase only (4 ranks, 2
    # processes each driving 2 devices). Measured on 2 cores, same seed: -n 4 took 547 s without
    # them against 966 s with them, -n 2 263 s without them.
    mpi_phase() {
      XLA_FLAGS=--xla_backend_optimization_level=0 EP_COMM_CPU_DEVICES=$2 timeout 1800 \
        mpirun -n "$1" --oversubscribe "$VENV/bin/python" -m pytest --with-mpi -q \
        -p no:cacheprovider --timeout 300 --color=no -m "$3" tests "${PYTEST_ARGS[@]}" 2>&1 \
        | grep -a -v '^\[Gloo\]'
    }
    for run in "2 1 multiprocess and not layer" "4 1 multiprocess and not layer" "2 2 multiprocess"; do
      set -- $run
      phase "mpirun -n $1 ($2 CPU device(s) per process), tests marked ${*:3}" \
        mpi_phase "$1" "$2" "${*:3}"
    done
    ;;
  *)
    echo "usage: scripts/run.sh {demo|test|bench|setup} [args...]" >&2; exit 2 ;;
esac
