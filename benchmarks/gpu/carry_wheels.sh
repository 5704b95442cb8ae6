#!/usr/bin/env bash
# The Python packages benchmarks/gpu_check.py needs that the device image lacks (its package list: no trl, no
# datasets, and datasets' dill and multiprocess; no bitsandbytes, 43 MB with its CUDA kernels), downloaded here as wheels for the image's Python 3.12 into .whl/
# (git-ignored). Pass `.whl` in the device run's `carry`; gpu_check.py installs whatever .whl/ holds, without the
# network, next to the checkout before any section runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rm -rf .whl && mkdir -p .whl
for spec in "trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "bitsandbytes==0.50.2"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls -la .whl
