#!/usr/bin/env bash
# One device call: compile checks, the kernel GPU tests (memcheck included), the microbenchmarks.
#   bash bench/kernels/device_run.sh [quick|full|tests|bench]    (writes logs under $OUT)
set -o pipefail
mode=${1:-quick}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-model/src:packages/nanoqwen-kernels/src PYTHONUNBUFFERED=1
export NANOQWEN_REQUIRE_GPU=1 NANOQWEN_KERNEL_CACHE=/tmp/nq_kernel_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/smi.txt"
if [ "$mode" != bench ]; then
  timeout 300 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
    packages/nanoqwen-kernels/tests/test_build.py packages/nanoqwen-kernels/tests/test_gemv.py \
    packages/nanoqwen-kernels/tests/test_layer_ops.py packages/nanoqwen-kernels/tests/test_sampling.py \
    packages/nanoqwen-kernels/tests/test_memcheck.py 2>&1 | tee "$OUT/tests.log" | grep -vE "^\.+ *\[" | tail -60
fi
if [ "$mode" != tests ]; then
  args="--out $OUT"
  [ "$mode" = quick ] && args="$args --quick"
  timeout 200 python bench/kernels/bench_kernels.py $args 2>&1 | tee "$OUT/bench.log" | tail -80
fi
