#!/usr/bin/env bash
# One prepared accelerator run (GPU machine or TPU VM), under 8 minutes:
#  1. the Pallas tree-attention kernel against the XLA path at 72B-layer shapes, and the verify forward of a
#     random 7B-shaped target with --attention xla / pallas (benchmarks/sage/tree_attention_bench.py);
#  2. verify-cost curves of random-weight targets (0.5B / 7B, bf16) at 1..1024 tree nodes beside the cost model's
#     prediction for the chip, the tree-mask attention paths, and the shipped SmolLM2 + head end to end, AR against
#     SAGE (--budget auto and full trees), every output compared with AR's (benchmarks/sage/device_bench.py);
#  3. bfloat16 SAGE against AR with XLA's dot and in the exact mode (--matmul exact), agreement and cost
#     (benchmarks/sage/bf16_agreement.py): the exact mode's guarantee checked on the accelerator.
#   bash benchmarks/device_bench.sh            # results in $OUT (or out/device_bench)
# Needs this checkout installed with the accelerator's jax (pip install -e ".[sage]" 'jax[cuda12]' or ".[sage,tpu]").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-out/device_bench}
mkdir -p "$OUT"
"$PY" -c "import jax; print(jax.devices())"
# Each part keeps what it measured if the other fails or runs out of time.
timeout 150 "$PY" benchmarks/sage/tree_attention_bench.py --out "$OUT" --seconds 100 | tee "$OUT/tree_attention.md"
timeout 230 "$PY" benchmarks/sage/device_bench.py --out "$OUT" --sizes 0.5b,7b --seconds 90 | tee "$OUT/device_bench.md"
timeout 90 "$PY" benchmarks/sage/bf16_agreement.py "$OUT/exact_mode.json" --prompts 3 --max-new-tokens 48 \
  --modes bfloat16:xla,bfloat16:exact | tee "$OUT/exact_mode.md"
