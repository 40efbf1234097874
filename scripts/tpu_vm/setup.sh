#!/usr/bin/env bash
# Installs this project with both papers' extras and the TPU extra (jax[tpu], which brings libtpu) into .venv on a
# Cloud TPU VM. Run it on every host of a pod slice (gcloud ... ssh --worker=all). Re-running it only upgrades what
# changed.
#
# Variables:
#   PYTHON   the interpreter for the venv (default python3.11; the project needs >= 3.11, and the TPU VM images'
#            Ubuntu 22.04 ships 3.10, so python3.11 is installed with apt when it is missing)
#
# Fashion-MNIST (the PGLA surrogate's images) comes from the Debian/Ubuntu package dataset-fashion-mnist when apt
# has it; otherwise pgla_train.sh takes DATA_PATH, a folder of the four IDX files you copied to the VM.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3.11}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if ! command -v "$PY" >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11 python3.11-venv
fi
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends dataset-fashion-mnist \
    || echo "note: no dataset-fashion-mnist package here; give pgla_train.sh DATA_PATH (Fashion-MNIST IDX files)" >&2
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e ".[sage,pgla,tpu]"
# Importing jax does not start the TPU runtime (on a pod slice that needs every host): versions only.
.venv/bin/python -c "import jax, flax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'orbax', o.__version__)"
