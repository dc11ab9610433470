#!/usr/bin/env bash
# Everything one GPU can show, in one go (for the device machine; no install, no internet):
# build the native engine, the test suite on the GPU (nccl, xla and portable backends), the
# exchange benchmark (engine vs device copy vs lax.ragged_all_to_all, overlap with a profile),
# the dispatch/combine benchmark at a DeepSeek-V3-like single-rank config, and the topology step:
# discovery with NVML (`python -m ep_comm.topology`) and the cost model's `self` link calibrated from the
# engine's exchange at four sizes. STEPS picks steps (default: all of
# build,tests,exchange,dispatch,topology; `sanitize` -- compute-sanitizer memcheck of the row
# kernels' tests -- `gemm` -- the CUTLASS grouped GEMM: build (nvidia-cutlass from .whl/),
# selftests under compute-sanitizer, the fused forward probe, its tests, the layer and GEMM
# passes beside tokamax and the plain layers, then PyTorch's layer (ep_comm.benchmarks.torch_layer)
# at each shape of GEMM_SHAPES; the built module lands in $OUT/prebuilt/, and GEMM_PREBUILT=1 with it
# carried back as collectives/_ep_gemm*.so skips the build next time (scripts/prebuild_gemm.sh
# builds it without a GPU), GEMM_CHECKS=0 the checks --
# and `layer` -- the MoE layer and grouped GEMM sweep with
# tokamax from .whl/, see below -- `overlap` -- the chunked layer's tests and overlap bench
# (docs/bench/h200x1_overlap), tokamax from .whl/ -- `ids` -- what the run-time check of
# topk_ids costs moe_layer a call (tools/ids_check_probe.py at the DeepSeek-V3 EP8 rank shape)
# -- and `lifecycle` -- tests/lifecycle.py on NCCL -- run when named) -- and `wheel` -- the binary
# wheel from dist/ (scripts/run.sh wheel, carried) in a fresh
# venv with no nvcc on PATH: what it holds, the GPU tests against it, the layer bench beside the
# source build's; nvidia-ml-py is installed from wheels/ when the image
# lacks it. Output tables and JSON land in ${OUT:-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
. scripts/source_tree.sh  # the installed layout of the source tree on PYTHONPATH
export PYTHONUNBUFFERED=1
# the GPU machines run every transport: the suite's full matrices (docs/testing.md)
export EP_COMM_TEST_FULL="${EP_COMM_TEST_FULL:-1}"
PY="${PYTHON:-python3}"
STEPS=",${STEPS:-build,tests,exchange,dispatch,topology},"
step() { [[ "$STEPS" == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
# the wheels carried in .whl/ (tokamax and its needs, nvidia-cutlass), after the image's own jax;
# once per run (the build step and the steps that need tokamax all call it)
install_wheels() {
  [ -z "${wheels_installed:-}" ] || return 0
  wheels_installed=1
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ep_comm_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/ep_comm_site:$PWD/.gpu"
  fi
  # tokamax imports xprof (for its benchmarking module only, which ep_comm does not use): a stub
  mkdir -p .gpu/xprof/cli && touch .gpu/xprof/__init__.py .gpu/xprof/cli/__init__.py
  printf 'def get_kernel_stats_tool(*args, **kwargs):\n    raise NotImplementedError("xprof stub")\n' \
    > .gpu/xprof/cli/tools.py
}
step build && { echo "== build (the package's CMake project, copied in-tree so PYTHONPATH finds it)"
t0=$(date +%s)
# the carried wheels first: with nvidia-cutlass among them the build holds the grouped GEMM too
install_wheels
# (a test build: the selftests compiled in, for the sanitize step and the kernels' tests)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
  -DEP_COMM_SELFTESTS=ON > "$OUT/build.txt" 2>&1 && cmake --build build >> "$OUT/build.txt" 2>&1 \
  && cp build/collectives/csrc/_ep_*.so build/collectives/csrc/_build_info.json collectives/ || { tail -30 "$OUT/build.txt"; exit 1; }
grep "ep_comm:" "$OUT/build.txt"; echo "built in $(( $(date +%s) - t0 )) s"; }
"$PY" -c "from ep_comm import collectives; print(collectives.available())" | tee -a "$OUT/gpu.txt"
if ! "$PY" -c "import pynvml" 2>/dev/null; then
  if compgen -G "wheels/nvidia_ml_py-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps wheels/nvidia_ml_py-*.whl
  else
    echo "note: no nvidia-ml-py (pip download nvidia-ml-py -d wheels): GPUs listed without NVML facts"
  fi
fi
step tests && echo "== tests on $("$PY" -c 'import jax; print(jax.device_count())') GPU(s)" && \
"$PY" -m pytest -q -p no:cacheprovider --timeout 600 ${EP_COMM_TESTS:-tests} 2>&1 | tail -25 | tee "$OUT/tests.txt"
step exchange && echo "== exchange bench" && \
"$PY" -m ep_comm.benchmarks.exchange --rows 4096,32768 --hidden 7168 --overlap --profile "$OUT/profile" \
  --json "$OUT/exchange.json" 2>&1 | tee "$OUT/exchange.txt"
if step sanitize; then
  echo "== compute-sanitizer memcheck of the row kernels (malformed indices included)"
  # the kernels outside XLA on malformed indices (fast), then, time permitting, the kernel tests
  # through XLA (under the sanitizer a JAX process runs many times slower)
  compute-sanitizer --tool memcheck --print-limit 20 "$PY" -c \
    "from ep_comm.collectives import _ep_rows; print('row kernels selftest: wrong values', _ep_rows.selftest())" \
    2>&1 | tail -6 | tee "$OUT/sanitizer.txt"
  [ "${SANITIZE_TIMEOUT:-0}" = 0 ] || timeout "$SANITIZE_TIMEOUT" compute-sanitizer --tool memcheck \
    --kernel-name kns=gather --print-limit 20 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_row_kernels.py -k "kernel_bitwise or kernel_matches" 2>&1 | tail -8 \
    | tee -a "$OUT/sanitizer.txt"
fi
if step dispatch; then
  echo "== dispatch/combine bench (copy = x a device copy of the compulsory bytes; kern from a trace)"
  for T in ${BENCH_TOKENS:-4096 128}; do
    "$PY" -m ep_comm.benchmarks.dispatch --tokens "$T" --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 \
      --routing uniform --iters 20 --wire-formats ${WIRE_FORMATS:-none,e4m3,mxfp8} \
      --backends "${BENCH_BACKENDS:-nccl,portable}" --profile "/tmp/ep_bench_profile_T$T" \
      --json "$OUT/bench_T$T.json" 2>&1 | tee "$OUT/bench_T$T.txt"
  done
fi
if step layer; then
  echo "== MoE layer: grouped GEMM passes (tokamax tile sweep) and the layer, DeepSeek-V3 EP8 rank"
  # tokamax travels as wheels in .whl/ (carry it; ../shared/NOTES.md), its xprof import as a stub
  # in .gpu/ (benchmarking only)
  install_wheels
  "$PY" -c "from ep_comm import gemm; print('tokamax:', gemm.tokamax_available())"
  [ "${LAYER_TESTS:-1}" = 0 ] || "$PY" -m pytest -q -p no:cacheprovider tests/test_layer.py 2>&1 \
    | tail -5 | tee "$OUT/layer_tests.txt"
  "$PY" -m ep_comm.benchmarks.layer --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 \
    --topk 8 ${LAYER_ARGS:---tune} --profile /tmp/layer_profile --json "$OUT/layer.json" 2>&1 \
    | tee "$OUT/layer.txt"
fi
if step gemm; then
  echo "== the CUTLASS grouped GEMM (sm_90a): build, selftest under compute-sanitizer, tests, layer"
  # CUTLASS's headers travel as the nvidia-cutlass wheel in .whl/ (carry it; ../shared/NOTES.md),
  # tokamax (the peer in the same run) as in the layer step
  install_wheels
  t0=$(date +%s)
  # GEMM_PREBUILT=1: the module an earlier run built and returned (carry collectives/_ep_gemm*.so)
  if [ "${GEMM_PREBUILT:-0}" = 1 ] && ls collectives/_ep_gemm*.so > /dev/null 2>&1; then
    echo "using the carried $(ls collectives/_ep_gemm*.so)"
  else
    # (the layout test's line into build_gemm.txt: the device tool returns at most 8 files, the
    # module among them; a failed build stops here, a failed layout test does not)
    scripts/build_gemm.sh "$(command -v "$PY")" /tmp/ep_comm_site/cutlass_library/source build \
      "$OUT/build_gemm.txt"
    [ $? != 3 ] || exit 1
    echo "built in $(( $(date +%s) - t0 )) s"
    mkdir -p "$OUT/prebuilt" && cp collectives/_ep_gemm*.so "$OUT/prebuilt/"
  fi
  "$PY" -c "from ep_comm.collectives import grouped_gemm as g; print('cutlass grouped GEMM:', g.unavailable_reason() or 'runs here')"
  # GEMM_CHECKS=0: no selftest, probe or tests (a timing run with a module already checked)
  [ "${GEMM_CHECKS:-1}" = 0 ] || {
    timeout "${GEMM_SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool memcheck --print-limit 20 "$PY" -c \
      "from ep_comm.collectives import _ep_gemm; print('grouped GEMM selftest: wrong values', _ep_gemm.selftest()); print('fused (gather, epilogues) selftest: wrong values', _ep_gemm.fused_selftest())" \
      2>&1 | tail -8 | tee "$OUT/gemm_sanitizer.txt"
    timeout "${FUSED_TIMEOUT:-120}" "$PY" tools/fused_gemm_probe.py --json "$OUT/fused_gemm.json" 2>&1 \
      | tail -30 | tee "$OUT/fused_gemm.txt"
    timeout "${GEMM_TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/test_layer.py \
      -k "${GEMM_TESTS:-cutlass or grouped_gemm or fused or inside_shard_map}" -rf 2>&1 \
      | tee "$OUT/gemm_tests.txt" | tail -12
  }
  # GEMM_SHAPES: the issue's shapes by name (default: the DeepSeek-V3 EP8 rank only); each
  # shape's GEMM passes on the layer's own routed groups first, the layer then on the fastest
  # CUTLASS config per pass and weight shape (its JSON's best_cutlass_by_shape: SHAPE_CONFIGS),
  # the first implementation's rows and the plain layer's with their kernel time split from a
  # trace (GEMMs against the rest, the longest other kernels by name)
  for shape in ${GEMM_SHAPES:-deepseek}; do
    case "$shape" in
      deepseek) args="--tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8" ;;
      mixtral) args="--tokens 4096 --hidden 4096 --intermediate 14336 --experts 8 --topk 2" ;;
      finegrained) args="--tokens 16384 --hidden 2048 --intermediate 768 --experts 128 --topk 8" ;;
      *) echo "unknown GEMM_SHAPES entry: $shape"; continue ;;
    esac
    timeout "${GEMM_BENCH_TIMEOUT:-420}" "$PY" -m ep_comm.benchmarks.layer $args \
      --implementation "${GEMM_IMPLS:-cutlass,cutlass-fused,cutlass-keep-u,tokamax}" \
      --profile "/tmp/gemm_profile_$shape" ${GEMM_ARGS:---no-xla --groups routed --tune --no-tile-sweep} \
      --json "$OUT/layer_cutlass_$shape.json" 2>&1 | tee "$OUT/layer_cutlass_$shape.txt"
    # the PyTorch peer on the same inputs (the image's torch: argsort, torch._grouped_mm, SwiGLU,
    # unpermute), its ratios against this shape's rows just measured; TORCH_PEER=0 skips it
    [ "${TORCH_PEER:-1}" = 0 ] || timeout "${TORCH_TIMEOUT:-180}" "$PY" -m \
      ep_comm.benchmarks.torch_layer $args --jax-json "$OUT/layer_cutlass_$shape.json" \
      --json "$OUT/torch_layer_$shape.json" 2>&1 | tee "$OUT/torch_layer_$shape.txt"
  done
fi
if step overlap; then
  echo "== MoE layer as a pipeline of chunks: tests, then the overlap bench at full and held-back self-copy speed"
  install_wheels
  "$PY" -m pytest -q -p no:cacheprovider tests/test_pipeline.py tests/test_layer.py 2>&1 | tail -3 \
    | tee "$OUT/overlap_tests.txt"
  # B: the self copy's blocks (0: full speed; 4: a stand-in for a peer link), S: shared expert
  # width, then the chunk counts; every count as chunks of tokens and of experts
  for run in "4 2048 1,2,4" "0 2048 1,4,auto" "4 0 1,4"; do
    read -r B S CH <<< "$run"; tag="overlap_shared${S}_blocks$B"
    EP_COMM_SELF_COPY_BLOCKS=$B "$PY" -m ep_comm.benchmarks.layer --parts overlap --tokens 4096 \
      --hidden 7168 --intermediate 2048 --experts 32 --topk 8 --iters 10 --warmup 2 --chunks "$CH" \
      --chunk-by tokens,experts --shared-intermediate "$S" --profile "/tmp/$tag" \
      --json "$OUT/$tag.json" 2>&1 | tee "$OUT/$tag.txt"
    "$PY" tools/kernel_summary.py /tmp/"$tag"/* > "$OUT/${tag}_kernels.txt" 2>&1
  done
fi
if step wheel; then
  echo "== the binary wheel in a fresh venv, no nvcc on PATH (docs/install.md)"
  whl="$(ls dist/ep_comm-*.whl 2>/dev/null | head -1)"
  [ -n "$whl" ] || { echo "no dist/ep_comm-*.whl: run scripts/run.sh wheel and carry dist"; exit 1; }
  wv=/tmp/ep_comm_wheel_venv; rm -rf "$wv"
  # the image's jax comes from its site-packages (no internet here); ep_comm only from the wheel
  "$PY" -m venv --system-site-packages "$wv" && "$wv/bin/python" -m pip install -q --no-deps \
    --no-index "$whl"
  bare_path="$wv/bin:$(tr : '\n' <<< "$PATH" | grep -v -i cuda | paste -sd:)"
  repo="$PWD"
  in_wheel() { (cd /tmp && env -u PYTHONPATH PYTHONSAFEPATH=1 PATH="$bare_path" "$@"); }
  in_wheel sh -c 'command -v nvcc || echo "nvcc: not on PATH"' | tee "$OUT/wheel.txt"
  in_wheel python -c "
import os, ep_comm
from ep_comm import collectives
assert not os.path.abspath(ep_comm.__file__).startswith('$repo/ep_comm/'), ep_comm.__file__
print('ep_comm from', os.path.dirname(ep_comm.__file__))
print('available:', collectives.available())
print('build:', collectives.bootstrap.build_info())" 2>&1 | tee -a "$OUT/wheel.txt"
  in_wheel timeout "${WHEEL_TEST_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider \
    "$repo/tests/test_row_kernels.py" "$repo/tests/test_dispatch_combine.py" "$repo/tests/test_layer.py" \
    -k "${WHEEL_TESTS:-kernel or cutlass or fused or nccl}" 2>&1 | tail -6 | tee -a "$OUT/wheel.txt"
  # the layer at the DeepSeek-V3 rank shape, the wheel's and the source build's, one after the other
  for who in wheel source; do
    run=("$PY"); [ "$who" = source ] || run=(in_wheel python)
    ( [ "$who" = source ] || cd /tmp; "${run[@]}" -m ep_comm.benchmarks.layer --tokens 4096 --hidden 7168 \
      --intermediate 2048 --experts 32 --topk 8 --implementation cutlass --no-xla --parts layer \
      --json "$OUT/wheel_layer_$who.json" ) 2>&1 | tail -8 | tee "$OUT/wheel_layer_$who.txt"
  done
fi
if step ids; then
  echo "== what dispatch's run-time check of topk_ids costs moe_layer a call (tools/ids_check_probe.py)"
  install_wheels
  timeout "${IDS_TIMEOUT:-300}" "$PY" tools/ids_check_probe.py --tokens 4096 --hidden 7168 \
    --intermediate 2048 --experts 32 --topk 8 --gemm "${IDS_GEMM:-auto}" --iters 20 \
    --json "$OUT/ids_check.json" 2>&1 | tail -8 | tee "$OUT/ids_check.txt"
fi
if step lifecycle; then
  echo "== lifecycle: bootstrap -> exchange -> finalize cycles (NCCL), GPU memory against before"
  "$PY" tests/lifecycle.py --backend nccl --cycles "${LIFECYCLE_CYCLES:-50}" \
    --json "$OUT/lifecycle_gpu.json" 2>&1 | tail -40 | tee "$OUT/lifecycle_gpu.txt"
fi
if step topology; then
  echo "== topology: discovery (NVML) and the cost model's self link calibrated on this GPU"
  "$PY" -m ep_comm.topology --save "$OUT/topology.json" 2>&1 | tee "$OUT/topology.txt"
  "$PY" -m ep_comm.benchmarks.exchange --rows 1024,4096,16384,32768 --hidden 7168 --calibrate \
    --json "$OUT/calibration.json" 2>&1 | tee "$OUT/calibration.txt"
fi
