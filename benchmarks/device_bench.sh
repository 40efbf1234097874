#!/usr/bin/env bash
# One prepared accelerator run (GPU machine or TPU VM), under 10 minutes:
#  1. the Pallas tree-attention kernel against the XLA path at 72B-layer shapes, and the verify forward of a
#     random 7B-shaped target with --attention xla / pallas (benchmarks/sage/tree_attention_bench.py);
#  2. verify-cost curves of random-weight targets (0.5B / 7B, bf16) at 1..1024 tree nodes beside the cost model's
#     prediction for the chip, the tree-mask attention paths, and the shipped SmolLM2 + head end to end, AR against
#     SAGE (--budget auto and full trees), every output compared with AR's (benchmarks/sage/device_bench.py);
#  3. bfloat16 SAGE against AR with XLA's dot and in the exact mode (--matmul exact), agreement and cost
#     (benchmarks/sage/bf16_agreement.py): the exact mode's guarantee checked on the accelerator, and where the
#     machine has two chips on a 2-way tensor-parallel mesh too (equal to the one-chip tokens);
#  4. the exact mode's fixed-order attention kernel against its jnp reference at 72B-layer shapes: time, bits, and
#     on this device a row alone = among others, a verified node = its decode step
#     (benchmarks/sage/exact_attention_bench.py).
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
modes=bfloat16:xla,bfloat16:exact
if "$PY" -c "import jax, sys; sys.exit(jax.device_count() < 2)"; then modes=$modes,bfloat16:exact:tp2; fi
timeout 120 "$PY" benchmarks/sage/bf16_agreement.py "$OUT/exact_mode.json" --prompts 3 --max-new-tokens 48 \
  --modes $modes | tee "$OUT/exact_mode.md"
timeout 90 "$PY" benchmarks/sage/exact_attention_bench.py --out "$OUT" --seconds 60 | tee "$OUT/exact_attention.md"
