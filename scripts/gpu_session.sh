#!/usr/bin/env bash
# One call on a lent GPU: the GPU bench (bench/gpu.py), then the CUDA tests, each with its log under $OUT, and the
# bench's JSON record ($OUT/real.json; copy it to docs/bench/gpu/ and run `python bench/gpu.py --render`).
#
# On the device (docs/performance.md, "GPU at real model sizes", says which wheels to carry in .whl/):
#   bash scripts/gpu_session.sh
# Here, on the CPU, the same steps at toy size (the CUDA tests skip):
#   OUT=/tmp/gpu_session bash scripts/gpu_session.sh --toy --device cpu --steps 1
# Arguments go to bench/gpu.py. BENCH_SECONDS and TEST_SECONDS cap each part (defaults 420 and 120: with the device
# call's start, a call with timeout_s=580 ends in time).
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
timeout "${BENCH_SECONDS:-420}" python3 bench/gpu.py --budget 360 --out "$OUT/real.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench/gpu.py exit status: $?" | tee -a "$OUT/bench.log"
timeout "${TEST_SECONDS:-120}" python3 -m pytest -q -p no:cacheprovider -n 0 -rs \
    tests/engine/test_devices.py tests/clipping/test_clipping.py tests/clipping/test_rows.py \
    tests/engine/test_host_syncs.py tests/models/test_model_zoo.py tests/clipping/test_clipping_randomized.py \
    -k "cuda or test_devices" 2>&1 | tee "$OUT/tests.log"
echo "CUDA tests exit status: $?" | tee -a "$OUT/tests.log"
