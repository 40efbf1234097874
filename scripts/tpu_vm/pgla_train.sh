#!/usr/bin/env bash
# Trains PGLA's gradient diffusion denoiser at the paper's scale (configs/pgla/denoiser_paper.py: the U-Net at dim
# 120, batches of 32, 2,500 steps) data-parallel over every TPU chip of a VM or of a pod slice: each batch is cut
# over the mesh's `data` axis, each host reading only its rows. Run the same command on every host of a pod slice;
# process 0 prints. Rerunning it resumes from WORKDIR's saved state.
#
#   scripts/tpu_vm/pgla_train.sh
#   python -m pgla_jax.attack --denoiser runs/denoiser_paper/denoiser     # then, on one host
#
# Variables (defaults in brackets):
#   CONFIG       a name in configs/pgla/ or a .py file [denoiser_paper]
#   WORKDIR      the data set, the training state and the checkpoints [runs/denoiser_paper]; on a pod slice a folder
#                every host sees at this path (Filestore NFS or a gcsfuse-mounted bucket): the hosts write the
#                checkpoints together and read the state back when resuming
#   MESH         AXIS=SIZE,... [data=-1]: every chip data-parallel; the batch (32) must divide by the data size
#   DATA_PATH    a folder with the Fashion-MNIST IDX files, when the dataset-fashion-mnist package is not installed
#   MAX_STEPS    stop after this many steps of the schedule (a later run resumes) [the whole run]
#   EXTRA_ARGS   more flags for python -m pgla_jax.train_denoiser, e.g. "--set steps=5000"
set -euo pipefail
source "$(dirname "$0")/env.sh"

CONFIG=${CONFIG:-denoiser_paper}
WORKDIR=${WORKDIR:-runs/denoiser_paper}
MESH=${MESH:-data=-1}

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
exec "$PY" -m pgla_jax.train_denoiser --config "$CONFIG" --workdir "$WORKDIR" --mesh "$MESH" \
  ${DATA_PATH:+--data-path "$DATA_PATH"} ${MAX_STEPS:+--max-steps "$MAX_STEPS"} ${EXTRA_ARGS:-}
