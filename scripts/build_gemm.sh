#!/usr/bin/env bash
# Configure and build the CUTLASS grouped GEMM module (_ep_gemm, sm_90a; a test build, its selftests
# compiled in) and its host-side layout test, copy the module into collectives/ and run the test (its line printed and appended
# to the log). One place for the build, shared by scripts/gpu_check.sh (on the GPU machine) and
# scripts/prebuild_gemm.sh (without a GPU). Exit status 3: the build failed (the log's tail
# printed); otherwise the layout test's (0, or 1 for wrong values).
#     scripts/build_gemm.sh PYTHON CUTLASS_SOURCE_DIR BUILD_DIR LOG
set -uo pipefail
[ $# = 4 ] || { echo "usage: $0 PYTHON CUTLASS_SOURCE_DIR BUILD_DIR LOG"; exit 2; }
py="$1" cutlass="$2" build="$3" log="$4"
cd "$(dirname "$0")/.."
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
  -DEP_COMM_CUTLASS_DIR="$cutlass" -DEP_COMM_SELFTESTS=ON > "$log" 2>&1 \
  && cmake --build "$build" --target _ep_gemm gemm_layout_test >> "$log" 2>&1 \
  && cp "$build"/collectives/csrc/_ep_gemm*.so collectives/ || { tail -30 "$log"; exit 3; }
"$build/collectives/csrc/gemm_layout_test" | tail -1 | tee -a "$log"
