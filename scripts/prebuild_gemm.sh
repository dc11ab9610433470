#!/usr/bin/env bash
# Build the CUTLASS grouped GEMM module (_ep_gemm, sm_90a) here, on a machine without a GPU, for
# the GPU machine's Python and jaxlib, so a device call carries it (`GEMM_PREBUILT=1
# scripts/gpu_check.sh`, with collectives/_ep_gemm*.so in the call's carry) instead of spending
# device time on the build. Needs nvcc (CUDA 13 here, as on the GPU image), the nvidia-cutlass
# wheel in .whl/ (../shared/NOTES.md) and a Python of the GPU image's version (PY_VERSION, default
# 3.12) with pip access for jax/jaxlib (JAX_VERSION, default the GPU image's 0.11.2: the FFI
# headers) and nanobind. Runs the host-side layout test (no GPU needed) on what it built.
# On the 2-core CPU machine: about 4 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
JAX_VERSION="${JAX_VERSION:-0.11.2}"
WORK="${WORK:-/tmp/ep_comm_prebuild}"
py="$(command -v "python$PY_VERSION" || true)"
# (a pyenv shim answers even where that version is not selected: take the interpreter itself)
pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
for d in "$pyenv_root"/versions/"$PY_VERSION"*; do
  if [ -x "$d/bin/python$PY_VERSION" ]; then py="$d/bin/python$PY_VERSION"; fi
done
[ -n "$py" ] || { echo "prebuild_gemm: no python$PY_VERSION here (PY_VERSION)"; exit 1; }
wheel="$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)"
[ -n "$wheel" ] || { echo "prebuild_gemm: no .whl/nvidia_cutlass-*.whl (NOTES.md)"; exit 1; }
command -v nvcc > /dev/null || { echo "prebuild_gemm: no nvcc"; exit 1; }
mkdir -p "$WORK"
[ -x "$WORK/venv/bin/python" ] || "$py" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q nanobind "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" numpy 2>&1 \
  | grep -v "^WARNING: Location" || true
rm -rf "$WORK/cutlass" && mkdir -p "$WORK/cutlass"
(cd "$WORK/cutlass" && unzip -q "$OLDPWD/$wheel")
t0=$(date +%s)
scripts/build_gemm.sh "$WORK/venv/bin/python" "$WORK/cutlass/cutlass_library/source" \
  "$WORK/build" "$WORK/build.txt"
echo "built in $(( $(date +%s) - t0 )) s: $(ls collectives/_ep_gemm*.so) (jaxlib $JAX_VERSION," \
     "python $PY_VERSION); carry it with .whl and run GEMM_PREBUILT=1 scripts/gpu_check.sh"
