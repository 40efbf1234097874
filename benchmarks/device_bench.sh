#!/usr/bin/env bash
# One prepared accelerator run (GPU machine or TPU VM), under 10 minutes: verify-cost curves of random-weight
# targets (0.5B / 1.5B / 7B, bf16) at 1..256 tree nodes, and the tree-mask attention paths.
#   bash benchmarks/device_bench.sh            # results in $OUT (or out/device_bench)
# Needs this checkout installed with the accelerator's jax (pip install -e . 'jax[cuda12]' or 'jax[tpu]').
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-out/device_bench}
mkdir -p "$OUT"
"$PY" -c "import jax; print(jax.devices())"
timeout 560 "$PY" benchmarks/sage/device_bench.py --out "$OUT" --seconds 420 | tee "$OUT/device_bench.md"
