#!/usr/bin/env bash
# The GPU checks of issue 38 on a lent GPU machine (benchmarks/gpu_check.py says what they
# are). That machine's python3 has torch, Triton, transformers and pytest but not msgspec,
# pyzmq or llguidance: benchmarks/gpu_wheels.sh downloads them here into .whl/ (carried
# with the run), and this script installs them into a folder of their own first.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:?give OUT_DIR or set OUT}}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hotswap-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/hotswap-site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 benchmarks/gpu_check.py "$out" "${@:2}"
