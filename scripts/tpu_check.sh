#!/usr/bin/env bash
# Everything one TPU chip can show, in one go (the device tool's tpu-v5e kind: Python 3.11, jax
# 0.10.2, no sockets, one program on the chip at a time; nothing installed beyond jax):
#   info     the platform, ep_comm.collectives.available() and what backend="auto" takes there;
#   bench    ep_comm.benchmarks.dispatch at the issue's shape (T=4096, top-8 of 32, H=2048, bf16) and at a
#            DeepSeek-V3-like rank (H=7168, top-8 of 256), plain JAX's permute/unpermute beside;
#   layer    ep_comm.benchmarks.layer's layer at T=4096, H=2048, I=1024, top-8 of 32, and at a
#            DeepSeek-V3-like rank (H=7168, I=2048), with lax.ragged_dot, moe_layer beside the
#            plain JAX layer with the same GEMM;
#   megablox the layer on megablox (tools/tpu_megablox.py, the tilings of ep_comm.gemm's table, no
#            sweep): moe_layer beside the plain layer at MaxText's tiling and the dense einsums,
#            both shapes, each layer's device time split into GEMMs and the rest (--profile);
#   tokamax  (when named, and .whl-tpu/ holds tokamax and its wheels: README's recipe with
#            --python-version 3.11; flax and the rest from the machine's own index) the layer
#            again with grouped_matmul's default, tokamax's Mosaic TPU kernel on both sides;
#   tests    the suite on the chip, one process (TESTS picks files; TEST_TIMEOUT bounds it), last.
# STEPS picks steps (default info,tests,bench,layer,megablox). Tables and JSON land in ${OUT:-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
. scripts/source_tree.sh  # the installed layout of the source tree on PYTHONPATH
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STEPS=",${STEPS:-info,tests,bench,layer,megablox},"
step() { [[ "$STEPS" == *",$1,"* ]]; }
quiet() { grep -v -i "hugepage\|warnings.warn"; }
step info && "$PY" -c "
import jax
from ep_comm import collectives
print('jax', jax.__version__, jax.devices())
print('available:', collectives.available())
print('auto:', collectives.auto_choice())" 2>&1 | quiet | tee "$OUT/tpu.txt"
if step bench; then
  echo "== dispatch/combine bench, plain JAX beside"
  "$PY" -m ep_comm.benchmarks.dispatch --tokens 4096 --hidden 2048 --topk 8 --experts 32 --dtype bfloat16 \
    --routing uniform --iters 20 --round-trip --capacity-factors none --backends xla \
    --json "$OUT/bench_T4096_H2048.json" 2>&1 | quiet | tee "$OUT/bench_T4096_H2048.txt"
  "$PY" -m ep_comm.benchmarks.dispatch --tokens 4096 --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 \
    --routing uniform --iters 20 --round-trip --capacity-factors none --backends xla \
    --json "$OUT/bench_T4096_H7168.json" 2>&1 | quiet | tee "$OUT/bench_T4096_H7168.txt"
fi
layer() {  # $1: a name, then layer_bench's arguments
  local name="$1"; shift
  "$PY" -m ep_comm.benchmarks.layer --parts layer --tokens 4096 --hidden 2048 --intermediate 1024 \
    --experts 32 --topk 8 --dtype bfloat16 --iters 10 "$@" --json "$OUT/layer_$name.json" \
    2>&1 | quiet | tee "$OUT/layer_$name.txt"
}
if step layer; then
  echo "== layer, lax.ragged_dot on both sides" && layer ragged_dot --implementation xla
  echo "== layer at a DeepSeek-V3-like rank (H=7168, I=2048, top-8 of 32), lax.ragged_dot"
  layer H7168_ragged_dot --implementation xla --hidden 7168 --intermediate 2048
fi
if step megablox; then
  for shape in "2048 1024" "7168 2048"; do
    read -r H I <<< "$shape"
    echo "== layer on megablox, H=$H, I=$I (moe_layer, the plain layer at MaxText's tiling, dense)"
    "$PY" tools/tpu_megablox.py --hidden "$H" --intermediate "$I" --no-sweep \
      --profile "/tmp/megablox_H$H" --json "$OUT/megablox_H$H.json" 2>&1 | quiet \
      | tee "$OUT/megablox_H$H.txt" | tail -30
  done
fi
if step tokamax; then
  echo "== layer, tokamax's Mosaic TPU kernel on both sides"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl-tpu/*.whl >/dev/null 2>&1 || echo "note: the wheels of .whl-tpu/ did not install"
  for pkg in flax jaxtyping tensorboardx opt_einsum tqdm absl-py; do
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
      --index-url file:///opt/pypi/simple --target /tmp/site2 "$pkg" >/dev/null 2>&1 \
      || echo "note: $pkg is not on the machine's index"
  done
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site2"  # (after the machine's own jax)
  "$PY" -c "from ep_comm import gemm; print('tokamax TPU kernel:', gemm.tokamax_available(), gemm.tokamax_unavailable_reason() or '')" \
    2>&1 | quiet | tail -3
  layer tokamax --no-xla
  [ "${TOKAMAX_H7168:-1}" = 0 ] || layer H7168_tokamax --no-xla --hidden 7168 --intermediate 2048
fi
# last: the longest, bounded by TEST_TIMEOUT (the whole log in tests_log.txt)
if step tests; then
  echo "== tests on the chip (one process)"
  timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --tb=short \
    -rf ${TESTS:-tests/test_row_kernels.py tests/test_rows.py tests/test_dispatch_combine.py tests/test_layer.py tests/test_ragged_all_to_all.py tests/test_lowering.py} 2>&1 | quiet \
    > "$OUT/tests_log.txt"; tail -40 "$OUT/tests_log.txt" | tee "$OUT/tests.txt"
fi
