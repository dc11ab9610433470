#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (and OpenMPI for the multi-process tests),
# then runs what was asked.
#   scripts/run.sh demo    # the MoE transformer example on 8 virtual CPU devices
#   scripts/run.sh test    # the suite's covering sets on 8 devices, then the multiprocess tests
#                          # under mpirun (docs/testing.md: its phases and budgets)
#   scripts/run.sh test-full  # the same phases with the exhaustive matrices (not in CI)
#   scripts/run.sh bench   # the dispatch/combine benchmark on 8 virtual CPU devices
#   scripts/run.sh docs    # the guide and the API reference (Sphinx) into docs/_build/html
#   scripts/run.sh setup   # only the test set-up (.venv, OpenMPI), as `test` makes it, forced
#   scripts/run.sh wheel   # the binary wheel with the native parts, into dist/ (scripts/build_wheel.sh)
# The set-up is skipped when the last one installed the extras asked for from the same build
# inputs (install_key); EP_COMM_REINSTALL=1 forces it.
# Environment: PYTHON (default python3), EP_COMM_VENV (default .venv), EP_COMM_TEST_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/follow_build.sh
what="${1:-demo}"; shift || true
PY="${PYTHON:-python3}"
VENV="${EP_COMM_VENV:-.venv}"

need_mpi() {
  command -v mpirun >/dev/null && return
  echo "== installing OpenMPI (apt)"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
}

# The install's inputs: the build configuration, the native sources, the toolkits found, the
# venv's Python and the names of the Python modules. A run whose inputs match the last install's,
# with the extras it installed, skips the set-up (Python sources are live in the editable
# install; `scripts/run.sh setup` or EP_COMM_REINSTALL=1 forces it).
install_key() {
  {
    "$VENV/bin/python" -V
    command -v nvcc mpicc || true
    cat pyproject.toml CMakeLists.txt
    find collectives/csrc -type f | LC_ALL=C sort | xargs cat
    # the editable install maps each module by name: a module added, moved or removed re-installs
    find ep_comm collectives topology -name '*.py' | LC_ALL=C sort
  } 2>/dev/null | sha256sum | cut -c1-16
}

setup() {
  local extras=$1 stamp="$VENV/.ep_comm_install" t0=$SECONDS
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  local key; key=$(install_key)
  local had_key="" had_extras="" missing
  if [ -f "$stamp" ]; then read -r had_key had_extras < "$stamp" || true; fi
  # the extras asked for that the last install did not hold
  missing=$(comm -23 <(tr , '\n' <<<"$extras" | sort -u) <(tr , '\n' <<<"$had_extras" | sort -u))
  if [ "${EP_COMM_REINSTALL:-0}" != 1 ] && [ "$had_key" = "$key" ] && [ -z "$missing" ]; then
    echo "== ep_comm[$had_extras] is installed in $VENV, its inputs unchanged: set-up skipped"
    return
  fi
  echo "== installing ep_comm[$extras] into $VENV (with its native engine: MPI if found, CUDA/NCCL if nvcc)"
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
  # A persistent build directory (build/, ignored): CMake rebuilds only what changed. The build's
  # steps show as they run, with the time so far.
  follow_build "pip install -e .[$extras]" "$VENV/.ep_comm_install.log" "$t0" \
    "$VENV/bin/python" -m pip install -v --no-build-isolation \
    --config-settings=build-dir=build/{wheel_tag} -e ".[$extras]" || return 1
  "$VENV/bin/python" -c "from ep_comm import collectives; print('   transports:', collectives.available())"
  echo "$key $extras" > "$stamp"
  echo "== set-up took $((SECONDS - t0)) s"
}

# The docs site: warnings are errors (a broken cross-reference or anchor, a public name without a
# docstring); tests/test_docs.py runs its examples and checks its links and names.
build_docs() {
  "$VENV/bin/python" -m sphinx -b html -q -W --keep-going docs docs/_build/html "$@"
}

export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
case "$what" in
  demo)
    setup examples
    exec "$VENV/bin/python" examples/moe_transformer.py "$@"
    ;;
  docs)
    setup docs
    build_docs "$@"
    echo "== docs/_build/html/index.html"
    ;;
  bench)
    setup examples
    exec "$VENV/bin/python" -m ep_comm.benchmarks.dispatch "$@"
    ;;
  wheel)
    exec scripts/build_wheel.sh "$@"
    ;;
  setup)
    need_mpi
    EP_COMM_REINSTALL=1 setup test,examples,docs
    ;;
  test|test-full)
    need_mpi
    setup test,examples,docs
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    # One seed for every phase and worker (printed; EP_COMM_TEST_SEED=... replays the run).
    export EP_COMM_TEST_SEED="${EP_COMM_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
    # test: the covering sets (tests/conftest.py); test-full: every transport x plan x shape x
    # dtype x rank count (tests and parameters marked `full` too).
    if [ "$what" = test-full ]; then export EP_COMM_TEST_FULL=1; else export EP_COMM_TEST_FULL=0; fi
    echo "== EP_COMM_TEST_SEED=$EP_COMM_TEST_SEED EP_COMM_TEST_FULL=$EP_COMM_TEST_FULL"
    PYTEST_ARGS=("$@")
    # XLA:CPU compiles, at LLVM -O0 and with its older (non-MLIR) fusion emitters: compiling is
    # most of the suite's time, the tests check ep_comm's logic, not LLVM's code (measured on 2
    # cores: the emitters flag alone took a sample's compile time from 38 s to 25 s);
    # scripts/gpu_check.sh runs the suite at XLA's defaults on the GPU.
    CPU_XLA="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    # Each phase's budget in seconds on the 2-core CI machine (docs/testing.md), in the order they
    # run: past it the phase still passes, with a warning. test's add up to 780 s: 15 minutes
    # with the set-up.
    if [ "$EP_COMM_TEST_FULL" = 1 ]; then budgets=(300 3600 1800 1800 1800)
    else budgets=(30 450 45 80 175); fi
    summary=()
    phase() {  # phase NAME BUDGET COMMAND...: run, time, warn past the budget, stop on failure
      local name=$1 budget=$2 t0=$SECONDS rc=0; shift 2
      echo "== $name"
      "$@" || rc=$?
      local took=$(( SECONDS - t0 )) note=""
      [ "$took" -le "$budget" ] || note="  WARNING: over its budget of $budget s (docs/testing.md)"
      echo "== $name: $took s, exit $rc$note"
      summary+=("$(printf '%5s s  (budget %5s s)  %s%s' "$took" "$budget" "$name" "$note")")
      # 5: the arguments selected no test of this phase (e.g. -k naming a single-process test)
      [ "$rc" = 0 ] || [ "$rc" = 5 ] || { echo "FAILED: $name"; exit 1; }
    }
    phase "docs (Sphinx, warnings as errors)" "${budgets[0]}" build_docs
    # The whole suite once, on 8 CPU devices, in 2 pytest-xdist workers (a process compiles on
    # one core; --dist loadfile keeps a file's tests, which share compiled programs, together).
    XLA_FLAGS="$XLA_FLAGS $CPU_XLA" \
      phase "single process, 8 CPU devices (2 workers)" "${budgets[1]}" \
      "$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 600 \
      -n "${EP_COMM_TEST_WORKERS:-2}" --dist loadfile tests "${PYTEST_ARGS[@]}"
    # Under mpirun, the tests marked multiprocess: the MPI engine, bootstrap and launch helpers, and
    # the exchange and dispatch/combine equalities across processes and at 2 and 4 ranks. Each
    # process takes EP_COMM_CPU_DEVICES devices (not XLA_FLAGS' 8): one device per process runs the
    # MPI transport (the native engine) next to the others; two per process covers processes that
    # drive several devices. The tests of the MoE layer above dispatch and combine (marked layer:
    # the pipeline, rounds, moe_layer, the example model) compose what the other tests check
    # across processes at every rank count; under mpirun they run in the 2 x 2 phase only (4
    # ranks, 2 processes each driving 2 devices).
    mpi_phase() {
      XLA_FLAGS="$CPU_XLA" EP_COMM_CPU_DEVICES=$2 timeout 1800 \
        mpirun -n "$1" --oversubscribe "$VENV/bin/python" -m pytest --with-mpi -q \
        -p no:cacheprovider --timeout 300 --color=no -m "$3" tests "${PYTEST_ARGS[@]}" 2>&1 \
        | grep -a -v '^\[Gloo\]'
    }
    # The fast command's -n 2 and -n 4 phases (one device per process) run the tests marked
    # processes: the MPI transport at 2 and 4 ranks, launch, bootstrap, barrier, discovery. The
    # 2 x 2 phase runs every other multiprocess case (the portable transport across processes,
    # at 4 ranks) and the layer's.
    if [ "$EP_COMM_TEST_FULL" = 1 ]; then
      runs=("2 1 multiprocess and not layer" "4 1 multiprocess and not layer" "2 2 multiprocess")
    else
      runs=("2 1 multiprocess and processes and not layer"
            "4 1 multiprocess and processes and not layer" "2 2 multiprocess")
    fi
    i=2
    for run in "${runs[@]}"; do
      set -- $run
      phase "mpirun -n $1 ($2 CPU device(s) per process), tests marked ${*:3}" "${budgets[$i]}" \
        mpi_phase "$1" "$2" "${*:3}"
      i=$((i + 1))
    done
    echo "== phases (EP_COMM_TEST_FULL=$EP_COMM_TEST_FULL, EP_COMM_TEST_SEED=$EP_COMM_TEST_SEED)"
    printf '%s\n' "${summary[@]}"
    ;;
  *)
    echo "usage: scripts/run.sh {demo|test|test-full|bench|docs|setup} [args...]" >&2; exit 2 ;;
esac
