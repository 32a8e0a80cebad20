#!/usr/bin/env bash
# Wheels hotswap's engine needs that a lent GPU machine's Python (3.12, x86-64, no network)
# lacks, downloaded here into .whl/ (git-ignored): pass `carry: [".whl"]` to the device
# run, which benchmarks/gpu_check.sh installs from.
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for n in 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
  "msgspec>=0.18" "pyzmq>=25" "llguidance>=1.9,<2"
ls -la .whl
