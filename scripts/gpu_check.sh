#!/usr/bin/env bash
# Everything one GPU can show, in one go (for the device machine; no install, no internet):
# the test suite on the GPU (xla and portable backends), the example, and the benchmark at a
# DeepSeek-V3-like single-rank config. Output tables and JSON land in ${OUT:-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
echo "== tests on $("$PY" -c 'import jax; print(jax.device_count())') GPU(s)"
"$PY" -m pytest -q -p no:cacheprovider --timeout 600 -x tests 2>&1 | tail -15 | tee "$OUT/tests.txt"
echo "== example"
"$PY" examples/moe_transformer.py --steps 100 2>&1 | tail -4 | tee "$OUT/example.txt"
echo "== bench"
for t in 4096 8192; do
  "$PY" -m ep_comm.bench --tokens $t --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 \
    --iters 20 --json "$OUT/bench_T$t.json" 2>&1 | tee "$OUT/bench_T$t.txt"
done
