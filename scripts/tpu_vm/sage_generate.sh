#!/usr/bin/env bash
# SAGE speculative generation with one of the paper's pairs (a 72B target and the 7B draft of its family) on a TPU
# VM or a pod slice: converts the two hub checkpoints you downloaded to our format (bf16, once), then answers the
# prompt with both models placed on a device mesh by the inference rules of configs/sharding.py (tensor-parallel
# over `model`). Run the same command on every host of a pod slice; process 0 prints.
#
#   TARGET_HF=~/hf/Qwen2.5-VL-72B-Instruct DRAFT_HF=~/hf/Qwen2.5-VL-7B-Instruct scripts/tpu_vm/sage_generate.sh
#
# Variables (defaults in brackets):
#   TARGET_HF, DRAFT_HF  local HF directories (config.json + safetensors + tokenizer/processor files) of the target
#                        and the draft, downloaded by you (this script downloads nothing); needed by STEP=convert
#   CKPT_DIR             where the converted checkpoints are, CKPT_DIR/target and CKPT_DIR/draft [~/sage_ckpt];
#                        on a pod slice a folder every host sees at this path (a gcsfuse-mounted bucket, Filestore
#                        NFS, or a disk attached read-only to every worker)
#   STEP                 convert | generate | all [all]: `all` converts what is missing, then generates. On a pod
#                        slice convert on one host first (STEP=convert, --worker=0), then STEP=generate on all
#   MESH                 the mesh, AXIS=SIZE,... over data, fsdp, model [model=8]: 8-way tensor parallel as in
#                        configs/sage/paper_targets.py (v6e-8: data=1; a 32-chip v5p-64: data=4); model=4 on v5p-8
#   PROMPT               the user message [What is in this image?]
#   IMAGE                an image file (on every host) for the prompt [none]
#   POLICY               ar | chain | static | eagle2 | sage [sage]
#   MAX_NEW_TOKENS       [256]
#   EXTRA_ARGS           more flags for python -m sage_jax.generate, e.g. "--json --compare" or "--budget 32,6"
set -euo pipefail
source "$(dirname "$0")/env.sh"

CKPT_DIR=${CKPT_DIR:-$HOME/sage_ckpt}
STEP=${STEP:-all}
MESH=${MESH:-model=8}
PROMPT=${PROMPT:-What is in this image?}
POLICY=${POLICY:-sage}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
case "$STEP" in convert|generate|all) ;; *) echo "error: STEP must be convert, generate or all, got '$STEP'" >&2; exit 2;; esac

convert() {  # convert NAME HF_DIR: one parameter in host memory at a time (python -m sage_jax.convert streams)
  local out="$CKPT_DIR/$1" src=$2
  if [ -f "$out/metadata.json" ]; then
    echo "$out: converted already" >&2
    return
  fi
  if [ -z "$src" ] || [ ! -f "$src/config.json" ]; then
    echo "error: $out is missing and ${1^^}_HF='$src' is not an HF directory (download it first)" >&2
    exit 2
  fi
  if [ "$(tpu_hosts)" -gt 1 ] && [ "$STEP" = all ]; then
    echo "error: $out is missing; on a pod slice convert on one host first (STEP=convert, --worker=0)" >&2
    exit 2
  fi
  mkdir -p "$CKPT_DIR"
  "$PY" -m sage_jax.convert "$src" "$out" --dtype bfloat16
}

if [ "$STEP" != generate ]; then
  convert target "${TARGET_HF:-}"
  convert draft "${DRAFT_HF:-}"
fi
if [ "$STEP" != convert ]; then
  for name in target draft; do
    [ -f "$CKPT_DIR/$name/metadata.json" ] || { echo "error: no converted $name in $CKPT_DIR (STEP=convert)" >&2; exit 2; }
  done
  # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
  exec "$PY" -m sage_jax.generate --target "$CKPT_DIR/target" --draft "$CKPT_DIR/draft" --mesh "$MESH" \
    --policy "$POLICY" --max-new-tokens "$MAX_NEW_TOKENS" --prompt "$PROMPT" ${IMAGE:+--image "$IMAGE"} \
    ${EXTRA_ARGS:-}
fi
